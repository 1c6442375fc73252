"""Stop requests: SIGTERM and cloud interruption notices end in the same place, a flag the
training loop reads at the next step boundary (a handler that checkpoints itself would run in
the middle of a step, with the optimizer half-applied)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

log = logging.getLogger(__name__)


class StopRequest:
    """Thread-safe: notice watchers run in threads, SIGTERM in the main thread's handler."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None
        self.received_at: float | None = None
        self.deadline: float | None = None  # epoch seconds the machine goes away, when a notice says

    def notice(self, reason: str, deadline: float | None = None) -> None:
        """Ask the loop to checkpoint and stop; the first reason wins, the earliest deadline wins."""
        if not self._event.is_set():
            self.reason, self.received_at = reason, time.time()
            self._event.set()
        if deadline is not None and (self.deadline is None or deadline < self.deadline):
            self.deadline = deadline

    @property
    def requested(self) -> bool:
        return self._event.is_set()


def install_signal_handlers(stop: StopRequest) -> None:
    """SIGTERM (spot notices, `kill`, Kubernetes) and SIGINT both become a stop request."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        stop.notice(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
