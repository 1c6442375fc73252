"""The replacement started at a notice: provisioned once, in a thread, used or released."""

from __future__ import annotations

import threading
import time

from spotrun.tasks.control.prewarm import PREWARM_WAIT_S, Prewarm
from spotrun.tasks.providers.base import ProvisionError, Worker


class Released:
    name, prewarm = "fake", True

    def __init__(self) -> None:
        self.ids: list[str] = []

    def release(self, worker: Worker) -> None:
        self.ids.append(worker.id)


def test_started_once_with_the_arguments_of_the_moment() -> None:
    calls: list[list[str]] = []
    gate = threading.Event()

    def provision(extra: list[str]) -> Worker:
        calls.append(extra)
        gate.wait(5)
        return Worker("w2", "fake", 2, time.time())

    p = Prewarm(provision)
    assert not p.started and p.take() is None
    p.start(lambda: ["--mtbf-s", "300"])
    p.start(lambda: ["--mtbf-s", "999"])  # a second notice record: nothing more
    gate.set()
    worker = p.take()
    assert worker is not None and worker.id == "w2"
    assert calls == [["--mtbf-s", "300", "--prewarm-wait", "180"]]


def test_a_failed_prewarm_leaves_a_cold_start_and_an_unused_one_is_released() -> None:
    def fails(extra: list[str]) -> Worker:
        raise ProvisionError("no capacity", retryable=True)

    p = Prewarm(fails)
    p.start(list)
    assert p.take() is None  # the next attempt provisions as usual

    provider = Released()
    q = Prewarm(lambda extra: Worker("w3", "fake", 3, time.time()))
    q.start(list)
    q.discard(provider)  # type: ignore[arg-type]
    assert provider.ids == ["w3"]


def test_started_at_a_rebalance_it_stands_by_then_is_released_unless_a_notice_keeps_it() -> None:
    """stand_by_s just over PREWARM_WAIT_S: released 0.05 s after the start, with no notice."""
    released = Released()
    calls: list[list[str]] = []

    def provision(extra: list[str]) -> Worker:
        calls.append(extra)
        return Worker(f"w{len(calls)}", "fake", 2, time.time())

    p = Prewarm(provision, released.release)
    p.start(list, stand_by_s=PREWARM_WAIT_S + 0.05)
    assert calls == [["--prewarm-wait", f"{PREWARM_WAIT_S + 0.05:g}"]]
    deadline = time.monotonic() + 5
    while p.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert released.ids == ["w1"] and not p.started and p.take() is None
    # a notice after the window: a fresh replacement, the notice's own wait, kept
    p.start(list)
    p.start(list, stand_by_s=PREWARM_WAIT_S + 0.05)  # a late recommendation changes nothing
    time.sleep(0.1)
    worker = p.take()
    assert worker is not None and worker.id == "w2" and released.ids == ["w1"]

    q = Prewarm(provision, released.release)
    q.start(list, stand_by_s=PREWARM_WAIT_S + 0.05)
    q.start(list)  # the notice within the window: this one is needed
    time.sleep(0.1)
    assert q.started and released.ids == ["w1"]
    kept = q.take()
    assert kept is not None and kept.id == "w3"
