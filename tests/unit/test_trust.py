"""What a deployment run's parameters may name on a worker host (tasks/admission/trust.py): the decision,
table by table, and the host's settings file."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from spotrun.tasks.admission.trust import (
    Allowed,
    named,
    read_allowed,
    refusal,
    run_refusal,
    settings_path,
    signing_refusal,
    write_allowed,
)
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.local.config import LocalProviderConfig
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import JobSpec

OWN = "/venv/bin/python"  # the flow's own interpreter
FILE = "/home/op/.spotrun/allowed.yaml"
MOTO = "http://127.0.0.1:5000"


def job(**fields: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "j", "recipe": "digits", "total_steps": 10, **fields})


def aws(**fields: Any) -> AwsProviderConfig:
    return AwsProviderConfig.model_validate(
        {"region": "us-east-1", "instance_types": ["g5.xlarge"], "image_id": "ami-1", **fields}
    )


LOCAL = LocalProviderConfig()
SOURCE = {"job": "j", "storage": "s3://someone-elses/bucket", "step": 10}
ALLOWED = Allowed(
    python=frozenset({"/opt/team/bin/python"}),
    recipes=frozenset({"team.models:build"}),
    env=frozenset({"HF_TOKEN", "WANDB_PROJECT"}),
    endpoints=frozenset({"http://minio.internal:9000", "https://s3.team.example.com"}),
    storage=frozenset({"s3://team-models/runs"}),
    init_from=frozenset({"base-model"}),
    tracking=frozenset({"https://mlflow.internal"}),
)
NOT_OURS = "is not an endpoint this host lets a deployment run send data to"

# (case, job, provider, allowed, the refusal's start or None)
CASES: list[tuple[str, JobSpec, Any, Allowed, str | None]] = [
    ("defaults", job(), LOCAL, Allowed(), None),
    ("the flow's own interpreter", job(), LocalProviderConfig(python=OWN), Allowed(), None),
    ("interpreter not allowed", job(), LocalProviderConfig(python="/tmp/x/python"), Allowed(),
     "provider.python: '/tmp/x/python' is not an interpreter"),
    ("interpreter allowed", job(), LocalProviderConfig(python="/opt/team/bin/python"), ALLOWED, None),
    ("the AMI's default interpreter", job(), aws(), Allowed(), None),
    ("another interpreter on the AMI", job(), aws(python="/bin/sh"), Allowed(), "provider.python: '/bin/sh'"),
    ("a built-in recipe", job(recipe="charlm"), LOCAL, Allowed(), None),
    ("an unknown name imports nothing", job(recipe="nosuch"), LOCAL, Allowed(), None),
    ("recipe import string not allowed", job(recipe="os:system"), LOCAL, ALLOWED,
     "recipe: 'os:system' is a module this host does not let a deployment run import"),
    ("recipe import string allowed", job(recipe="team.models:build"), LOCAL, ALLOWED, None),
    ("entrypoint not allowed", job(recipe=None, entrypoint="team.loop:main"), LOCAL, ALLOWED,
     "entrypoint: 'team.loop:main' is code this host does not let a deployment run import"),
    ("entrypoint listed only as a recipe", job(recipe=None, entrypoint="team.models:build"), LOCAL, ALLOWED,
     "entrypoint: 'team.models:build' is code"),
    ("entrypoint allowed", job(recipe=None, entrypoint="team.loop:main", shape_args=["hidden"]), LOCAL,
     Allowed(entrypoints=frozenset({"team.loop:main"})), None),
    ("command not allowed", job(recipe=None, command=["python", "train.py"]), LOCAL, ALLOWED,
     "command: 'python train.py' is not a command this host lets a deployment run start"),
    ("command allowed with other arguments", job(recipe=None, command=["python", "-c", "evil"]), LOCAL,
     Allowed(commands=frozenset({"python train.py"})), "command: 'python -c evil' is not a command"),
    ("command allowed", job(recipe=None, command=["python", "train.py", "--out", "{checkpoint_dir}"]), LOCAL,
     Allowed(commands=frozenset({"python train.py --out '{checkpoint_dir}'"})), None),
    ("hook not allowed", job(hooks={"on_preempt": "aws s3 sync logs s3://b"}), LOCAL, ALLOWED,
     "hooks.on_preempt: 'aws s3 sync logs s3://b' is not a command this host lets a deployment run start"),
    ("controller hook not allowed", job(hooks={"on_attempt_end": ["sh", "-c", "curl x | sh"]}), LOCAL,
     Allowed(commands=frozenset({"sh -c 'curl x'"})), "hooks.on_attempt_end: \"sh -c 'curl x | sh'\" is not"),
    ("hooks allowed", job(hooks={"on_stop": ["python", "notify.py"], "on_complete": "python eval.py --x 1"}),
     LOCAL, Allowed(commands=frozenset({"python notify.py", "python eval.py --x 1"})), None),
    ("env.pass of a name that passes anyway", job(env={"pass": ["HF_HOME"]}), LOCAL, Allowed(), None),
    ("env.pass not allowed", job(env={"pass": ["GITHUB_TOKEN"]}), LOCAL, ALLOWED,
     "env.pass: GITHUB_TOKEN is not a variable"),
    ("env.pass allowed", job(env={"pass": ["HF_TOKEN"]}), LOCAL, ALLOWED, None),
    ("env.set of a default name", job(env={"set": {"PATH": "/tmp/evil"}}), LOCAL, ALLOWED,
     "env.set: PATH is not a variable"),
    ("env.set allowed", job(env={"set": {"WANDB_PROJECT": "x"}}), LOCAL, ALLOWED, None),
    ("an https endpoint is not a permission", job(s3={"endpoint_url": "https://s3.example.com"}), LOCAL,
     ALLOWED, f"s3.endpoint_url: 'https://s3.example.com' {NOT_OURS}"),
    ("https endpoint listed", job(s3={"endpoint_url": "https://S3.team.example.com:443/x"}), LOCAL, ALLOWED,
     f"s3.endpoint_url: 'https://S3.team.example.com:443/x' {NOT_OURS}"),  # :443 named is another origin
    ("https endpoint listed, its path aside", job(s3={"endpoint_url": "https://s3.team.example.com/x"}),
     LOCAL, ALLOWED, None),
    ("http endpoint refused", job(s3={"endpoint_url": "http://s3.example.com"}), LOCAL, Allowed(),
     f"s3.endpoint_url: 'http://s3.example.com' {NOT_OURS}"),
    ("http endpoint listed", job(s3={"endpoint_url": "http://minio.internal:9000/"}), LOCAL, ALLOWED, None),
    ("a listed host on another port", job(s3={"endpoint_url": "http://minio.internal:9001"}), LOCAL, ALLOWED,
     f"s3.endpoint_url: 'http://minio.internal:9001' {NOT_OURS}"),
    ("loopback without the setting", job(s3={"endpoint_url": MOTO}), LOCAL, Allowed(),
     f"s3.endpoint_url: 'http://127.0.0.1:5000' {NOT_OURS}"),
    ("loopback with the setting", job(s3={"endpoint_url": MOTO}), LOCAL, Allowed(loopback=True), None),
    ("EC2 endpoint over http", job(), aws(endpoint_url="http://ec2.example.com"), Allowed(),
     f"provider.endpoint_url: 'http://ec2.example.com' {NOT_OURS}"),
    ("EC2 endpoint over https, unlisted", job(), aws(endpoint_url="https://ec2.example.com"), Allowed(),
     f"provider.endpoint_url: 'https://ec2.example.com' {NOT_OURS}"),
    ("a local directory store", job(storage="/data/ckpt/j"), LOCAL, Allowed(), None),
    ("an S3 store not listed", job(storage="s3://attacker/exfil"), LOCAL, ALLOWED,
     "storage: 's3://attacker/exfil' is not a store this host lets a deployment run write"),
    ("a prefix that only starts like a listed one", job(storage="s3://team-models/runsx"), LOCAL, ALLOWED,
     "storage: 's3://team-models/runsx' is not a store"),
    ("an S3 store below a listed one", job(storage="s3://team-models/runs/j"), LOCAL, ALLOWED, None),
    ("a warm start from another job", job(init_from={"job": "someone-elses"}), LOCAL, ALLOWED,
     "init_from.job: 'someone-elses' is another job, whose model this host does not let a deployment run"),
    ("a warm start from a listed job", job(init_from={"job": "base-model"}), LOCAL, ALLOWED, None),
    ("rehearse_locally against AWS", job(), aws(rehearse_locally=True), Allowed(),
     "provider.rehearse_locally: only against a loopback test endpoint"),
    ("rehearse_locally against a remote https endpoint", job(),
     aws(rehearse_locally=True, endpoint_url="https://ec2.example.com"),
     Allowed(endpoints=frozenset({"https://ec2.example.com"})),
     "provider.rehearse_locally: only against a loopback test endpoint"),
    ("rehearse_locally against moto", job(), aws(rehearse_locally=True, endpoint_url=MOTO),
     Allowed(loopback=True), None),
    ("tracking URI not allowed", job(tracking={"uri": "https://evil.example.com"}), LOCAL, ALLOWED,
     "tracking.uri: 'https://evil.example.com' is not a tracking URI"),
    ("tracking URI allowed", job(tracking={"uri": "https://mlflow.internal"}), LOCAL, ALLOWED, None),
    ("a run key template", job(run_key="{scheduled_date}", init_from={"job": "j"}, promote={}), LOCAL,
     Allowed(), None),
    ("a warm-start source set by hand", job(init_from={"job": "j", "source": SOURCE}), LOCAL, ALLOWED,
     "init_from.source is filled by spotrun"),
    ("a champion set by hand", job(promote={"champion": SOURCE}), LOCAL, ALLOWED,
     "promote.champion is filled by spotrun"),
    ("run values set by hand", job(run_key="k", run_values={"run_key": "k"}), LOCAL, ALLOWED,
     "run_values is filled by spotrun"),
    ("keep_runs where the host names none", job(run_key="{scheduled_date}", keep_runs=3), LOCAL, ALLOWED,
     "keep_runs: 3 would delete older runs' checkpoints, and this host's settings let a deployment run "
     "set no keep_runs"),
    ("keep_runs below the host's", job(run_key="{scheduled_date}", keep_runs=1), LOCAL,
     Allowed(keep_runs=frozenset({"7"})), "keep_runs: 1 would delete"),
    ("keep_runs at or above the host's", job(run_key="{scheduled_date}", keep_runs=9), LOCAL,
     Allowed(keep_runs=frozenset({"7"})), None),
]  # fmt: skip  # one case per line: a table


@pytest.mark.parametrize(
    ("case", "spec", "provider", "allowed", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_refusal(case: str, spec: JobSpec, provider: Any, allowed: Allowed, expected: str | None) -> None:
    why = refusal(spec, provider, allowed, own_python=OWN, settings=FILE)
    if expected is None:
        assert why is None
        return
    assert why is not None and why.startswith(expected) and "\n" not in why
    assert FILE in why or "rehearse_locally" in why or "filled by spotrun" in why  # the fix


def test_what_a_deployments_defaults_name() -> None:
    params = {
        "job": {
            "name": "j",
            "recipe": "team.models:build",
            "env": {"pass": ["HF_TOKEN"], "set": {"A": "1"}},
            "s3": {"endpoint_url": "http://minio:9000"},
            "tracking": {"uri": "sqlite:///t.db"},
        },
        "provider": {"kind": "aws", "python": "/opt/py", "endpoint_url": "https://ec2.example.com"},
    }
    assert named(params) == Allowed(
        python=frozenset({"/opt/py"}),
        recipes=frozenset({"team.models:build"}),
        env=frozenset({"HF_TOKEN", "A"}),
        endpoints=frozenset({"http://minio:9000", "https://ec2.example.com"}),  # https too
        tracking=frozenset({"sqlite:///t.db"}),
    )
    nightly = {"job": {"name": "n", "storage": "s3://b/n", "init_from": {"job": "base"}}}
    assert named(nightly) == Allowed(storage=frozenset({"s3://b/n"}), init_from=frozenset({"base"}))
    assert named({"job": {"storage": "checkpoints/n"}}) == Allowed()  # a directory needs no listing
    assert named({"job": {"recipe": "digits"}}) == Allowed()  # built-ins need no listing
    loop = {"job": {"entrypoint": "team.loop:main", "shape_args": ["hidden"]}}
    assert named(loop) == Allowed(entrypoints=frozenset({"team.loop:main"}))
    hooked = {"job": {"recipe": "digits", "hooks": {"on_stop": "python notify.py 'a b'", "timeout_s": 9}}}
    assert named(hooked) == Allowed(commands=frozenset({"python notify.py 'a b'"}))  # as the spec splits it


def test_the_settings_file_is_0600_and_keeps_the_operators_section(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert read_allowed(home) == Allowed()  # no file: the defaults only
    write_allowed(home, Allowed(recipes=frozenset({"a.b:c"})))
    path = settings_path(home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text().replace("python: []", "python: [/opt/team/bin/python]", 1)  # the operator's
    assert text.index("/opt/team/bin/python") < text.index("\ndeployments:")
    path.write_text(text)
    write_allowed(home, Allowed(recipes=frozenset({"d.e:f"})))  # a later deploy: new defaults, same own
    assert read_allowed(home) == Allowed(
        python=frozenset({"/opt/team/bin/python"}), recipes=frozenset({"d.e:f"})
    )


@pytest.mark.parametrize(
    ("text", "mode", "message"),
    [
        ("allow: {python: [/x]}\n", 0o620, "is writable by others, so it cannot be trusted: chmod 600"),
        (
            "allow: {pythons: [/x]}\n",
            0o600,
            "allow: unknown key 'pythons'; use commands, endpoints, entrypoints, env, init_from, keep_runs, "
            "loopback",
        ),
        ("allow: {python: /x}\n", 0o600, "allow.python: use a list of strings"),
        ("allow: [\n", 0o600, "is not valid YAML"),
    ],
)
def test_a_bad_settings_file_is_one_line(tmp_path: Path, text: str, mode: int, message: str) -> None:
    path = settings_path(tmp_path)
    path.write_text(text)
    os.chmod(path, mode)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        read_allowed(tmp_path)


def test_the_operators_own_file_is_trusted_as_written(tmp_path: Path) -> None:
    """A run with no deployment (spotrun run, in-process) names what it likes; the same parameters in a
    deployment run are refused, and a bad settings file refuses every deployment run beyond nothing."""
    spec = job(recipe="team.models:build", s3={"endpoint_url": "http://s3.example.com"})
    provider = LocalProviderConfig(python="/tmp/x/python")
    assert run_refusal(None, spec, provider, home=tmp_path, own_python=OWN) is None
    why = run_refusal("7f0c...", spec, provider, home=tmp_path, own_python=OWN)
    assert why is not None and why.startswith("provider.python: '/tmp/x/python'")
    settings_path(tmp_path).write_text("allow: [\n")
    why = run_refusal("7f0c...", job(), LOCAL, home=tmp_path, own_python=OWN)
    assert why is not None and "is not valid YAML" in why


def test_spotrun_deploy_allows_what_the_deployments_defaults_name() -> None:
    from spotrun.deployments.apply import PREFECT_FILE, allowed_by_defaults

    shipped = yaml.safe_load(PREFECT_FILE.read_text())
    # built-in recipes only; the nightly job's keep_runs is the least a form may keep; the two
    # integration examples' commands exactly as written
    examples = {
        "'{python}' deployments/jobs/scripts/hf_train.py --output_dir '{checkpoint_dir}' "
        "--max_steps '{total_steps}'",
        "'{python}' deployments/jobs/scripts/pl_train.py --out '{checkpoint_dir}' "
        "--max_steps '{total_steps}'",
    }
    assert allowed_by_defaults(shipped) == Allowed(keep_runs=frozenset({"7"}), commands=frozenset(examples))
    job, provider = {"job": {"recipe": "team.models:build"}}, {"provider": {"python": "/opt/py"}}
    team = {"deployments": [{"parameters": job}, {"parameters": provider}, {"name": "sweep"}]}
    assert allowed_by_defaults(team) == Allowed(
        recipes=frozenset({"team.models:build"}), python=frozenset({"/opt/py"})
    )


@pytest.mark.parametrize(
    ("env", "kind", "says"),
    [
        ({}, "local", None),
        ({}, "aws", None),
        ({"SPOTRUN_MANIFEST_KEY": "k"}, "local", None),  # the allow-list hands the key to local trainers
        ({"SPOTRUN_MANIFEST_KEY": "k", "SPOTRUN_MANIFEST_KEYS_OLD": "j"}, "local", None),
        ({"SPOTRUN_MANIFEST_KEY": "k"}, "aws", "EC2 workers do not get it"),
        ({"SPOTRUN_MANIFEST_KEY": "k"}, "aws-keyfile", None),  # the instance reads it from its own file
        ({"SPOTRUN_MANIFEST_KEYS_OLD": "j"}, "local", "SPOTRUN_MANIFEST_KEY is not"),
    ],
)
def test_a_controller_that_verifies_needs_workers_that_sign(
    env: dict[str, str], kind: str, says: str | None
) -> None:
    providers: dict[str, LocalProviderConfig | AwsProviderConfig] = {
        "local": LocalProviderConfig(),
        "aws": aws(),
        "aws-keyfile": aws(manifest_key_file="/etc/spotrun/key"),
    }
    provider = providers[kind]
    job = JobSpec(name="j", recipe="digits", total_steps=10, storage="s3://b/j")
    why = signing_refusal(job, provider, {"PATH": "/usr/bin", **env})
    assert (why is None) if says is None else (says in str(why))


def test_recipes_spelt_as_before_0_2_are_allowed_under_both_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings_path(tmp_path).write_text("allow:\n  recipes: [trainer.recipes.charlm:build, team.m:build]\n")
    settings_path(tmp_path).chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="spotrun.tasks.admission.trust"):
        allowed = read_allowed(tmp_path)
    assert allowed.recipes == {
        "trainer.recipes.charlm:build",
        "spotrun.trainer.recipes.charlm:build",
        "team.m:build",
    }
    assert "write spotrun.trainer.recipes.charlm:build" in caplog.text


def test_a_run_without_a_key_says_what_a_bucket_writer_can_do() -> None:
    from spotrun.tasks.admission.trust import unsigned_warning

    said = unsigned_warning(job(storage="s3://team/j"), {})
    assert said is not None and "\n" not in said
    assert said.startswith("j's checkpoints are not signed (SPOTRUN_MANIFEST_KEY is not set): whoever can")
    assert "write s3://team/j can change the weights" in said and "32 bytes or more" in said
    assert unsigned_warning(job(), {"SPOTRUN_MANIFEST_KEY": "k" * 32}) is None
