"""deployments/: prefect.yaml is valid for the flows it names, the automations are what the rules say,
and `spotrun deploy`'s inputs are checked before anything reaches a server."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from uuid import UUID, uuid4

import pytest
import yaml

from spotrun.cli import main
from spotrun.deploy_cmd import alert_rules, duration_s, recovery_rules
from spotrun.deployments.alert_parts import AlertRules as PartsRules
from spotrun.deployments.apply import ALERT_DEPLOYMENT, PREFECT_FILE, RECOVER_DEPLOYMENT, DeployedNames
from spotrun.deployments.automations import (
    AT_RISK,
    CRASHED,
    DISK_FULL,
    GAVE_UP,
    HEARTBEAT_S,
    HEARTBEAT_TAG,
    MISMATCH,
    RECOVERED,
    STORM,
    TRAINING_FLOW,
    UNVERIFIED,
    ZOMBIE,
    AlertRules,
    RecoveryRules,
    _comparable,
    build_automations,
    build_recovery_automations,
)
from spotrun.deployments.run_alerts import (
    FAILED_WAIT_S,
    MISSED_RUN,
    PROMOTION,
    RUN_FAILED,
    build_missed_run_automations,
)
from spotrun.deployments.schedules import ScheduledTraining, period_s, scheduled_training
from spotrun.tasks.alerts.message import AlertKind, PromotionFacts, ResumeFacts
from spotrun.tasks.control.checkpoints import CHECKPOINT_UNVERIFIED, CONTROLLER_DISK_FULL
from spotrun.tasks.control.market import DEADLINE_AT_RISK
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.decisions.promotion import PROMOTION_LABEL, decide_promotion, event_payload
from spotrun.tasks.ownership.recovery import (
    RecoveryError,
    RestartAction,
    decide_controller_restart,
    parse_flow_run_id,
)
from spotrun.tasks.reports.reporting import (
    JOB_COMPLETED,
    JOB_GAVE_UP,
    JOB_RESTARTED,
    MODEL_PROMOTION,
    RESTARTED_LABEL,
    RESUME_CHECKED,
    VERDICT_LABEL,
    job_resource,
)
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.spec.runs import Promotion

REPO = Path(__file__).resolve().parents[2]
DOC = yaml.safe_load(PREFECT_FILE.read_text())
DEPLOYMENTS = {d["name"]: d for d in DOC["deployments"]}


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_each_entrypoint_is_a_flow_of_the_installed_package(name: str) -> None:
    """Module paths (`spotrun.flows.x:f`), not files of a checkout: a worker loads them from the wheel."""
    module, func = DEPLOYMENTS[name]["entrypoint"].split(":")
    assert module.startswith("spotrun.flows.")
    flow = getattr(importlib.import_module(module), func)
    assert flow.name == func.replace("_", "-")  # DeployedNames relies on it


def test_the_shipped_scripts_run_from_the_installed_package() -> None:
    """`spotrun deploy` writes a shipped script's absolute path: runs start where it ran, in no checkout."""
    from spotrun.deployments.apply import SHIPPED, with_shipped_paths

    resolved = {d["name"]: d for d in with_shipped_paths(DOC)["deployments"]}
    for name in ("transformers-example", "lightning-example"):
        raw, command = (
            DEPLOYMENTS[name]["parameters"]["job"]["command"],
            resolved[name]["parameters"]["job"]["command"],
        )
        assert raw[1].startswith("deployments/jobs/scripts/") and command[1] == str(SHIPPED / raw[1][12:])
        assert Path(command[1]).is_file() and command[2:] == raw[2:]
    assert DOC["deployments"][0] == resolved[DOC["deployments"][0]["name"]]  # no command: unchanged


TRAINING = ["resilient-training", "nightly-retraining", "transformers-example", "lightning-example"]


@pytest.mark.parametrize("name", TRAINING)
def test_training_parameters_are_a_valid_job_spec_and_policy(name: str) -> None:
    params = DEPLOYMENTS[name]["parameters"]
    JobSpec.model_validate(params["job"])
    RetryPolicy.model_validate(params["policy"])
    assert DEPLOYMENTS[name]["enforce_parameter_schema"] is True  # the UI form validates input


