"""Per-step metrics, published to the job's storage once a checkpoint covers them: exactly once per step.

The loop records each step's loss, learning rate and speed here. When the checkpoint at step S becomes
durable (the checkpointer's `on_durable`, after `latest` moved), the buffered steps <= S are written as
one object, `metrics/step_<S:09d>.jsonl`, and dropped from the buffer. Steps an attempt computed after
its last durable checkpoint are never written: a reclaim loses them, and the resumed attempt computes
them again and writes them then. So every step is written once, by the attempt whose work survived, and
the history equals an uninterrupted run's. The controller sends these objects to MLflow
(tasks/tracking/); this module never imports MLflow (3-4 s) and never blocks the loop on storage.

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
from typing import Any

from trainer.storage import Storage, put_bytes

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
    the first, or a caller that wants none): records nothing. Thread-safe: `record` runs in the loop,
    `publish` in the checkpoint writer thread (or the loop, for a synchronous save)."""

    def __init__(self, storage: Storage | None) -> None:
        self.storage = storage
        self._buf: list[dict[str, Any]] = []
        self._times: deque[float] = deque(maxlen=SPEED_WINDOW + 1)
        self._lr_next: dict[int, float] = {}  # step -> the rate set after it (kept for the buffered steps)
        self._lock = threading.Lock()
        self._warned = False

    def record(self, step: int, loss: float, lr: float, lr_next: float) -> None:
        """Step `step` trained at rate `lr` and got `loss`; the scheduler then set `lr_next`."""
        if self.storage is None:
            return
        now = time.time()
        self._times.append(now)
        entry: dict[str, Any] = {
            "step": step,
            "t": round(now, 3),
            "loss": float(loss).hex(),
            "lr": float(lr).hex(),
        }
        if len(self._times) > 1:
            entry["sps"] = round((len(self._times) - 1) / max(now - self._times[0], 1e-9), 3)
        with self._lock:
            self._buf.append(entry)
            self._lr_next[step] = float(lr_next)

    def publish(self, durable: int) -> None:
        """The checkpoint at `durable` is durable: write the buffered steps up to it as one object. A
        failed write keeps them for the next checkpoint's object; it never fails the checkpoint."""
        if self.storage is None:
            return
        with self._lock:
            due = [e for e in self._buf if e["step"] <= durable]
            if not due:
                return
            last = dict(due[-1])
            if last["step"] == durable and durable in self._lr_next:
                last["lr_next"] = self._lr_next[durable].hex()
            body = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in [*due[:-1], last])
        try:
            put_bytes(self.storage, metrics_key(durable), body.encode())
        except Exception as e:  # storage or lease: the checkpoint stands; retried with the next one
            if not self._warned:
                log.warning(
                    "per-step metrics up to step %d not written (%s); retried with the next checkpoint",
                    durable, e,
                )  # fmt: skip
                self._warned = True
            return
        with self._lock:
            self._buf = [e for e in self._buf if e["step"] > durable]
            self._lr_next = {s: v for s, v in self._lr_next.items() if s > durable}
