"""Apply spotrun to a Prefect server: the work pool, the deployments of prefect.yaml, the automations.

Also writes this host's trust settings ($SPOTRUN_HOME/allowed.yaml, tasks/admission/trust.py): what the
deployments' defaults name, which a deployment run may name too.

Idempotent: the pool is created only when missing, `prefect deploy` updates deployments in place by
name (and the nightly schedule by its slug), automations are matched by name. Applying twice leaves
the same ids and nothing new.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml
from prefect import get_client
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from spotrun.deployments.automations import (
    AlertRules,
    Applied,
    RecoveryRules,
    apply_automations,
    build_automations,
    build_recovery_automations,
)
from spotrun.deployments.schedules import scheduled_training
from spotrun.tasks.admission.trust import Allowed, named, write_allowed
from spotrun.trainer.errors import SpotrunError

# What the package ships (in the wheel as spotrun/deployments/...; tests/e2e/test_package.py checks it):
# prefect.yaml, and the example jobs and scripts its deployments run.
SHIPPED = Path(str(resources.files("spotrun.deployments")))
PREFECT_FILE = SHIPPED / "prefect.yaml"
SHIPPED_PREFIX = "deployments/jobs/"  # how prefect.yaml names a shipped script in a job's `command:`
ALERT_DEPLOYMENT = "restart-alert/restart-alert"
RECOVER_DEPLOYMENT = "recover-job/recover-job"
DEPLOY_TIMEOUT_S = 300


class DeployError(SpotrunError):
    """`prefect deploy` failed or the server refused something; the message says what to fix."""


@dataclass(frozen=True)
class DeployedNames:
    """What prefect.yaml declares: "flow-name/deployment-name" → its work pool."""

    pools: dict[str, str]

    @classmethod
    def read(cls, prefect_file: Path = PREFECT_FILE) -> DeployedNames:
        doc = yaml.safe_load(prefect_file.read_text())
        pools = {}
        for d in doc.get("deployments", []):
            flow_name = _flow_name(d["entrypoint"])
            pools[f"{flow_name}/{d['name']}"] = (d.get("work_pool") or {}).get("name", "")
        return cls(pools)


def _flow_name(entrypoint: str) -> str:
    """Our flows pass name= in @flow; by convention it is the function name with dashes."""
    return entrypoint.rsplit(":", 1)[1].replace("_", "-")


@dataclass(frozen=True)
class DeployReport:
    deployments: dict[str, UUID]
    pools_created: list[str]
    automations: list[Applied]
    recovery: RecoveryRules = field(default_factory=RecoveryRules)
    allowed: Path | None = None  # the trust settings written (what deployment runs may name here)


def ensure_work_pool(client: SyncPrefectClient, name: str) -> bool:
    """Create the process work pool `name` unless it exists; True when it was created."""
    try:
        client.read_work_pool(name)
        return False
    except ObjectNotFound:
        pass
    try:
        client.create_work_pool(WorkPoolCreate(name=name, type="process"))
    except ObjectAlreadyExists:  # created meanwhile by another `spotrun deploy`
        return False
    return True


def api_url() -> str:
    """The server to apply to: PREFECT_API_URL (environment, profile or temporary settings)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise DeployError(
            "no Prefect server to deploy to: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api), "
            "or start one with `spotrun server start`"
        )
    return str(url)


Schedules = dict[str, dict[str, Any]]  # slug -> {"cron"/"interval"/"timezone": what fires, "active": bool}


def _what_fires(s: dict[str, Any]) -> dict[str, Any]:
    return {"cron": s.get("cron"), "interval": s.get("interval"), "timezone": s.get("timezone") or "UTC"}


def keep_operator_schedules(doc: dict[str, Any], existing: dict[str, Schedules]) -> dict[str, Any]:
    """prefect.yaml as `prefect deploy` should apply it over the deployments already on the server
    (`existing`: "flow/deployment" -> its schedules by slug), pure.

    Sending a deployment's schedules again resets their `active` flags to the file's (re-pausing the
    sweeper an operator resumed). So a deployment whose schedules the file does not change gets
    `schedules: null`, which keeps them as they are; one whose schedules changed gets the file's, each
    keeping the operator's `active`. (Queued scheduled runs are still recreated: the server deletes a
    deployment's future auto-scheduled runs on any update of it, schedules or not.)
    """
    doc = copy.deepcopy(doc)
    for d in doc.get("deployments", []):
        current = existing.get(f"{_flow_name(d['entrypoint'])}/{d['name']}")
        wanted = d.get("schedules")
        if current is None or not wanted:
            continue
        same = {s.get("slug"): _what_fires(s) for s in wanted} == {
            slug: _what_fires(s) for slug, s in current.items()
        }
        if same:
            d["schedules"] = None
            continue
        for s in wanted:
            if s.get("slug") in current:
                s["active"] = current[s["slug"]]["active"]
    return doc


