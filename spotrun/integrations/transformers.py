"""`SpotrunCallback` for a Transformers `Trainer`: the one line an HF script adds to run on spot machines.

    trainer = Trainer(..., callbacks=[SpotrunCallback()])
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))  # as HF's examples do

The job file runs the script as a `command:` with `--output_dir {checkpoint_dir}`: spotrun restores the
newest *valid* checkpoint there before the start (HF's own choice is the largest number, valid or not),
publishes each `checkpoint-N/` the Trainer saves (manifest, digests, upload, `latest` once confirmed,
retention), and forwards a notice. This callback does the script's half:
- at a notice (the notice file, or the stop signal it catches instead of dying), it sets
  `control.should_save` and `control.should_training_stop` at the next step end, so the Trainer saves
  that step and stops: no step is lost; `train()` then ends with SystemExit(75), and spotrun publishes
  the save before the worker exits as preempted;
- it reports each step's number, and the logged losses (HF logs a mean every `logging_steps`; never a
  per-step loss) for MLflow, exactly once, and for the resume-fidelity check at the replayed logging steps;
- it refuses settings that contradict the job file (max_steps vs total_steps, output_dir vs
  {checkpoint_dir}) in one line, and warns when the script also logs to MLflow itself (twice).

Outside spotrun (no SPOTRUN_* environment) it does nothing: the same script runs anywhere.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from spotrun.trainer.command.layouts import find
from spotrun.trainer.command.link import CommandLink
from spotrun.trainer.exitcodes import ExitCode

log = logging.getLogger(__name__)

__all__ = ["SpotrunCallback"]


class SpotrunCallback(TrainerCallback):  # type: ignore[misc]  # transformers is not type-checked here
    """Checkpoints, notices and metrics of a Transformers Trainer, through the spotrun job that runs it."""

    def __init__(self) -> None:
        self.link = CommandLink.from_env()
        self._stopping = False
        self._evaluating = False  # between an evaluation's first batch and on_evaluate
        self._last_log = 0  # the step this process last logged at (or resumed from): the start of HF's mean
        if self.link is not None:
            self.link.catch_stop_signal()

    @property
    def resume_from(self) -> str | None:
        """The restored checkpoint to hand to `train(resume_from_checkpoint=...)`: the newest
        `checkpoint-N` under {checkpoint_dir} (found as the publisher finds them), None on a first
        start (where `=True` would raise)."""
        if self.link is None:
            return None
        found = [f for f in find(self.link.checkpoint_dir) if f.layout == "transformers"]
        return str(self.link.checkpoint_dir / found[-1].files[0].partition("/")[0]) if found else None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.link is None:
            return
        self._last_log = state.global_step
        out = Path(args.output_dir).resolve()
        if out != self.link.checkpoint_dir.resolve():
            raise SystemExit(
                f"spotrun: output_dir is {out}, but the job's checkpoints are in {self.link.checkpoint_dir}; "
                "pass --output_dir {checkpoint_dir} in the job file's command"
            )
        total = self.link.total_steps
        if args.max_steps and args.max_steps > 0 and total is not None and args.max_steps != total:
            raise SystemExit(
                f"spotrun: max_steps is {args.max_steps}, but the job file says total_steps: {total}; "
                "set the two equal (or pass --max_steps {total_steps} in the command)"
            )
        if "mlflow" in (args.report_to or []) and os.environ.get("MLFLOW_TRACKING_URI") is None:
            log.warning("report_to includes mlflow: spotrun sends the losses to MLflow already, once each")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.link is None:
            return
        self.link.report(state.global_step)
        if self.link.stop_requested and not self._stopping:
            self._stopping = True
            control.should_save = True
            control.should_training_stop = True
            log.info("spotrun: notice %s: saving step %d and stopping", self.link.notice(), state.global_step)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if self.link is None or not logs or "loss" not in logs:
            return
        extra = {k: v for k, v in logs.items() if k not in ("loss", "learning_rate", "epoch", "step")}
        lr = logs.get("learning_rate")
        whole = _logs_at(self._last_log, args=args, state=state)
        self._last_log = state.global_step
        self.link.report(state.global_step, float(logs["loss"]), lr=lr, compare=whole, **extra)

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.link is not None and not self._evaluating:  # an evaluation began: no hung step
            self._evaluating = True
            self.link.section("eval", begin=True, step=state.global_step)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.link is not None and self._evaluating:
            self._evaluating = False
            self.link.section("eval", begin=False, step=state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stopping:  # the save of the stop step is on disk: spotrun publishes it, then exits preempted
            raise SystemExit(int(ExitCode.PREEMPTED))


def _logs_at(step: int, *, args: Any, state: Any) -> bool:
    """Whether an uninterrupted run logs at `step` (or starts there): then the mean HF logs next covers
    the same steps it would without the resume, and another attempt's value for it is comparable. A
    resume from a notice's save between two logging steps cuts the first window short."""
    if args.logging_strategy != "steps":  # an epoch's mean: whole only from a run's first step
        return step == 0
    every = state.logging_steps
    return step == 0 or (every > 0 and step % every == 0) or (step == 1 and args.logging_first_step)
