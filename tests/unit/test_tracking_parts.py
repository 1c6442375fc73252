"""Experiment tracking's pure parts: resume-fidelity verdicts (tables), the trainer's metrics buffer, reading
the published steps back, retention leaving them alone, and where a job's runs are tracked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.providers.base import WatchResult, Worker
from spotrun.tasks.tracking.fidelity import (
    ResumeChecker,
    Value,
    continuity_verdict,
    replay_verdict,
    replayed,
    worst_verdict,
)
from spotrun.tasks.tracking.mlflow_run import RunRef, flatten
from spotrun.tasks.tracking.steps import committed_step, read_steps
from spotrun.tasks.tracking.tracker import Where
from spotrun.trainer.checkpoint.catalog import apply_retention
from spotrun.trainer.checkpoint.format import MANIFEST, step_dir
from spotrun.trainer.saving.checkpointer import put_sidecars
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import LocalStorage, put_bytes
from spotrun.trainer.telemetry.metrics_log import MetricsLog, metrics_key, parse_metrics_key, prune_after
from spotrun.trainer.telemetry.records import build
from tests.trainer_runs import REPO

L = {1: Value(2.5, 1e-3), 2: Value(2.25, 1e-3), 3: Value(2.0, 9e-4)}


@pytest.mark.parametrize(
    ("lost", "resumed", "verdict", "first_diff"),
    [
        (L, L, "exact", None),
        (L, {**L, 2: Value(2.25 * (1 + 1e-6), 1e-3)}, "close", 2),  # within 1e-3
        (L, {**L, 3: Value(2.0, 9e-4 * (1 + 1e-5))}, "close", 3),  # the rate counts too
        (L, {**L, 2: Value(2.3, 1e-3), 3: Value(2.1, 9e-4)}, "mismatch", 2),
        ({2: Value(2.25)}, L, "exact", None),  # one sampled step (EC2: the last status record)
        ({7: Value(1.0)}, L, None, None),  # nothing in common: no verdict
    ],
)
def test_replay_verdict(
    lost: dict[int, Value], resumed: dict[int, Value], verdict: str | None, first_diff: int | None
) -> None:
    v = replay_verdict(lost, resumed, rtol=1e-3)
    assert (v.verdict, v.first_diff) == (verdict, first_diff) if v is not None else verdict is None


FLAT = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0]


@pytest.mark.parametrize(
    ("expected_lr", "first", "recent", "verdict"),
    [
        (1e-3, Value(1.0, 1e-3), FLAT, "exact"),  # the rate bit for bit, the loss in the trend
        (1e-3, Value(1.0, 1e-3 * (1 + 1e-6)), FLAT, "close"),
        (1e-3, Value(1.0, 5e-4), FLAT, "mismatch"),  # the schedule restarted
        (1e-3, Value(2.3, 1e-3), FLAT, "mismatch"),  # the weights were not restored
        (None, Value(1.0), FLAT, None),  # no rate to compare: a trend can only refute, it proves no bits
        (None, Value(2.3), FLAT, "mismatch"),
        (1e-3, Value(9.0, 1e-3), FLAT[:3], "exact"),  # too few losses for a trend: the rate alone
        (None, Value(1.0), FLAT[:3], None),
        (1e-3, None, FLAT, None),  # the resumed attempt's first step is not known
    ],
)
def test_continuity_verdict(
    expected_lr: float | None, first: Value | None, recent: list[float], verdict: str | None
) -> None:
    v = continuity_verdict(11, expected_lr, first, recent=recent, rtol=1e-3)
    assert (v.verdict if v is not None else None) == verdict


def test_worst_verdict() -> None:
    assert worst_verdict(["exact", "close", "exact"]) == "close"
    assert worst_verdict(["close", "mismatch"]) == "mismatch"
    assert worst_verdict([]) is None
    assert worst_verdict(["exact", "unchecked"]) == "unchecked"  # one resume nobody could check
    assert worst_verdict(["unchecked", "close"]) == "close"


def test_a_commands_resume_with_nothing_to_compare_is_unchecked(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "store")
    metrics = _file(tmp_path / "m.jsonl")  # the script reported no loss
    for command, expect in ((False, None), (True, "unchecked")):
        checker = ResumeChecker(storage, rtol=1e-3, command=command)
        check = checker.check(_worker(metrics), _watched(20), _attempt(1, 23), 2)
        assert (check.verdict if check else None) == expect
    fresh = ResumeChecker(storage, rtol=1e-3, command=True)  # a restart from scratch that lost nothing
    assert fresh.check(_worker(metrics), _watched(None), _attempt(1, 0), 2) is None


def _lines(*steps: int) -> list[tuple[int, float]]:
    return [(s, float(s)) for s in steps]


@pytest.mark.parametrize(
    ("lines", "resumed_from", "lost", "mine"),
    [
        # attempt 1 ran to 15 with step 10 durable, was killed; attempt 2 resumed from 10 and ran to 17
        (_lines(*range(1, 16), *range(11, 18)), 10, range(11, 16), range(11, 18)),
        # with a notice the resumed attempt continues the line before it: nothing computed twice
        (_lines(*range(1, 11), *range(11, 18)), 10, (), ()),
        # an earlier replay in the file (resumed from 5) is not this one's
        (_lines(*range(1, 9), *range(6, 14), *range(11, 16)), 10, range(11, 14), range(11, 16)),
        # resumed from scratch after a reclaim before the first checkpoint
        (_lines(1, 2, 3, 1, 2), 0, range(1, 4), range(1, 3)),
        ([], 10, (), ()),
        # logged every 5 steps: attempt 1 logged 5-15 (10 durable) and was killed; attempt 2 logs 15, 20
        (_lines(5, 10, 15, 15, 20), 10, [15], [15, 20]),
        # the same with a notice at step 12: attempt 2 continues the line, nothing computed twice
        (_lines(5, 10, 15, 20), 12, (), ()),
        # a resume from 12 after a kill at 27: attempt 2 (from 12) logged 15-25, attempt 3 logs 15 on
        (_lines(5, 10, 15, 20, 25, 15, 20), 12, [15, 20, 25], [15, 20]),
    ],
)
def test_replayed_steps_from_the_metrics_file(
    lines: list[tuple[int, float]], resumed_from: int, lost: range, mine: range
) -> None:
    a, b = replayed(lines, resumed_from)
    assert (sorted(a), sorted(b)) == (list(lost), list(mine))


def _store(storage: LocalStorage, sidecars: dict[str, bytes], committed: int | None = None) -> None:
    """What a checkpoint writer does with a checkpoint's sidecars: write them, then (unless it was
    killed first) the checkpoint's manifest."""
    for key, body in sidecars.items():
        put_bytes(storage, key, body)
    if committed is not None:
        put_bytes(storage, f"{step_dir(committed)}/{MANIFEST}", b"{}")