def test_shared_settings_come_from_definitions() -> None:
    pool = DOC["definitions"]["work_pools"]["local"]
    assert all(pool.items() <= d["work_pool"].items() for d in DEPLOYMENTS.values())
    assert DeployedNames.read().pools == {
        "resilient-training/resilient-training": "spotrun-local",
        "resilient-training/nightly-retraining": "spotrun-local",
        "resilient-training/transformers-example": "spotrun-local",
        "resilient-training/lightning-example": "spotrun-local",
        "sweep-instances/sweep-instances": "spotrun-local",
        ALERT_DEPLOYMENT: "spotrun-local",
        RECOVER_DEPLOYMENT: "spotrun-local",
    }
    (sweeper,) = DEPLOYMENTS["sweep-instances"]["schedules"]
    assert sweeper["active"] is False  # no AWS credentials by default: a failing run every 10 minutes
    (nightly,) = DEPLOYMENTS["nightly-retraining"]["schedules"]
    assert nightly["cron"] == "0 3 * * *" and nightly["slug"]  # the slug keeps redeploys idempotent
    assert DEPLOYMENTS["nightly-retraining"]["parameters"]["job"]["name"] != "digits"


@pytest.mark.parametrize("name", TRAINING)
def test_training_runs_beat_and_carry_the_tag_the_recovery_automations_watch(name: str) -> None:
    d = DEPLOYMENTS[name]
    env = d["work_pool"]["job_variables"]["env"]
    assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == str(HEARTBEAT_S)
    assert HEARTBEAT_TAG in d["tags"] and d["entrypoint"].endswith(":" + TRAINING_FLOW.replace("-", "_"))
    others = [n for n in DEPLOYMENTS if n not in TRAINING]
    assert not any(HEARTBEAT_TAG in DEPLOYMENTS[n].get("tags", []) for n in others)


def _by_name(rules: AlertRules) -> dict[str, Any]:
    return {a.name: a for a in build_automations(rules, uuid4())}


def test_restart_storm_counts_per_job_within_the_window() -> None:
    storm = _by_name(AlertRules(restart_threshold=5, restart_window_s=1800))[STORM]
    t = storm.trigger
    assert (t.expect, t.for_each, t.threshold, t.within) == (
        {JOB_RESTARTED},
        {"prefect.resource.id"},
        5,
        timedelta(seconds=1800),
    )
    assert t.match.root == {"prefect.resource.id": "spotrun.job.*"}
    params = storm.actions[0].parameters
    assert params["kind"] == "restart-storm" and (params["window_s"], params["threshold"]) == (1800, 5)
    assert params["job"] == "{{ event.payload.job }}"


def test_gave_up_and_recovery_fire_on_the_first_event() -> None:
    autos = _by_name(AlertRules())
    gave_up, recovered = autos[GAVE_UP].trigger, autos[RECOVERED].trigger
    assert (gave_up.expect, gave_up.threshold) == ({JOB_GAVE_UP}, 1)
    assert (recovered.expect, recovered.threshold) == ({JOB_COMPLETED}, 1)
    assert recovered.match.root[RESTARTED_LABEL] == "true"  # only jobs that restarted on the way
    assert "default('')" in autos[GAVE_UP].actions[0].parameters["reason"]


def test_recovery_note_can_be_switched_off() -> None:
    assert set(_by_name(AlertRules(recovery_note=False))) == {
        STORM,
        GAVE_UP,
        MISMATCH,
        UNVERIFIED,
        DISK_FULL,
        AT_RISK,
        PROMOTION,
        RUN_FAILED,
    }


def test_a_resume_mismatch_alerts_with_the_check_from_the_event() -> None:
    auto = _by_name(AlertRules())[MISMATCH]
    t = auto.trigger
    assert (t.expect, t.threshold, t.for_each) == ({RESUME_CHECKED}, 1, {"prefect.resource.id"})
    assert t.match.root == {"prefect.resource.id": "spotrun.job.*", VERDICT_LABEL: "mismatch"}
    params = auto.actions[0].parameters
    assert params["kind"] == "resume-mismatch"
    resume = params["resume"]  # each field of the flow's `resume` parameter, nothing else (it refuses extras)
    assert set(resume) == {f.name for f in dataclasses.fields(ResumeFacts)}
    assert resume["attempt"] == "{{ event.payload.attempt | default(0) }}"
    assert resume["diff"] == "{{ event.payload.diff | default('') }}"
    assert params["job"] == "{{ event.payload.job }}"


