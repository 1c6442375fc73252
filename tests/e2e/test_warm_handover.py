"""A reclaim without notice with `warm: 1`: the standby trainer, started with attempt 1 and waiting on the
storage lease, takes the job over (no trainer is provisioned for attempt 2), its row says it came from the
warm pool, attempt 1's row holds the standby's time, and the job completes bitwise equal to an
uninterrupted run. With `standby_every_s`, attempt 1 sent the standby copies of its state between
checkpoints: attempt 2 resumed from the newest copy, not from the last checkpoint, and lost less than
the checkpoint interval. Through run_job with the local provider and real trainers (no Prefect server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.control.loop import PlainSink, run_job
from spotrun.tasks.control.warm import FROM_POOL, STANDBY_COPY, WARM
from spotrun.tasks.decisions.lost_steps import lost_steps, walk
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.providers.base import Worker
from spotrun.tasks.providers.local import (
    LocalProvider,
    LocalProviderConfig,
    PlannedPreemption,
    SpotSimulatorConfig,
)
from spotrun.tasks.settings import Settings
from spotrun.trainer.checkpoint.format import step_dir
from spotrun.trainer.spec.job import JobSpec
from tests.e2e.test_flow import reference_dir
from tests.trainer_runs import assert_states_equal


class Counted(LocalProvider):
    """The local provider, keeping (attempt, worker id, standby or not) of every trainer it starts."""

    def __init__(self, cfg: LocalProviderConfig) -> None:
        super().__init__(cfg)
        self.started: list[tuple[int, str, bool]] = []

    def provision(
        self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str], **kw: Any
    ) -> Worker:
        worker = super().provision(job, attempt, spec_path, extra_args, **kw)
        self.started.append((attempt, worker.id, "--prewarm-wait" in extra_args))
        return worker


def test_a_reclaim_without_notice_hands_the_job_to_the_warm_standby_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # anything that calls Prefect fails
    spec = JobSpec.model_validate(
        {
            "name": "warm",
            "recipe": "digits",
            "args": {"hidden": 32},
            "total_steps": 3000,  # 3 s at the fastest: the kill after 2 s of training always comes first
            "threads": 1,
            "seed": 7,
            # no checkpoint before the final one; a copy to the standby every 0.1 s or, where a copy costs
            # the loop more than 3% of its time at that rate, less often
            "checkpoint": {"every_steps": 4000, "keep": 3, "standby_every_s": 0.1},
            "storage": str(tmp_path / "store"),
            "tracking": {"mlflow": False},
        }
    )
    reference = reference_dir(spec, tmp_path)
    # attempt 1 is SIGKILLed without notice 2 s into its training; attempt 2 runs on
    sim = SpotSimulatorConfig(schedule=[PlannedPreemption(after_s=2.0, notice=False)])
    cfg = LocalProviderConfig(workdir=str(tmp_path / "work"), warm=1, simulator=sim)
    provider = Counted(cfg)
    home = tmp_path / "home"
    settings = Settings(home, f"sqlite:///{home / 'history.db'}")
    result = run_job(spec, provider, RetryPolicy(), PlainSink(), settings=settings, sleep=lambda s: None)
    assert result.completed, result.message

    store = HistoryStore.open(settings.database_url)
    rows = store.attempts(job="warm")
    store.close()
    assert [r.outcome.value for r in rows] == ["preempted", "completed"], [r.cause for r in rows]
    assert rows[0].extra["kill_reason"] == "no-notice", rows[0].extra
    # attempt 2's worker is the standby started during attempt 1: no trainer was started for it after
    # the reclaim, and its row says where it came from
    second = [(w, standby) for a, w, standby in provider.started if a == 2]
    assert second == [(rows[1].worker_id, True)], provider.started
    assert rows[1].extra[FROM_POOL]["stood_by_s"] > 0, rows[1].extra
    assert rows[0].extra[WARM]["standby_s"] > 0 and rows[0].extra[WARM]["usd"] is None, rows[0].extra
    print(f"\nattempt 2 resumed from step {rows[1].resumed_from} after attempt 1 reached {rows[0].last_step}")
    resumed = rows[1].resumed_from or 0
    assert resumed > 0, "attempt 2 started from scratch, not from the standby's copy"
    # the row's lost steps: the controller's estimate when it recorded them, from the newest copy the
    # standby had confirmed in a step record (a later copy may have landed since); the goodput report
    # counts from where attempt 2 really resumed
    copied = rows[0].extra[STANDBY_COPY]
    assert 0 < copied <= resumed and rows[0].lost_steps == rows[0].last_step - copied, rows[0]
    _, kept = walk(rows)  # the one rule, as the goodput report applies it to the stored rows
    assert lost_steps(rows[0].last_step, kept[0]) == rows[0].last_step - resumed, kept
    assert WARM in rows[1].extra  # the pool refilled: attempt 2 kept a standby too, released unused
    assert [a for a, _, standby in provider.started if standby] == [2, 3]
    assert_states_equal(Path(spec.storage) / step_dir(spec.total_steps), reference)