def test_a_checkpoint_carries_each_step_once(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    log = MetricsLog(storage)
    for step in range(1, 8):
        log.record(
            step,
            1.0 / step,
            1e-3 * step,
            lr_next=1e-3 * (step + 1),
            metrics={"eval_loss": 0.1 / 3} if step == 3 else None,
        )
    first = log.sidecars(5)  # the checkpoint at 5; 6 and 7 come after it
    assert list(first) == [metrics_key(5)] and log.sidecars(5) == first  # nothing dropped before durable
    _store(storage, first, committed=5)
    log.written(5)
    assert log.sidecars(5) == {}  # nothing left up to 5: no second object
    got = read_steps(storage)
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert got[3].loss == 1.0 / 3 and got[3].lr == 3e-3  # bitwise, through float.hex
    assert got[3].metrics == {"eval_loss": 0.1 / 3} and got[4].metrics == {}  # the loop's own, bitwise
    assert got[5].lr_next == 6e-3 and got[4].lr_next is None  # the checkpoint step's next rate only
    assert got[1].steps_per_s is None and got[2].steps_per_s is not None
    _store(storage, log.sidecars(7), committed=7)
    assert sorted(read_steps(storage)) == list(range(1, 8))
    assert sorted(read_steps(storage, after=5)) == [6, 7]
    assert committed_step(storage) == 7


def test_steps_whose_sidecar_failed_go_with_the_next_checkpoint(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    log = MetricsLog(storage)
    for step in range(1, 5):
        log.record(step, 1.0, 1e-3, 1e-3)
    log.sidecars(2)  # its write failed; the checkpoint stands
    log.written(2, sidecars_written=False)
    _store(storage, log.sidecars(4), committed=4)
    assert [o.key for o in storage.list("metrics/")] == [metrics_key(4)]
    assert sorted(read_steps(storage)) == [1, 2, 3, 4]


class Flaky(LocalStorage):
    fail = True

    def put(self, key: str, src: Path) -> None:
        if self.fail and key.startswith("metrics/"):
            raise OSError("disk full")
        super().put(key, src)


def test_a_failed_sidecar_never_fails_its_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = Flaky(tmp_path)
    assert put_sidecars(storage, {metrics_key(2): b"x\n"}) is False
    assert "sent again with the next checkpoint" in caplog.text and not list(storage.list("metrics/"))
    storage.fail = False
    assert put_sidecars(storage, {metrics_key(4): b"x\n"}) is True


def test_an_uncommitted_checkpoints_metrics_are_never_sent_and_the_next_attempt_deletes_them(
    tmp_path: Path,
) -> None:
    """Killed between the sidecar and the manifest of step 10: its steps 6-10 wait, unsent; the next
    attempt resumes from 5, deletes the object and trains 6-10 again."""
    storage = LocalStorage(tmp_path)
    lost = MetricsLog(storage)
    for step in range(1, 11):
        lost.record(step, 1.0, 1e-3, 1e-3)
    _store(storage, lost.sidecars(5), committed=5)
    lost.written(5)
    _store(storage, lost.sidecars(10))  # no manifest: the kill
    assert committed_step(storage) == 5
    assert sorted(read_steps(storage, through=committed_step(storage))) == [1, 2, 3, 4, 5]
    assert prune_after(storage, 5) == [metrics_key(10)]
    resumed = MetricsLog(storage)
    for step in range(6, 9):
        resumed.record(step, 2.0, 1e-3, 1e-3)
    _store(storage, resumed.sidecars(8), committed=8)
    got = read_steps(storage, through=committed_step(storage))
    assert sorted(got) == list(range(1, 9)) and {got[s].loss for s in range(6, 9)} == {2.0}


def test_ranks_other_than_the_first_write_nothing(tmp_path: Path) -> None:
    log = MetricsLog(None)
    log.record(1, 1.0, 1e-3, 1e-3)
    assert log.sidecars(1) == {}


def test_a_step_in_two_objects_counts_once_from_the_first(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)

    def obj(durable: int, steps: range, loss: float) -> None:
        lines = [json.dumps({"step": s, "t": 1.0, "loss": loss.hex(), "lr": (1e-3).hex()}) for s in steps]
        put_bytes(storage, metrics_key(durable), ("\n".join(lines) + "\n").encode())

    obj(20, range(11, 21), 1.0)
    obj(15, range(11, 16), 2.0)  # a recomputation after a quarantine, older key: read first
    got = read_steps(storage)
    assert sorted(got) == list(range(11, 21)) and got[12].loss == 2.0 and got[18].loss == 1.0
    assert sorted(read_steps(storage, after=12, through=14)) == [13, 14]
    assert parse_metrics_key("metrics/step_000000020.jsonl") == 20 and parse_metrics_key("latest") is None


def test_retention_never_touches_the_metrics(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    for step in (10, 20, 30, 40):
        put_bytes(storage, f"{step_dir(step)}/model.safetensors", b"w")
        put_bytes(storage, f"{step_dir(step)}/{MANIFEST}", b"{}")
        put_bytes(storage, metrics_key(step), b"{}\n")
    put_bytes(storage, "tracking.json", b"{}")
    assert apply_retention(storage, verified=40, keep=2, orphan_age_s=0) == [10, 20]
    assert [o.key for o in storage.list("metrics/")] == [metrics_key(s) for s in (10, 20, 30, 40)]
    assert (tmp_path / "tracking.json").is_file()


def _job(**tracking: object) -> JobSpec:
    return JobSpec.model_validate({"name": "j", "recipe": "digits", "total_steps": 5, "tracking": tracking})


def test_where_a_job_is_tracked(tmp_path: Path) -> None:
    embedded = Where.of(_job(), tmp_path, {})
    assert embedded.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}" and embedded.experiment == "j"
    assert embedded.artifact_root == (tmp_path / "mlflow-artifacts").as_uri()
    env = {"MLFLOW_TRACKING_URI": "http://mlflow.team:5000"}
    assert Where.of(_job(), tmp_path, env).tracking_uri == "http://mlflow.team:5000"
    spec = _job(uri="https://mlflow.example", experiment="team-x")
    assert (Where.of(spec, tmp_path, env).tracking_uri, Where.of(spec, tmp_path, env).experiment) == (
        "https://mlflow.example",
        "team-x",
    )
    assert Where.of(spec, tmp_path, env).embedded is None


def test_tracking_options_in_the_spec() -> None:
    assert _job().tracking.mlflow and _job().tracking.register_model
    off = _job(mlflow=False, register=False)
    assert not off.tracking.mlflow and not off.tracking.register_model
    assert off.model_dump(mode="json")["tracking"]["register"] is False  # the name people write
    with pytest.raises(ValueError, match="not a tracking URI"):
        _job(uri="mlflow.team")


def test_params_and_urls() -> None:
    params = flatten({"args": {"hidden": 32, "dims": [1, 2]}, "name": "j", "amp": False, "x": None})
    assert params == {"args.hidden": "32", "args.dims": "[1, 2]", "name": "j", "amp": "false", "x": "null"}
    ref = RunRef("sqlite:////h/mlflow.db", "1", "abc")
    assert ref.url() == "http://127.0.0.1:5000/#/experiments/1/runs/abc"
    assert RunRef("http://m:5000/", "2", "r").url() == "http://m:5000/#/experiments/2/runs/r"


def _attempt(n: int, last_step: int, outcome: Outcome = Outcome.PREEMPTED) -> AttemptRecord:
    return AttemptRecord(
        n, f"w{n}", "p", started_at=0.0, ended_at=1.0, outcome=outcome, cause="", last_step=last_step
    )


def _watched(resumed_from: int | None, progress: tuple[int, float] | None = None) -> WatchResult:
    r = WatchResult(started_at=0.0)
    r.fold(build("started", 1.0, resumed_from=resumed_from, step=resumed_from or 0))
    if progress is not None:
        r.fold(build("step", 2.0, step=progress[0], loss=progress[1]))
    return r


def _worker(metrics: Path | None) -> Worker:
    args = ["python", "-m", "spotrun.trainer"] + (["--metrics", str(metrics)] if metrics else [])
    return Worker("w", "p", 1, 0.0, handle=SimpleNamespace(proc=SimpleNamespace(args=args)))


def _file(path: Path, *steps: tuple[int, float]) -> Path:
    path.write_text("".join(json.dumps({"step": s, "loss": v.hex()}) + "\n" for s, v in steps))
    return path


def test_resume_checks_from_the_metrics_file_or_the_last_status_record(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "store")
    log = MetricsLog(storage)
    for s in range(1, 21):
        log.record(s, 2.0 - s / 20, 1e-3, 1e-3)
    _store(storage, log.sidecars(20), committed=20)  # attempt 1's steps, 1-20, with the rate set for 21
    checker = ResumeChecker(storage, rtol=1e-3)
    assert checker.check(_worker(None), _watched(None), None, 1) is None  # the first attempt

    # a notice at 20; attempt 2 died (no notice) at 23 before its first durable checkpoint: only the
    # file has its first step, and no rate is known for it. In the trend: no verdict; far off: mismatch
    metrics = _file(tmp_path / "m.jsonl", *[(s, 2.0 - s / 20) for s in range(1, 21)], (21, 9.0), (22, 9.0))
    check = ResumeChecker(storage, rtol=1e-3).check(_worker(metrics), _watched(20), _attempt(1, 20), 2)
    assert check is not None and (check.method, check.verdict) == ("continuity", "mismatch")
    _file(metrics, *[(s, 2.0 - s / 20) for s in range(1, 24)])
    assert checker.check(_worker(metrics), _watched(20), _attempt(1, 20), 2) is None

    # attempt 3 resumed from 20 again and recomputed 21-23 differently: a mismatch, first at 21
    _file(metrics, *[(s, 2.0 - s / 20) for s in range(1, 24)], *[(s, 5.0) for s in range(21, 26)])
    check = checker.check(_worker(metrics), _watched(20), _attempt(2, 23), 3)
    assert check is not None and (check.method, check.verdict, check.first_diff) == ("replay", "mismatch", 21)

    # no file (EC2): the lost attempt's status records (and those its last heartbeat carried), each
    # against the resumed attempt's value for that step from storage
    checker = ResumeChecker(storage, rtol=1e-3)
    lost = _watched(None, progress=(18, 2.0 - 18 / 20))
    lost.add_losses({16: 2.0 - 16 / 20, 17: 2.0 - 17 / 20, 12: 0.0})  # 12: before the resume point
    checker.check(_worker(None), lost, None, 1)
    check = checker.check(_worker(None), _watched(15), _attempt(1, 18), 2)
    assert check is not None and (check.method, check.verdict, check.steps) == ("replay", "exact", 3)
    lost.add_losses({17: 1.0})  # the lost attempt computed 17 differently
    checker.check(_worker(None), lost, None, 1)
    check = checker.check(_worker(None), _watched(15), _attempt(1, 18), 2)
    assert check is not None and (check.verdict, check.first_diff) == ("mismatch", 17)


def test_the_trainer_never_imports_mlflow() -> None:
    """`import mlflow` takes 2-4 s: never on a restart's path. Only the controller sends to MLflow."""
    code = (
        "import sys, trainer.__main__, trainer.session.loop, trainer.distributed.agent,"
        " trainer.launch.start, trainer.telemetry.metrics_log\n"
        "sys.exit(sorted(m for m in sys.modules if m.split('.')[0] in ('mlflow', 'tasks'))[:3] or 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert (done.returncode, done.stderr) == (0, "")
