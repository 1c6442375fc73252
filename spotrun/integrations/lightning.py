"""`SpotrunCallback` for a Lightning `Trainer`: the one line a Lightning script adds to run on spot machines.

    cb = SpotrunCallback()
    trainer = L.Trainer(..., callbacks=[ModelCheckpoint(dirpath=out, ...), cb])
    trainer.fit(model, data, ckpt_path=cb.resume_from)

The job file runs the script as a `command:` that passes `{checkpoint_dir}` as the ModelCheckpoint's
`dirpath`: spotrun restores the newest *valid* `.ckpt` there before the start, publishes each one
Lightning writes, and forwards a notice. This callback does the script's half:
- at a notice (the notice file, or the stop signal it catches instead of dying) it saves the step just
  trained as `spotrun-step=N.ckpt` (written whole, then renamed into place) and stops the Trainer: no step
  is lost; `fit()` then ends with SystemExit(75), and spotrun publishes the save before the worker exits
  as preempted;
- it keeps the RNG states (Python, numpy, torch, CUDA) in every checkpoint, in types a weights-only load
  rebuilds (Lightning loads a local `ckpt_path` weights-only), and puts them back when `fit()` starts,
  before the Trainer makes its first data iterator, which Lightning itself does not: a resume at an
  epoch boundary shuffles and drops out what the uninterrupted run did (bitwise; a plain DataLoader
  resumed mid-epoch starts that epoch's order anew: docs/integrations.md);
- it reports each step's number and loss (a training step's returned loss: every step, not a mean) for
  MLflow, exactly once, and for the resume-fidelity check;
- it refuses a `max_steps` that differs from the job's `total_steps` in one line.

Outside spotrun (no SPOTRUN_* environment) it does nothing.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import lightning as L
import numpy as np
import torch

from spotrun.trainer.command.layouts import find
from spotrun.trainer.command.link import CommandLink
from spotrun.trainer.exitcodes import ExitCode

log = logging.getLogger(__name__)

__all__ = ["SpotrunCallback"]
RNG_KEY = "spotrun_rng"


class SpotrunCallback(L.Callback):  # type: ignore[misc]  # lightning is not type-checked here
    """Checkpoints, notices and metrics of a Lightning Trainer, through the spotrun job that runs it."""

    def __init__(self) -> None:
        self.link = CommandLink.from_env()
        self._stopping = False
        self._rng: dict[str, Any] | None = None
        self._fit_started = False
        if self.link is not None:
            self.link.catch_stop_signal()

    @property
    def resume_from(self) -> str | None:
        """The restored checkpoint for `fit(ckpt_path=...)`: the newest `.ckpt` with `step=N` in its name
        under {checkpoint_dir}; None on a first start."""
        if self.link is None:
            return None
        found = [f for f in find(self.link.checkpoint_dir) if f.layout == "lightning"]
        return str(self.link.checkpoint_dir / found[-1].files[0]) if found else None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._fit_started = True
        if self._rng is not None:  # the checkpoint's RNG, before the Trainer makes its first data iterator
            _set_rng(self._rng)
            self._rng = None
        if self.link is None:
            return
        total = self.link.total_steps
        if trainer.max_steps and trainer.max_steps > 0 and total is not None and trainer.max_steps != total:
            raise SystemExit(
                f"spotrun: max_steps is {trainer.max_steps}, but the job file says total_steps: {total}; "
                "set the two equal"
            )

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.link is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else None
        self.link.report(trainer.global_step, value, lr=_lr(trainer))
        if self.link.stop_requested and not self._stopping:
            self._stopping = True
            path = self.link.checkpoint_dir / f"spotrun-step={trainer.global_step}.ckpt"
            tmp = path.with_name(f".{path.name}.tmp")
            trainer.save_checkpoint(tmp)
            os.replace(tmp, path)
            trainer.should_stop = True
            log.info("spotrun: notice %s: saved step %d, stopping", self.link.notice(), trainer.global_step)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint[RNG_KEY] = _get_rng()

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(RNG_KEY)
        if state is not None and self._fit_started:  # a strategy that restores after set-up (FSDP, DeepSpeed)
            _set_rng(state)
        else:
            self._rng = state

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.link is not None:  # an evaluation is no hung step (the controller's watchdog)
            self.link.section("eval", begin=True, step=trainer.global_step)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.link is not None:
            self.link.section("eval", begin=False, step=trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._stopping:  # the save of the stop step is on disk: spotrun publishes it, then exits preempted
            raise SystemExit(int(ExitCode.PREEMPTED))


def _lr(trainer: Any) -> float | None:
    try:
        return float(trainer.optimizers[0].param_groups[0]["lr"])
    except (IndexError, KeyError, AttributeError, TypeError):
        return None


def _get_rng() -> dict[str, Any]:
    """The RNG states in types a weights-only load rebuilds (Lightning loads a local `ckpt_path` with
    torch's default, `weights_only=True`): numpy's key array as a tensor, no numpy object."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng(state: dict[str, Any]) -> None:
    random.setstate(_python_state(state["python"]))
    n = state["numpy"]
    keys = np.asarray(n["keys"].numpy(), dtype=np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_state(s: Any) -> tuple[Any, ...]:
    """random.getstate()'s tuple, as a weights-only load gives it back (lists where tuples were)."""
    version, internal, gauss = s
    return (version, tuple(internal), gauss)
