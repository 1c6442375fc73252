"""Trust from where: what a deployment run's parameters may name on this worker host.

The operator's own job file (given to `spotrun run` or `python -m spotrun.trainer --config`) is trusted as
written. A deployment run's parameters come from whoever can reach the Prefect API: the UI's form, the
API, an automation. Prefect OSS has no roles, so whoever can start a run can also edit a deployment's
defaults; what such a run may name (an interpreter, a recipe module, an entry point, a command or a
hook, environment names, a non-https endpoint, a tracking URI) is therefore decided on the worker host,
from a 0600 settings file under $SPOTRUN_HOME (ALLOWED_FILE) that `spotrun deploy` writes from the
deployments' own defaults and that the operator may add to. Nothing read back from the API widens it.

`refusal` is the decision (pure); `refuse_untrusted_parameters` applies it at a flow's start, to
deployment runs only: a run started in-process by `spotrun run` has no deployment.
"""

from __future__ import annotations

import functools
import inspect
import ipaddress
import logging
import os
import shlex
import stat
import sys
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast
from urllib.parse import urlsplit

import yaml

from spotrun.tasks.providers.registry import ProviderConfig
from spotrun.tasks.providers.trainer_env import passes
from spotrun.trainer.checkpoint.signing import KEY_ENV, OLD_KEYS_ENV, keyring
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import JobSpec

ALLOWED_FILE = "allowed.yaml"
log = logging.getLogger(__name__)
OPERATOR, DEPLOYMENTS = "allow", "deployments"  # the file's sections: the operator's, spotrun deploy's
HEADER = f"""\
# What a deployment run's parameters (the Prefect UI form, the API, an automation) may name on this
# worker host, beyond built-in recipes, the flow's own interpreter, local directories and the default
# environment. Endpoints, S3 storage and warm-start sources are listed, https or not.
# `{DEPLOYMENTS}:` is what the deployments' defaults name: `spotrun deploy` rewrites it.
# `{OPERATOR}:` is yours: `spotrun deploy` keeps it. Keep this file 0600: whoever can edit it can run code.
"""


@dataclass(frozen=True)
class Allowed:
    """What a deployment run may name beyond the defaults (every list exact strings)."""

    python: frozenset[str] = frozenset()  # provider.python: interpreters
    recipes: frozenset[str] = frozenset()  # recipe import strings, package.module:function
    entrypoints: frozenset[str] = frozenset()  # entry points (package.module:function): code, always listed
    # commands and hooks, each its whole argv as `shlex.join` writes it: a program's arguments can run code
    # too (`python -c ...`), so the exact command is allowed, never a program with any arguments
    commands: frozenset[str] = frozenset()
    env: frozenset[str] = frozenset()  # names in env.pass and env.set
    # s3.endpoint_url, provider.endpoint_url: where a run may send data, each scheme://host[:port]
    endpoints: frozenset[str] = frozenset()
    storage: frozenset[str] = frozenset()  # s3://bucket[/prefix]: a run's store is one of them or below one
    init_from: frozenset[str] = frozenset()  # jobs a run may warm-start from, beyond its own
    tracking: frozenset[str] = frozenset()  # tracking.uri
    keep_runs: frozenset[str] = frozenset()  # keep_runs values: a run may keep as many or more
    loopback: bool = False  # http endpoints on 127.0.0.1, ::1 or localhost (tests, moto)

    def __or__(self, other: Allowed) -> Allowed:
        sets = {f.name: getattr(self, f.name) | getattr(other, f.name) for f in fields(self)}
        return Allowed(**sets)

    def as_yaml(self) -> dict[str, Any]:
        return {
            f.name: v if isinstance(v := getattr(self, f.name), bool) else sorted(v) for f in fields(self)
        }

    @classmethod
    def from_yaml(cls, doc: Any, where: str) -> Allowed:
        if doc is None:
            return cls()
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: expected a mapping of {', '.join(f.name for f in fields(cls))}")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(doc) - known):
            raise ConfigError(f"{where}: unknown key {unknown[0]!r}; use {', '.join(sorted(known))}")
        loopback = doc.get("loopback", False)
        if not isinstance(loopback, bool):
            raise ConfigError(f"{where}.loopback: use true or false")
        lists = {k: _strings(doc.get(k), f"{where}.{k}") for k in known - {"loopback"}}
        return cls(loopback=loopback, **lists | {"recipes": _renamed_recipes(lists["recipes"], where)})


OLD_ROOT = "trainer.recipes."  # spotrun 0.1's spelling of its recipe modules (CHANGELOG.md, 0.2.0)


