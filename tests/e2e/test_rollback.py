"""A loss spike in the first attempt (its weights scaled mid-run: trainer/session/faults.py): the
watchdog's loss-spike rule kills the worker, the checkpoints taken since are quarantined, and the next
attempt resumes from the one before the spike and skips the data up to it. The job ends bitwise equal
to the trainer alone going the same way (stopped at that checkpoint, then resumed with the same skip),
so the rollback resumed from the right state and skipped exactly the data it recorded. Through run_job
with the local provider and real trainers (no Prefect server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spotrun.tasks.control.loop import PlainSink, run_job
from spotrun.tasks.decisions.policy import RetryPolicy
from spotrun.tasks.history import HistoryStore
from spotrun.tasks.providers.base import Worker
from spotrun.tasks.providers.local import LocalProvider, LocalProviderConfig
from spotrun.tasks.reports import reporting as report
from spotrun.tasks.settings import Settings
from spotrun.trainer.checkpoint.catalog import Catalog
from spotrun.trainer.checkpoint.format import step_dir
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import open_storage
from tests.trainer_runs import assert_states_equal, trainer

SPIKE_AT = 103  # the weights are scaled after this step: step 104's loss is the first spiked one


class SpikesOnce(LocalProvider):
    """The local provider whose first trainer's weights are scaled after step SPIKE_AT."""

    def provision(
        self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str], **kw: Any
    ) -> Worker:
        fault = ["--inject-fault", f"spike@{SPIKE_AT}"] if attempt == 1 else []
        return super().provision(job, attempt, spec_path, [*extra_args, *fault], **kw)


def test_a_loss_spike_rolls_back_past_its_checkpoints_and_skips_its_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # anything that calls Prefect fails
    spec = JobSpec.model_validate(
        {
            "name": "spikes",
            "recipe": "digits",
            "args": {"hidden": 32},
            "total_steps": 200,
            "threads": 1,
            "seed": 5,
            "checkpoint": {"every_steps": 5, "keep": 50},
            "storage": str(tmp_path / "store"),
            "log_every": 1,  # every loss reaches the controller
            "tracking": {"mlflow": False},
            # patience 10: the spiked attempt saves steps 105 and 110 before the rule fires at step 113
            "watchdog": {"loss_spike": {"factor": 3, "window": 20, "patience": 10}},
        }
    )
    cfg = LocalProviderConfig(workdir=str(tmp_path / "work"))
    home = tmp_path / "home"
    settings = Settings(home, f"sqlite:///{home / 'history.db'}")
    sink = PlainSink()
    result = run_job(spec, SpikesOnce(cfg), RetryPolicy(), sink, settings=settings, sleep=lambda s: None)
    assert result.completed, result.message

    store = HistoryStore.open(settings.database_url)
    rows = store.attempts(job="spikes")
    store.close()
    assert [r.outcome.value for r in rows] == ["rolled_back", "completed"], [r.cause for r in rows]
    spiked, resumed = rows
    fired = spiked.extra["watchdog"]["fired"]
    assert fired["section"] == "loss_spike" and fired["first_bad_step"] == SPIKE_AT + 1, fired
    assert fired["last_good_step"] == SPIKE_AT, fired
    assert "loss spike" in spiked.cause and "rolled back" in spiked.cause, spiked.cause
    rollback = spiked.extra["rollback"]
    print(f"\nrollback: fired at step {fired['step']}, durable {spiked.last_durable_step}: {rollback}")
    to_step, skip = rollback["to_step"], rollback["skip_steps"]
    assert to_step is not None and to_step <= SPIKE_AT and skip == SPIKE_AT + 1 - to_step, rollback
    # every checkpoint the spiked attempt made after its last good step is out of the timeline
    durable_after = list(range(to_step + 5, (spiked.last_durable_step or 0) + 1, 5))
    assert rollback["quarantined"] and rollback["quarantined"][: len(durable_after)] == durable_after, (
        rollback
    )
    assert resumed.resumed_from == to_step
    assert resumed.extra["spec_changes"][0]["field"] == "data", resumed.extra
    assert spiked.lost_steps == spiked.last_step - to_step  # the one rule: back to where it resumes
    names = [name for name, _ in sink.events]
    assert report.ATTEMPT_ROLLED_BACK in names and report.ATTEMPT_FAILED not in names, names

    # the trainer alone, the same way: stopped at that checkpoint, resumed skipping the same data
    ref = tmp_path / "reference"
    ref.mkdir()
    job_file = ref / "job.yaml"
    job_file.write_text(json.dumps({**spec.model_dump(mode="json"), "watchdog": {}}))
    first = trainer(job_file, str(ref / "store"), ref, "--max-steps", str(to_step))
    assert first.returncode == ExitCode.STOPPED, first.stderr[-2000:]
    second = trainer(job_file, str(ref / "store"), ref, "--skip-steps", f"{skip}@{to_step}")
    assert second.returncode == 0, second.stderr[-2000:]
    final = step_dir(spec.total_steps)
    assert_states_equal(Path(spec.storage) / final, ref / "store" / final)
    # the quarantined steps were trained again, and saved again over their evidence
    listed = Catalog(open_storage(spec.storage)).list()
    assert all(listed[s].committed for s in rollback["quarantined"]), rollback
