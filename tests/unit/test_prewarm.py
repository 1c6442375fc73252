"""The replacement started at a notice: provisioned once, in a thread, used or released."""

from __future__ import annotations

import threading
import time

from tasks.control.prewarm import Prewarm
from tasks.providers.base import ProvisionError, Worker


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