def _renamed_recipes(recipes: frozenset[str], where: str) -> frozenset[str]:
    """`recipes` with each entry spelt the 0.1 way (`trainer.recipes...`) allowed as
    `spotrun.trainer.recipes...` too, with a warning: what the operator wrote stays allowed, under both."""
    old = sorted(r for r in recipes if r.startswith(OLD_ROOT))
    if old:
        log.warning("%s.recipes: %s is spelt as before spotrun 0.2; write spotrun.%s", where, old[0], old[0])
    return recipes | {f"spotrun.{r}" for r in old}


def _strings(v: Any, where: str) -> frozenset[str]:
    if v is None:
        return frozenset()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ConfigError(f"{where}: use a list of strings")
    return frozenset(v)


# ---- the decision ----


def refusal(
    job: JobSpec, provider: ProviderConfig, allowed: Allowed, *, own_python: str, settings: str
) -> str | None:
    """Why a deployment run with these parameters may not start (one line naming the field and the fix),
    or None. `own_python`: the flow's interpreter; `settings`: the settings file, for the message."""

    def fix(kind: str) -> str:
        return f"add it under {OPERATOR}.{kind} in {settings}, or run the job file with `spotrun run`"

    python_ok = {None, own_python, type(provider).model_fields["python"].default} | allowed.python
    if provider.python not in python_ok:
        return (
            f"provider.python: {provider.python!r} is not an interpreter this host lets a deployment "
            f"run name; {fix('python')}"
        )
    if job.recipe is not None and ":" in job.recipe and job.recipe not in allowed.recipes:
        return (
            f"recipe: {job.recipe!r} is a module this host does not let a deployment run import; "
            f"{fix('recipes')}"
        )
    if job.entrypoint is not None and job.entrypoint not in allowed.entrypoints:
        what = f"entrypoint: {job.entrypoint!r} is code this host does not let a deployment run import"
        return f"{what}; {fix('entrypoints')}"
    if job.command is not None and shlex.join(job.command) not in allowed.commands:
        what = f"command: {shlex.join(job.command)!r} is not a command this host lets a deployment run start"
        return f"{what}; {fix('commands')}"
    for event, argv in (job.hooks.commands() if job.hooks is not None else {}).items():
        if shlex.join(argv) not in allowed.commands:  # a hook is a command: the same list, exact
            what = (
                f"hooks.{event}: {shlex.join(argv)!r} is not a command this host lets a deployment run start"
            )
            return f"{what}; {fix('commands')}"
    for where, names in (("env.pass", job.env.pass_), ("env.set", list(job.env.set_))):
        for name in names:  # passing a variable that passes anyway changes nothing; setting one may
            if name not in allowed.env and not (where == "env.pass" and passes(name)):
                return f"{where}: {name} is not a variable this host lets a deployment run name; {fix('env')}"
    if why := _where_data_goes(job, provider, allowed, fix):
        return why
    if why := provider.deployment_refusal(is_loopback):
        return why
    if why := _keyed_refusal(job, allowed, fix("keep_runs")):
        return why
    uri = job.tracking.uri
    if uri is not None and uri not in allowed.tracking:
        return (
            f"tracking.uri: {uri!r} is not a tracking URI this host lets a deployment run name; "
            f"{fix('tracking')}"
        )
    return None


def _where_data_goes(
    job: JobSpec, provider: ProviderConfig, allowed: Allowed, fix: Callable[[str], str]
) -> str | None:
    """A form may send checkpoints (and the model a warm start reads) only where this host said: the
    endpoints and S3 stores the settings list (default: the deployments' own), and a warm start from the
    job itself or a listed job. Local directories are the worker's own disk: not checked
    (docs/security.md)."""
    endpoints = {"s3.endpoint_url": job.s3.endpoint_url, **provider.endpoints()}
    for field, url in endpoints.items():
        if url is not None and not endpoint_allowed(url, allowed):
            return (
                f"{field}: {url!r} is not an endpoint this host lets a deployment run send data to; "
                f"{fix('endpoints')} (a loopback test server: {OPERATOR}.loopback: true)"
            )
    if job.storage.startswith("s3://") and not storage_allowed(job.storage, allowed.storage):
        return (
            f"storage: {job.storage!r} is not a store this host lets a deployment run write; {fix('storage')}"
        )
    source = job.init_from.job if job.init_from is not None else None
    if source is not None and source != job.name and source not in allowed.init_from:
        return (
            f"init_from.job: {source!r} is another job, whose model this host does not let a deployment run "
            f"read; {fix('init_from')}"
        )
    return None