@pytest.mark.parametrize("name", [UNVERIFIED, DISK_FULL, AT_RISK])
def test_what_the_check_between_attempts_finds_alerts_once_a_window_per_job(name: str) -> None:
    auto = _by_name(AlertRules(restart_window_s=1800))[name]
    t = auto.trigger
    event, kind = {
        UNVERIFIED: (CHECKPOINT_UNVERIFIED, "cannot-verify"),
        DISK_FULL: (CONTROLLER_DISK_FULL, "disk-full"),
        AT_RISK: (DEADLINE_AT_RISK, "deadline-at-risk"),
    }[name]
    assert (t.expect, t.for_each, t.posture, t.threshold, t.within) == (
        {event},
        {"prefect.resource.id"},
        "Reactive",
        1,
        timedelta(seconds=1800),
    )
    assert t.match.root == {"prefect.resource.id": "spotrun.job.*"}  # PrefectSink.event's resource
    assert auto.actions[0].parameters["kind"] == kind  # stored in the history, searched for


def _rendered(parameters: dict[str, Any], event: dict[str, Any], flow_run: Any) -> dict[str, Any]:
    """The parameters as the server renders a RunDeployment's (its own v1 upgrade and hydration), with
    `flow_run` standing for the run the server reads from the event's related resources."""
    from prefect.server.events.actions import RunDeployment as ServerRunDeployment
    from prefect.server.events.schemas.events import ReceivedEvent
    from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate

    params = json.loads(json.dumps(parameters))
    ServerRunDeployment._upgrade_v1_templates(params)
    received = ReceivedEvent.model_validate({"occurred": datetime.now(UTC), "id": uuid4(), **event})
    context = {"event": received, "flow_run": flow_run}
    return hydrate(params, HydrationContext(raise_on_error=True, render_jinja=True, jinja_context=context))


@pytest.mark.parametrize("in_a_run", [True, False], ids=["emitted-in-a-flow-run", "no-flow-run"])
def test_the_unverified_event_renders_into_the_alert_flows_parameters(in_a_run: bool) -> None:
    """The event as PrefectSink.event emits it (tasks/reports/reporting.py: the job's resource, the job in the
    payload) renders into parameters the restart-alert flow accepts: its step and problem, its run."""
    from spotrun.flows.restart_alert import restart_alert

    problem = "cannot verify: signed with key id 'ab12', not held here & <not> in SPOTRUN_MANIFEST_KEYS_OLD"
    event = {
        "event": CHECKPOINT_UNVERIFIED,
        "resource": job_resource("digits"),
        "payload": {"job": "digits", "step": 20, "problem": problem},
    }
    run = SimpleNamespace(id=uuid4()) if in_a_run else None
    auto = _by_name(AlertRules())[UNVERIFIED]
    params = restart_alert.validate_parameters(_rendered(auto.actions[0].parameters, event, run))
    assert (params["kind"], params["job"]) == (AlertKind.CANNOT_VERIFY, "digits")
    assert (params["checkpoint"], params["reason"]) == ("step 20", problem)
    assert params["training_flow_run_id"] == (str(run.id) if run else "")
    assert params["trigger"].startswith(CHECKPOINT_UNVERIFIED + " ")


CACHE = "/home/ops/.spotrun/jobs/digits/flow-cache"
DISK_FULL_EVENTS: list[tuple[str, dict[str, Any], str]] = [
    # (case, the payload besides the job, the rendered `checkpoint`: where)
    (
        "cache and host",
        {"problem": f"No space left on device under {CACHE}", "cache": CACHE, "host": "ctl-1"},
        f"{CACHE} on ctl-1",
    ),
    ("an older event: the problem only", {"problem": f"Disk quota exceeded under {CACHE}"}, ""),
    ("nothing", {}, ""),
]


@pytest.mark.parametrize(("payload", "where"), [pytest.param(*c[1:], id=c[0]) for c in DISK_FULL_EVENTS])
@pytest.mark.parametrize("in_a_run", [True, False], ids=["emitted-in-a-flow-run", "no-flow-run"])
def test_the_disk_full_event_renders_into_the_alert_flows_parameters(
    payload: dict[str, str], where: str, in_a_run: bool
) -> None:
    """The event as tasks/control/loop.py emits it through PrefectSink.event renders into parameters the
    restart-alert flow accepts: where (the flow cache and its host), the OS error, the emitting run."""
    from spotrun.flows.restart_alert import restart_alert

    event = {
        "event": CONTROLLER_DISK_FULL,
        "resource": job_resource("digits"),
        "payload": {"job": "digits"} | payload,
    }
    run = SimpleNamespace(id=uuid4()) if in_a_run else None
    auto = _by_name(AlertRules())[DISK_FULL]
    params = restart_alert.validate_parameters(_rendered(auto.actions[0].parameters, event, run))
    assert (params["kind"], params["job"]) == (AlertKind.DISK_FULL, "digits")
    assert (params["checkpoint"], params["reason"]) == (where, payload.get("problem", ""))
    assert params["training_flow_run_id"] == (str(run.id) if run else "")
    assert params["trigger"].startswith(CONTROLLER_DISK_FULL + " ")


