"""A rebalance recommendation starts the replacement before the notice, and the trainer trains on: the
control loop over scripted attempts (no processes), the recommendation arriving as the trainer reports
it (a `notice` status record with stop false, trainer/preemption/notices.py), SQL history in SQLite."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotrun.tasks.control.loop import PlainSink, run_job
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.providers.base import Market, Worker
from spotrun.tasks.settings import Settings
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.telemetry.records import Notice, Record, Step
from tests.fakes.provider import Ending, FakeAttempt, FakeProvider, _Clock, _Handle


class Rebalancing(FakeProvider):
    """Attempt 1 gets EC2's rebalance recommendation at step 15, its notice at step 30."""

    def __init__(self) -> None:
        super().__init__([FakeAttempt(until=30, ending=Ending.NOTICE), FakeAttempt()])
        self.prewarm, self.rebalance_wait_s = True, 900.0
        self.extra: list[list[str]] = []
        self.provisioned_by_step: dict[int, int] = {}  # step -> workers provisioned by then

    def provision(
        self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str], *, market: Market = "spot"
    ) -> Worker:
        self.extra.append(extra_args)
        return super().provision(job, attempt, spec_path, extra_args, market=market)

    def _records(self, h: _Handle, clock: _Clock) -> Iterator[Record]:
        for rec in super()._records(h, clock):
            yield rec
            if h.resume is None and isinstance(rec, Step):
                if rec.step == 15:
                    yield Notice(t=clock.now(), cloud="aws", action="rebalance recommendation", stop=False)
                    deadline = time.monotonic() + 5  # the replacement is provisioned in a thread
                    while len(self.provisioned) < 2 and time.monotonic() < deadline:
                        time.sleep(0.005)
                self.provisioned_by_step[rec.step] = len(self.provisioned)


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing may call Prefect
    return Settings(tmp_path / "home", f"sqlite:///{tmp_path / 'history.db'}")


def test_a_rebalance_recommendation_starts_the_replacement_and_training_goes_on(
    tmp_path: Path, settings: Settings
) -> None:
    job = JobSpec.model_validate(
        {"name": "rebalanced", "recipe": "digits", "total_steps": 100, "storage": str(tmp_path / "store")}
    )
    provider = Rebalancing()
    result = run_job(job, provider, RetryPolicy(), PlainSink(), settings=settings, sleep=lambda s: None)
    assert result.completed, result.message
    # provisioned at step 15, long before the notice at step 30; attempt 2 ran on it: two workers in all
    assert provider.provisioned_by_step[14] == 1 and provider.provisioned_by_step[16] == 2
    assert len(provider.provisioned) == 2
    assert provider.extra[1][-2:] == ["--prewarm-wait", "900"]  # it stands by for the notice
    store = HistoryStore.open(settings.database_url)
    try:
        rows = store.attempts(job="rebalanced")
    finally:
        store.close()
    first = rows[0]
    # the trainer trained on to its notice at step 30, and the row says when the recommendation came
    assert (first.outcome.value, first.last_step) == ("preempted", 30)
    assert first.extra["prewarmed_at"] == "rebalance" and first.extra["rebalance_at"] > 0
    assert rows[1].worker_id == provider.provisioned[1].id