def storage_allowed(uri: str, patterns: Collection[str]) -> bool:
    """`uri` is a listed store or below one (`s3://b/team` allows `s3://b/team/x`, not `s3://b/teamx`)."""
    here = uri.rstrip("/")
    return any(here == p.rstrip("/") or here.startswith(p.rstrip("/") + "/") for p in patterns)


def _origin(url: str) -> str:
    parts = urlsplit(url.strip())
    return (
        f"{parts.scheme.lower()}://{(parts.hostname or '').lower()}{f':{parts.port}' if parts.port else ''}"
    )


def _keyed_refusal(job: JobSpec, allowed: Allowed, fix: str) -> str | None:
    """What spotrun fills (the run's values and sources) a form may not set; `keep_runs` deletes older
    runs' checkpoints, so a form may keep as many as the host's settings name, or more, never fewer."""
    filled = [
        ("run_values", bool(job.run_values)),
        ("init_from.source", job.init_from is not None and job.init_from.source is not None),
        ("promote.champion", job.promote is not None and job.promote.champion is not None),
    ]
    for field, given in filled:
        if given:
            return f"{field} is filled by spotrun when a run key starts; leave it empty in the parameters"
    least = min((int(v) for v in allowed.keep_runs if v.isdigit()), default=None)
    if job.keep_runs is not None and (least is None or job.keep_runs < least):
        floor = f"at least {least}" if least is not None else "no keep_runs"
        return (
            f"keep_runs: {job.keep_runs} would delete older runs' checkpoints, and this host's settings "
            f"let a deployment run set {floor}; {fix}"
        )
    return None


def endpoint_allowed(url: str, allowed: Allowed) -> bool:
    """Listed (by scheme, host and port: https is no permission, since anyone can serve it), or (where
    the settings allow it) on loopback."""
    try:
        if _origin(url) in {_origin(e) for e in allowed.endpoints}:
            return True
    except ValueError:  # a port out of range: no endpoint of anyone's
        return False
    return allowed.loopback and is_loopback(url)


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def named(params: Mapping[str, Any]) -> Allowed:
    """What a deployment's default parameters (`job`, `provider`, as prefect.yaml holds them) name, pure."""
    job, provider = _dict(params.get("job")), _dict(params.get("provider"))
    env = _dict(job.get("env"))
    recipe, storage = job.get("recipe"), job.get("storage")
    endpoints = [_dict(job.get("s3")).get("endpoint_url"), provider.get("endpoint_url")]
    s3 = [storage] if isinstance(storage, str) and storage.startswith("s3://") else []
    return Allowed(
        python=_present([provider.get("python")]),
        recipes=_present([recipe] if isinstance(recipe, str) and ":" in recipe else []),
        entrypoints=_present([job.get("entrypoint")]),
        commands=_present([_joined(job.get("command")), *_hook_commands(job.get("hooks"))]),
        env=_present([*(env.get("pass") or []), *_dict(env.get("set"))]),
        endpoints=_present(e for e in endpoints if isinstance(e, str)),
        storage=_present(s3),
        init_from=_present(
            [source] if (source := _dict(job.get("init_from")).get("job")) != job.get("name") else []
        ),
        tracking=_present([_dict(job.get("tracking")).get("uri")]),
        keep_runs=_present([str(job["keep_runs"])] if isinstance(job.get("keep_runs"), int) else []),
    )


def _joined(argv: Any) -> str | None:
    """A command as the allow-list writes it (shlex.join), None when it is not a list of strings."""
    ok = isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return shlex.join(argv) if ok else None


def _hook_commands(hooks: Any) -> list[str | None]:
    """The hooks' commands as the allow-list writes them (a string split as the job spec splits it)."""
    out: list[str | None] = []
    for event, argv in _dict(hooks).items():
        if event == "timeout_s":
            continue
        try:
            out.append(_joined(shlex.split(argv) if isinstance(argv, str) else argv))
        except ValueError:  # unbalanced quotes: the spec refuses it, so nothing to allow
            continue
    return out


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _present(values: Iterable[Any]) -> frozenset[str]:
    return frozenset(v for v in values if isinstance(v, str) and v)


# ---- the settings file ----


def settings_path(home: Path) -> Path:
    return home / ALLOWED_FILE


