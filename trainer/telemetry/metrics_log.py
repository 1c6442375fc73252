"""Per-step metrics, published to the job's storage once a checkpoint covers them: exactly once per step.

The loop records each step's loss, learning rate and speed here. A checkpoint at step S carries the
buffered steps <= S as one object, `metrics/step_<S:09d>.jsonl`, which its writer stores before the
manifest (a sidecar, trainer/saving/checkpointer.py): a committed checkpoint always has its metrics, even when
the trainer is killed the moment after. Once the checkpoint is durable the steps leave the buffer. An
object whose checkpoint never committed (killed between the two writes, or rejected later) is deleted
by the next attempt, which resumes from an earlier step and computes those steps again (`prune_after`),
and the controller sends only steps that a committed checkpoint covers (tasks/tracking/). So every step
is sent once, as computed by the attempt whose work survived, and the history equals an uninterrupted
run's. This module never imports MLflow (3-4 s) and never blocks the loop on storage.

One JSON object per line, oldest step first:
    {"step": 120, "t": 1767225600.123, "loss": "0x1.2e5p-2", "lr": "0x1.0624dd2f1a9fcp-10", "sps": 412.5}
`loss` and `lr` are float.hex, so comparisons are bitwise; `t` is the step's wall time (epoch seconds);
`sps` is steps per second over the last SPEED_WINDOW steps (absent for an attempt's first step). The
object's last line also has `lr_next`: the rate the scheduler set for step S+1, which a resume from S must
reproduce (the resume-fidelity check with a notice, docs/tracking.md).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from spotrun.trainer.storage import Storage

log = logging.getLogger(__name__)

PREFIX = "metrics/"
SPEED_WINDOW = 20  # steps: long enough to smooth one step's jitter, short enough to show a slowdown


def metrics_key(step: int) -> str:
    return f"{PREFIX}step_{step:09d}.jsonl"


def parse_metrics_key(key: str) -> int | None:
    """The durable step a metrics object covers up to; None for any other key."""
    name = key.removeprefix(PREFIX)
    if name == key or not name.startswith("step_") or not name.endswith(".jsonl"):
        return None
    digits = name[len("step_") : -len(".jsonl")]
    return int(digits) if digits.isdigit() else None


class MetricsLog:
    """Buffer of this attempt's steps not yet covered by a durable checkpoint. `storage` None (ranks but
    the first, or a caller that wants none): records nothing. Thread-safe: `record` and `sidecars` run in
    the loop, `written` in the checkpoint writer thread (or the loop, for a synchronous save)."""

    def __init__(self, storage: Storage | None) -> None:
        self.storage = storage
        self._buf: list[dict[str, Any]] = []
        self._times: deque[float] = deque(maxlen=SPEED_WINDOW + 1)
        self._lr_next: dict[int, float] = {}  # step -> the rate set after it (kept for the buffered steps)
        self._lock = threading.Lock()

    def record(
        self,
        step: int,
        loss: float,
        lr: float | None,
        lr_next: float | None,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Step `step` trained at rate `lr` and got `loss`; the scheduler then set `lr_next`. `metrics`:
        the loop's own at this step (`s.step_done(loss, eval_loss=...)`), sent to MLflow once as well.
        None: not known (a command's script reports the rate a step used, never the next one)."""
        if self.storage is None:
            return
        now = time.time()
        self._times.append(now)
        entry: dict[str, Any] = {
            "step": step,
            "t": round(now, 3),
            "loss": float(loss).hex(),
        }
        if lr is not None:
            entry["lr"] = float(lr).hex()
        if metrics:
            entry["m"] = {str(k): float(v).hex() for k, v in metrics.items()}
        if len(self._times) > 1:
            entry["sps"] = round((len(self._times) - 1) / max(now - self._times[0], 1e-9), 3)
        with self._lock:
            self._buf.append(entry)
            if lr_next is not None:
                self._lr_next[step] = float(lr_next)

    def sidecars(self, step: int) -> dict[str, bytes]:
        """The object for a checkpoint at `step`: the buffered steps up to it, for the checkpointer to
        write before the checkpoint's manifest (checkpointer.put_sidecars). Nothing is dropped here:
        that waits until the checkpoint is durable (`written`)."""
        if self.storage is None:
            return {}
        with self._lock:
            due = [e for e in self._buf if e["step"] <= step]
            if not due:
                return {}
            last = dict(due[-1])
            if last["step"] == step and step in self._lr_next:
                last["lr_next"] = self._lr_next[step].hex()
        body = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in [*due[:-1], last])
        return {metrics_key(step): body.encode()}

    def written(self, durable: int, sidecars_written: bool = True) -> None:
        """The checkpoint at `durable` is durable. With its sidecars written, the steps up to it are
        stored and leave the buffer; otherwise they stay, and the next checkpoint's object has them."""
        if not sidecars_written:
            return
        with self._lock:
            self._buf = [e for e in self._buf if e["step"] > durable]
            self._lr_next = {s: v for s, v in self._lr_next.items() if s > durable}


def prune_after(storage: Storage, step: int) -> list[str]:
    """Delete the metrics objects past `step`, the step an attempt resumes from: they were written with
    checkpoints that never committed or were rejected (a lost future), and the attempt computes those
    steps again. The controller sends only steps a committed checkpoint covers, so none of these was
    sent unless its checkpoint had committed, and then with the values the attempt recomputes."""
    stale = [o.key for o in storage.list(PREFIX) if (s := parse_metrics_key(o.key)) is not None and s > step]
    if stale:
        storage.delete(stale)
        log.info("deleted %d metrics object(s) past step %d (those steps train again)", len(stale), step)
    return stale