def _recovery(rules: RecoveryRules) -> dict[str, Any]:
    return {a.name: a for a in build_recovery_automations(rules, uuid4())}


def _related(trigger: Any) -> list[dict[str, Any]]:
    return [spec.root for spec in trigger.match_related]


WATCHED = [
    {"prefect.resource.role": "flow", "prefect.resource.name": "resilient-training"},
    {"prefect.resource.role": "tag", "prefect.resource.id": "prefect.tag.spotrun-heartbeat"},
]


def test_zombie_automation_crashes_a_training_run_silent_for_the_window() -> None:
    zombie = _recovery(RecoveryRules(zombie_after_s=120))[ZOMBIE]
    t = zombie.trigger
    assert t.posture == "Proactive" and t.threshold == 1 and t.within == timedelta(seconds=120)
    assert t.after == {
        "prefect.flow-run.heartbeat",
        "prefect.flow-run.Running",
    }  # armed before a heartbeat too
    assert t.expect == {"prefect.flow-run.heartbeat"} | {
        f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")
    }
    assert t.for_each == {"prefect.resource.id"}  # one clock per flow run
    assert t.match.root == {"prefect.resource.id": "prefect.flow-run.*"} and _related(t) == WATCHED
    (action,) = zombie.actions
    assert (action.type, action.state, action.force) == ("change-flow-run-state", "CRASHED", False)
    assert "no heartbeat for 120 s" in action.message


def test_crashed_automation_runs_recover_job_with_the_crashed_run_and_the_bound() -> None:
    dep = uuid4()
    (crashed,) = [
        a for a in build_recovery_automations(RecoveryRules(controller_restarts=5), dep) if a.name == CRASHED
    ]
    t = crashed.trigger
    assert (t.posture, t.expect, t.threshold) == ("Reactive", {"prefect.flow-run.Crashed"}, 1)
    assert _related(t) == WATCHED  # other flows, and training runs that do not beat, are not rerun
    (action,) = crashed.actions
    assert (action.type, action.deployment_id) == ("run-deployment", dep)
    assert action.parameters == {
        "crashed_flow_run_id": "{{ event.resource.id | default('') }}",
        "limit": 5,
        "window_s": 3600,
    }


@pytest.mark.parametrize(
    ("minutes_ago", "limit", "cancelling", "action", "restarts"),
    [
        ([], 3, False, RestartAction.RESTART, 0),
        ([5, 30], 3, False, RestartAction.RESTART, 2),
        ([5, 30, 59], 3, False, RestartAction.GIVE_UP, 3),
        ([5, 30, 61, 120], 3, False, RestartAction.RESTART, 2),  # older ones left the window
        ([-1, 5, 30], 3, False, RestartAction.RESTART, 2),  # a clock ahead: not counted
        ([], 0, False, RestartAction.GIVE_UP, 0),  # restarts switched off
        ([5], 1, False, RestartAction.GIVE_UP, 1),
        ([], 3, True, RestartAction.LEAVE, 0),  # someone was cancelling it
    ],
)
def test_decide_controller_restart(
    minutes_ago: list[int], limit: int, cancelling: bool, action: RestartAction, restarts: int
) -> None:
    now = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
    times = [now - timedelta(minutes=m) for m in minutes_ago]
    decision = decide_controller_restart(
        times, now, limit, window=timedelta(hours=1), cancel_requested=cancelling
    )
    assert (decision.action, decision.restarts) == (action, restarts)
    if action is RestartAction.GIVE_UP:
        assert f"at most {limit} restarts" in decision.reason


def test_crashed_flow_run_id_from_the_event_resource_or_bare() -> None:
    u = uuid4()
    assert parse_flow_run_id(f"prefect.flow-run.{u}") == u == parse_flow_run_id(str(u))
    with pytest.raises(RecoveryError, match="is not a flow run id"):
        parse_flow_run_id("")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("3600", 3600), ("90s", 90), ("30m", 1800), ("1h", 3600), ("1.5h", 5400), ("2d", 172800)],
)
def test_duration(text: str, seconds: float) -> None:
    assert duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "1w", "-5m", "soon", "1h30m"])