def read_allowed(home: Path) -> Allowed:
    """Both sections of the host's settings file; nothing beyond the defaults when there is no file.
    ConfigError (one line) when it is unreadable, malformed, or writable by others."""
    path = settings_path(home)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return Allowed()
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"{path} is writable by others, so it cannot be trusted: chmod 600 {path}")
    doc = _load(path)
    return Allowed.from_yaml(doc.get(OPERATOR), f"{path}: {OPERATOR}") | Allowed.from_yaml(
        doc.get(DEPLOYMENTS), f"{path}: {DEPLOYMENTS}"
    )


def write_allowed(home: Path, deployments: Allowed) -> Path:
    """Rewrite the `deployments` section (keeping the operator's), 0600, atomically."""
    path = settings_path(home)
    operator = _load(path).get(OPERATOR) if path.exists() else None
    kept = Allowed.from_yaml(operator, f"{path}: {OPERATOR}")  # a malformed one is refused, not dropped
    defaults = {k: v for k, v in deployments.as_yaml().items() if k != "loopback"}  # the operator's say
    body = yaml.safe_dump({OPERATOR: kept.as_yaml(), DEPLOYMENTS: defaults}, sort_keys=False)
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(HEADER + body)
    os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply to a leftover file of the same name
    os.replace(tmp, path)
    return path


def _load(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML ({getattr(e, 'problem', e)}); fix it") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected the sections {OPERATOR}: and {DEPLOYMENTS}:")
    return doc


P = ParamSpec("P")
R = TypeVar("R")


# ---- keys: the controller verifies only what its workers sign ----


def signing_refusal(job: JobSpec, provider: ProviderConfig, environ: Mapping[str, str]) -> str | None:
    """Why a run must not start because the controller holds manifest keys (and so quarantines nothing
    but alerts on every checkpoint it cannot verify) while its workers would not sign; None when the
    workers sign with the controller's key, or nobody verifies."""
    ring = keyring(environ)
    if not ring.verifying:
        return None
    if ring.signing is None:
        return f"{OLD_KEYS_ENV} is set but {KEY_ENV} is not: workers would not sign; set {KEY_ENV} too"
    return provider.signing_refusal(job, environ)  # how the key reaches the workers is the provider's


def unsigned_warning(job: JobSpec, environ: Mapping[str, str]) -> str | None:
    """What a run without a signing key leaves open, in one line, for its start (None: it signs)."""
    if keyring(environ).signing is not None:
        return None
    return (
        f"{job.name}'s checkpoints are not signed ({KEY_ENV} is not set): whoever can write "
        f"{job.storage or 'its storage'} can change the weights, optimizer state and markers a resume reads "
        "without it being detected (digests catch damage, not an adversary); set a key of 32 bytes or "
        "more on the controller and the workers (docs/security.md)"
    )


# ---- at a flow's start ----


def run_refusal(
    deployment_id: str | None, job: JobSpec, provider: ProviderConfig, *, home: Path, own_python: str
) -> str | None:
    """`refusal` for a deployment run, under the settings in `home`; None for any other run: one started
    in-process from the operator's own job file (`spotrun run`) has no deployment, and runs as written."""
    if deployment_id is None:
        return None
    try:
        return refusal(
            job, provider, read_allowed(home), own_python=own_python, settings=str(settings_path(home))
        )
    except ConfigError as e:  # the settings file itself is bad: nothing beyond the defaults is trusted
        return str(e)


def refuse_untrusted_parameters(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a flow function taking `job` and `provider`: a deployment run whose parameters name what
    this host does not allow ends Failed with the refusal's line, before the function runs (no slot, no
    worker, no history row); any other run (`spotrun run`'s, in-process) runs as written."""
    from prefect import get_run_logger
    from prefect.context import FlowRunContext
    from prefect.states import Failed

    from spotrun.tasks.settings import spotrun_home

    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        job, provider = bound.arguments["job"], bound.arguments["provider"]
        ctx = FlowRunContext.get()  # the run as the engine loaded it: no API call
        run = ctx.flow_run if ctx is not None else None
        deployment_id = str(run.deployment_id) if run is not None and run.deployment_id else None
        why = run_refusal(deployment_id, job, provider, home=spotrun_home(), own_python=sys.executable)
        why = why or signing_refusal(job, provider, os.environ)
        if why is not None:
            get_run_logger().error("refused: %s", why)
            return cast(R, Failed(message=f"refused: {why}"))
        if warning := unsigned_warning(job, os.environ):  # once per run, where its log is read
            get_run_logger().warning(warning)
        return fn(*args, **kwargs)

    checked.__signature__ = signature  # type: ignore[attr-defined]
    return checked