def server_schedules(client: SyncPrefectClient, names: list[str]) -> dict[str, Schedules]:
    """The schedules of those deployments that exist on the server, in prefect.yaml's terms."""
    out: dict[str, Schedules] = {}
    for name in names:
        try:
            dep = client.read_deployment_by_name(name)
        except ObjectNotFound:
            continue
        out[name] = {}
        for s in dep.schedules:
            sched = s.schedule
            interval = getattr(sched, "interval", None)
            out[name][s.slug or str(s.id)] = {
                "cron": getattr(sched, "cron", None),
                "interval": interval.total_seconds() if interval is not None else None,
                "timezone": getattr(sched, "timezone", None),
                "active": s.active,
            }
    return out


def with_shipped_paths(doc: dict[str, Any]) -> dict[str, Any]:
    """The shipped prefect.yaml with each `deployments/jobs/...` word of a job's command made the absolute
    path of that file in the installed package, pure: a run starts in the directory `spotrun deploy`
    ran in, not in a checkout."""
    doc = copy.deepcopy(doc)
    for d in doc.get("deployments", []):
        job = (d.get("parameters") or {}).get("job") or {}
        if isinstance(job.get("command"), list):
            job["command"] = [_shipped(word) for word in job["command"]]
    return doc


def _shipped(word: Any) -> Any:
    if isinstance(word, str) and word.startswith(SHIPPED_PREFIX):
        return str(SHIPPED / word.removeprefix("deployments/"))
    return word


def run_prefect_deploy(api_url: str, doc: dict[str, Any], *, workdir: Path, source: Path) -> None:
    """`prefect deploy --all` of `doc` (read from `source`, named in errors) from `workdir`: the entrypoints
    are module paths of the installed package, and `workdir` becomes every run's working directory."""
    cmd = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file"]
    env = {**os.environ, "PREFECT_API_URL": api_url}
    with tempfile.TemporaryDirectory(prefix="spotrun-deploy-") as tmp:
        written = Path(tmp) / "prefect.yaml"
        written.write_text(yaml.safe_dump(doc, sort_keys=False))
        try:
            done = subprocess.run(
                [*cmd, str(written)],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=DEPLOY_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as e:
            raise DeployError(f"`prefect deploy` did not finish within {DEPLOY_TIMEOUT_S} s") from e
    if done.returncode != 0:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-6:])
        raise DeployError(f"`prefect deploy` failed ({done.returncode}) for {source}: {tail}")


def allowed_by_defaults(doc: dict[str, Any]) -> Allowed:
    """What the deployments' own default parameters name (interpreters, recipe modules, ...), pure: a
    deployment run may name these on this host (tasks/admission/trust.py)."""
    allowed = Allowed()
    for d in doc.get("deployments", []):
        allowed |= named(d.get("parameters") or {})
    return allowed


def deploy(
    rules: AlertRules,
    prefect_file: Path = PREFECT_FILE,
    recovery: RecoveryRules | None = None,
    home: Path | None = None,
    workdir: Path | None = None,
) -> DeployReport:
    """Apply pools, deployments and automations to the server PREFECT_API_URL names; with `home`, write
    what their defaults name to this host's trust settings (`home`/allowed.yaml) once they are applied.
    `workdir` (default: this process's directory): where the deployments' runs start."""
    recovery = recovery or RecoveryRules()
    url = api_url()
    names = DeployedNames.read(prefect_file)
    doc = yaml.safe_load(prefect_file.read_text())
    doc = with_shipped_paths(doc) if prefect_file == PREFECT_FILE else doc
    with get_client(sync_client=True) as client:
        created = [p for p in sorted(set(names.pools.values()) - {""}) if ensure_work_pool(client, p)]
        kept = keep_operator_schedules(doc, server_schedules(client, list(names.pools)))
        run_prefect_deploy(url, kept, workdir=workdir or Path.cwd(), source=prefect_file)
        ids = {name: client.read_deployment_by_name(name).id for name in names.pools}
        for needed in (ALERT_DEPLOYMENT, RECOVER_DEPLOYMENT):
            if needed not in ids:
                raise DeployError(f"{prefect_file} declares no {needed} deployment; the automations need it")
        wanted = build_automations(rules, ids[ALERT_DEPLOYMENT], scheduled_training(doc))
        wanted += build_recovery_automations(recovery, ids[RECOVER_DEPLOYMENT])
        applied = apply_automations(client, wanted)
    allowed = None
    if home is not None:
        allowed = write_allowed(home, allowed_by_defaults(doc))
    return DeployReport(ids, created, applied, recovery=recovery, allowed=allowed)