def test_bad_duration_says_what_to_write(text: str) -> None:
    with pytest.raises(ConfigError, match="use seconds or a number with s, m, h or d"):
        duration_s(text)


def _args(**overrides: Any) -> argparse.Namespace:
    values = dict(
        restart_threshold=3,
        restart_window="1h",
        no_recovery_note=False,
        alert_retries=3,
        alert_retry_delay="30s",
        controller_restarts=3,
        zombie_after="90s",
        missed_run_after=None,
    )
    return argparse.Namespace(**{**values, **overrides})


def test_alert_rules_from_flags() -> None:
    assert alert_rules(_args(restart_window="30m", no_recovery_note=True)) == AlertRules(
        restart_window_s=1800, recovery_note=False
    )
    assert alert_rules(_args(missed_run_after="6h")).missed_run_after_s == 6 * 3600


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"restart_threshold": 0}, "--restart-threshold: Input should be greater than or equal to 1"),
        ({"restart_window": "0"}, "--restart-window: Input should be greater than 0"),
        ({"alert_retries": -1}, "--alert-retries: Input should be greater than or equal to 0"),
        ({"missed_run_after": "30s"}, "--missed-run-after: Input should be greater than or equal to 60"),
    ],
)
def test_bad_alert_flags_name_the_flag(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        alert_rules(_args(**overrides))


def test_recovery_rules_from_flags() -> None:
    got = recovery_rules(_args(controller_restarts=0, zombie_after="2m", restart_window="30m"))
    assert got == RecoveryRules(controller_restarts=0, zombie_after_s=120, restart_window_s=1800)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"controller_restarts": -1}, "--controller-restarts: Input should be greater than or equal to 0"),
        ({"zombie_after": "45s"}, "--zombie-after: Input should be greater than or equal to 60"),
    ],
)
def test_bad_recovery_flags_name_the_flag(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        recovery_rules(_args(**overrides))


def test_deploy_without_a_server_is_one_line_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("SPOTRUN_HOME", str(tmp_path))  # no background server either
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        code = main(["deploy"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "no Prefect server to deploy to: set PREFECT_API_URL" in err and "spotrun serve" in err


def _training_schema() -> dict[str, Any]:
    from prefect.utilities.callables import parameter_schema

    from spotrun.flows.resilient_training import resilient_training

    return parameter_schema(resilient_training).model_dump()


def test_the_provider_is_a_choice_of_forms_the_ui_can_render() -> None:
    provider = _training_schema()["properties"]["provider"]
    # anyOf: the UI's schema form offers a choice, then the chosen provider's form (oneOf: raw JSON)
    assert provider["anyOf"] == [
        {"$ref": "#/definitions/LocalProviderConfig"},
        {"$ref": "#/definitions/AwsProviderConfig"},
    ]
    assert "oneOf" not in provider and provider["default"]["kind"] == "local"


def test_the_form_has_no_machine_specific_defaults_and_every_field_is_described() -> None:
    import sys
    from pathlib import Path

    schema = _training_schema()
    text = json.dumps(schema)
    for local in (sys.executable, str(REPO), str(Path.home())):
        assert local not in text, f"{local} is baked into the form's defaults"
    undescribed = [
        f"{name}.{field}"
        for name, definition in [("flow", schema), *schema["definitions"].items()]
        for field, prop in definition.get("properties", {}).items()
        if len(prop.get("description", "")) < 10 or prop["description"].rstrip().endswith("e.g.")
    ]
    assert undescribed == [], "fields the UI shows without a description"


NIGHTLY = "resilient-training/nightly-retraining"
SWEEPER = "sweep-instances/sweep-instances"


def _on_server(active_sweeper: bool, cron: str = "0 3 * * *") -> dict[str, Any]:
    return {
        NIGHTLY: {"nightly-0300-utc": {"cron": cron, "interval": None, "timezone": "UTC", "active": True}},
        SWEEPER: {
            "every-10-minutes": {"cron": None, "interval": 600.0, "timezone": None, "active": active_sweeper}
        },
    }


@pytest.mark.parametrize(
    ("existing", "nightly", "sweeper"),
    [
        # first deploy: the file's schedules (the sweeper off until AWS is configured)
        ({}, DEPLOYMENTS["nightly-retraining"]["schedules"], DEPLOYMENTS["sweep-instances"]["schedules"]),
        # unchanged schedules are not sent: an operator's resume holds, queued runs stay
        (_on_server(active_sweeper=True), None, None),
        (_on_server(active_sweeper=False), None, None),
    ],
)
def test_redeploy_keeps_what_an_operator_set(existing: dict[str, Any], nightly: Any, sweeper: Any) -> None:
    from spotrun.deployments.apply import keep_operator_schedules

    doc = keep_operator_schedules(DOC, existing)
    by_name = {d["name"]: d for d in doc["deployments"]}
    assert by_name["nightly-retraining"]["schedules"] == nightly
    assert by_name["sweep-instances"]["schedules"] == sweeper
    assert DEPLOYMENTS["sweep-instances"]["schedules"][0]["active"] is False  # the input is not changed


def test_a_changed_schedule_is_sent_with_the_operators_active_flag() -> None:
    from spotrun.deployments.apply import keep_operator_schedules

    existing = _on_server(active_sweeper=True)
    existing[NIGHTLY]["nightly-0300-utc"] |= {"cron": "0 4 * * *", "active": False}  # paused, old time
    doc = keep_operator_schedules(DOC, existing)
    (nightly,) = {d["name"]: d for d in doc["deployments"]}["nightly-retraining"]["schedules"]
    assert (nightly["cron"], nightly["active"]) == ("0 3 * * *", False)


def test_workers_are_named_per_host() -> None:
    from spotrun.deployments.worker import LocalWorker, worker_name

    assert worker_name("gpu-box-1") == "spotrun-gpu-box-1"
    assert LocalWorker(REPO / "w.log").name == LocalWorker(REPO / "x.log").name == worker_name()


COMPARABLE = """
import json, sys, uuid
import yaml
from spotrun.deployments.apply import PREFECT_FILE
from spotrun.deployments.automations import AlertRules, RecoveryRules, _comparable, build_automations
from spotrun.deployments.automations import build_recovery_automations
from spotrun.deployments.schedules import scheduled_training
wanted = build_recovery_automations(RecoveryRules(), uuid.UUID(int=7))
scheduled = scheduled_training(yaml.safe_load(PREFECT_FILE.read_text()))
wanted += build_automations(AlertRules(), uuid.UUID(int=8), scheduled)
print(json.dumps([_comparable(a) for a in wanted], default=str))
"""


def test_the_same_automations_compare_equal_in_any_process() -> None:
    """Sets dumped in hash order made each `spotrun serve` update the zombie automation, which drops
    the buckets its trigger had armed: a run that died before the update was never marked Crashed."""
    wanted = build_recovery_automations(RecoveryRules(), UUID(int=7))
    wanted += build_automations(AlertRules(), UUID(int=8), scheduled_training(DOC))  # with sets of their own
    here = json.dumps([_comparable(a) for a in wanted], default=str)
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    there = subprocess.run(
        [sys.executable, "-c", COMPARABLE], env=env, capture_output=True, text=True, cwd=REPO
    )
    assert there.returncode == 0, there.stderr[-2000:]
    assert there.stdout.strip() == here


# -- scheduled retraining: promotion, a failed run, a missed run -----------------------------------


def _alert_flow_accepts(params: dict[str, Any]) -> dict[str, Any]:
    """The rendered parameters as the restart-alert flow validates them; `promotion` as PromotionFacts
    while the flow does not take it yet (the lead adds it: see tasks/alerts/service.py AlertRequest)."""
    from pydantic import TypeAdapter

    from spotrun.flows.restart_alert import restart_alert

    if "promotion" in params and "promotion" not in restart_alert.parameters.properties:
        rest = {k: v for k, v in params.items() if k != "promotion"}
        facts = TypeAdapter(PromotionFacts).validate_python(params["promotion"])
        return restart_alert.validate_parameters(rest) | {"promotion": facts}
    return restart_alert.validate_parameters(params)


def test_alert_rules_are_one_model_wherever_imported() -> None:
    assert AlertRules is PartsRules and AlertRules().missed_run_after_s is None
    with pytest.raises(ValueError, match="greater than or equal to 60"):
        AlertRules(missed_run_after_s=5)


@pytest.mark.parametrize("promoted", [True, False], ids=["promoted", "kept"])
def test_a_promotion_event_renders_into_the_alert_flows_parameters(promoted: bool) -> None:
    """The event as tasks/decisions/promotion.py event_payload makes it, through PrefectSink.event (the job's
    resource with the decision as a label), renders into the alert's parameters: both values, the rule."""
    held = {"job": "nightly", "run_key": "2026-12-04", "storage": "/s/2026-12-04", "step": 10, "version": "3"}
    rule = Promotion(better_by=0.01, champion=held)
    decision = decide_promotion(rule, {"eval_loss": 1.1 if promoted else 1.3}, {"eval_loss": 1.2})
    payload, labels = event_payload(
        decision.registered("nightly", "4", promoted),
        run_key="2026-12-05",
        job_run_id="jr-1",
        flow_run_id="fr-1",
    )
    event = {
        "event": MODEL_PROMOTION,
        "resource": job_resource("nightly", **labels),
        "payload": {"job": "nightly"} | payload,
    }
    auto = _by_name(AlertRules())[PROMOTION]
    t = auto.trigger
    assert (t.expect, t.threshold, t.posture) == ({MODEL_PROMOTION}, 1, "Reactive")
    assert t.match.root == {"prefect.resource.id": "spotrun.job.*", PROMOTION_LABEL: ["promoted", "kept"]}
    params = _alert_flow_accepts(_rendered(auto.actions[0].parameters, event, None))
    assert (params["kind"], params["job"], params["training_flow_run_id"]) == (
        AlertKind.PROMOTION,
        "nightly",
        "fr-1",
    )
    facts = params["promotion"]
    assert (facts.promoted, facts.challenger, facts.champion) == (promoted, decision.challenger, 1.2)
    assert (facts.run_key, facts.version, facts.alias_moved, facts.better_by) == (
        "2026-12-05",
        "4",
        promoted,
        0.01,
    )
    assert facts.reason == decision.reason
    assert (facts.champion_version, facts.champion_run) == ("3", "2026-12-04")
    assert set(payload) - {"flow_run_id"} <= {f.name for f in dataclasses.fields(PromotionFacts)}


def test_an_older_promotion_event_renders_with_defaults() -> None:
    event = {"event": MODEL_PROMOTION, "resource": job_resource("nightly"), "payload": {"job": "nightly"}}
    params = _alert_flow_accepts(
        _rendered(_by_name(AlertRules())[PROMOTION].actions[0].parameters, event, None)
    )
    assert params["promotion"] == PromotionFacts()


FLOW_RUN = "0b7f9c1e-2a43-4a4e-9d0c-1f2e3d4c5b6a"


def _state_event(state: str, **labels: str) -> dict[str, Any]:
    """A flow run's state event as the server makes it (prefect/server/models/events.py)."""
    resource = {
        "prefect.resource.id": f"prefect.flow-run.{FLOW_RUN}",
        "prefect.state-name": state,
        "prefect.resource.name": "crafty-lemur",
        "prefect.state-type": state.upper(),
    }
    return {"event": f"prefect.flow-run.{state}", "resource": resource | labels}


def _run(**kw: Any) -> SimpleNamespace:
    """The flow run the server reads for a template that names `flow_run`."""
    base: dict[str, Any] = {"id": UUID(FLOW_RUN), "parameters": {"job": {"name": "charlm-nightly"}}}
    return SimpleNamespace(**(base | kw))


def test_a_failed_training_run_alerts_after_a_wait_unless_started_again() -> None:
    auto = _by_name(AlertRules())[RUN_FAILED]
    t = auto.trigger
    assert (t.posture, t.after, t.threshold, t.within) == (
        "Proactive",
        {"prefect.flow-run.Failed"},
        1,
        timedelta(seconds=FAILED_WAIT_S),
    )
    assert "prefect.flow-run.Running" in t.expect and "prefect.flow-run.Failed" not in t.expect
    assert t.for_each == {"prefect.resource.id"}  # one clock per flow run
    assert _related(t) == [
        {"prefect.resource.role": "flow", "prefect.resource.name": "resilient-training"},
        {"prefect.resource.role": "deployment"},
    ]
    message = "refused: run key 'a b' is not one path component; change run_key or --run-key"
    event = _state_event("Failed", **{"prefect.state-message": message})
    for run, job in ((_run(), "charlm-nightly"), (None, "crafty-lemur")):  # the run unreadable: its name
        params = _alert_flow_accepts(_rendered(auto.actions[0].parameters, event, run))
        assert (params["kind"], params["job"], params["reason"]) == (AlertKind.RUN_FAILED, job, message)
        assert (params["training_flow_run_id"], params["checkpoint"]) == (FLOW_RUN, "")


SCHEDULES: list[tuple[str, dict[str, Any], float | None]] = [
    ("nightly", {"cron": "0 3 * * *", "timezone": "UTC"}, 86400),
    ("nightly across DST", {"cron": "0 3 * * *", "timezone": "Europe/Berlin"}, 86400),
    ("weekdays: Friday's is due by Saturday", {"cron": "0 3 * * 1-5"}, 86400),
    ("every 15 minutes", {"cron": "*/15 * * * *"}, 900),
    ("monthly: the common month", {"cron": "0 3 1 * *"}, 31 * 86400),
    ("interval in seconds", {"interval": 600}, 600),
    ("interval as a timedelta", {"interval": timedelta(hours=6)}, 21600),
    ("rrule: not known here", {"rrule": "FREQ=DAILY"}, None),
]


@pytest.mark.parametrize(("schedule", "period"), [pytest.param(*c[1:], id=c[0]) for c in SCHEDULES])
def test_schedule_period(schedule: dict[str, Any], period: float | None) -> None:
    assert period_s(schedule) == period


def test_the_nightly_deployment_is_the_scheduled_training() -> None:
    assert scheduled_training(DOC) == [ScheduledTraining("nightly-retraining", "charlm-nightly", 86400.0)]


def test_a_scheduled_run_not_ended_by_its_deadline_alerts_once() -> None:
    """Per flow run, from its Pending (a worker took it) or Late (nobody did: a worker that is down);
    any end stops the clock; the deadline is the next slot unless the rules set one."""
    nightly = ScheduledTraining("nightly-retraining", "charlm-nightly", 86400.0)
    autos = {a.name: a for a in build_automations(AlertRules(), uuid4(), [nightly])}
    auto = autos[MISSED_RUN + "nightly-retraining"]
    t = auto.trigger
    assert (t.posture, t.threshold, t.within) == ("Proactive", 1, timedelta(days=1))
    assert t.after == {"prefect.flow-run.Pending", "prefect.flow-run.Late"}
    assert t.expect == {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    assert t.for_each == {"prefect.resource.id"}
    assert _related(t)[1] == {
        "prefect.resource.role": "deployment",
        "prefect.resource.name": "nightly-retraining",
    }
    slot = datetime(2026, 12, 5, 3, tzinfo=UTC)
    run = _run(expected_start_time=slot, state=SimpleNamespace(name="Late"))
    params = _alert_flow_accepts(_rendered(auto.actions[0].parameters, _state_event("Late"), run))
    assert (params["kind"], params["job"], params["window_s"]) == (
        AlertKind.MISSED_RUN,
        "charlm-nightly",
        86400,
    )
    assert (params["checkpoint"], params["reason"]) == (str(slot), "Late")
    assert params["training_flow_run_id"] == FLOW_RUN
    unread = _alert_flow_accepts(_rendered(auto.actions[0].parameters, _state_event("Pending"), None))
    assert (unread["job"], unread["checkpoint"], unread["reason"]) == ("charlm-nightly", "", "")
    sooner = build_missed_run_automations(AlertRules(missed_run_after_s=7200), uuid4(), [nightly])
    assert sooner[0].trigger.within == timedelta(hours=2)
    rrule = ScheduledTraining("odd", "j", None)
    assert build_missed_run_automations(AlertRules(), uuid4(), [rrule]) == []  # no period: set the deadline
    assert len(build_missed_run_automations(AlertRules(missed_run_after_s=3600), uuid4(), [rrule])) == 1
    dated = ScheduledTraining("dated", "j", 86400.0, deadline_s=6 * 3600)  # the job's deadline: 6h
    (auto,) = build_missed_run_automations(AlertRules(missed_run_after_s=7200), uuid4(), [dated])
    assert auto.trigger.within == timedelta(hours=6)
    deployment = {
        "name": "n",
        "entrypoint": "spotrun.flows.resilient_training:resilient_training",
        "schedules": [{"cron": "0 2 * * *"}],
        "parameters": {"job": {"name": "n", "deadline": "8h"}},
    }
    doc = {"deployments": [deployment]}
    assert [d.deadline_s for d in scheduled_training(doc)] == [8 * 3600.0]


def test_the_deadline_at_risk_event_renders_into_the_alert_flows_parameters() -> None:
    from spotrun.flows.restart_alert import restart_alert

    payload = {"job": "digits", "deadline": "8h (2026-12-07 06:00 UTC)", "problem": "late by 0.50 h"}
    event = {"event": DEADLINE_AT_RISK, "resource": job_resource("digits"), "payload": payload}
    auto = _by_name(AlertRules())[AT_RISK]
    params = restart_alert.validate_parameters(_rendered(auto.actions[0].parameters, event, None))
    assert (params["kind"], params["job"]) == (AlertKind.DEADLINE_AT_RISK, "digits")
    assert (params["checkpoint"], params["reason"]) == (payload["deadline"], "late by 0.50 h")
