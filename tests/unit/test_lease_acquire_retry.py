"""Lease.acquire rides out a storage that fails transiently at startup, for a bounded time.

A hand-written flaky storage (a local directory that raises TransientStorageError on scripted calls)
and a fake clock whose `sleep` advances it: no real waiting.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spotrun.trainer.errors import LeaseHeld, PreconditionFailed, TransientStorageError
from spotrun.trainer.preemption.lease import LEASE_KEY, Holder, Lease, read_lease
from spotrun.trainer.storage import LocalStorage
from spotrun.trainer.storage.base import Stamped

ME = Holder("w-me", "run-2", "host-a", pid=200, pid_ns="boot-a:pid:[1]")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


class FlakyStorage(LocalStorage):
    """Fails the first `reads` read_stamped calls (acquire's read) and the first `puts` put_if calls
    transiently; `land` makes a failing put_if write first (the request landed, its answer was lost)."""

    def __init__(self, root: Path, reads: int = 0, puts: int = 0, land: bool = False) -> None:
        super().__init__(root)
        self.reads, self.puts, self.land = reads, puts, land
        self.calls = 0

    def read_stamped(self, key: str) -> Stamped:
        self.calls += 1
        if self.reads > 0:
            self.reads -= 1
            raise TransientStorageError(f"{key}: 503 SlowDown, still failing after botocore's retries")
        return super().read_stamped(key)

    def put_if(self, key: str, data: bytes, *, if_version: str | None) -> str:
        if self.puts > 0:
            self.puts -= 1
            if self.land:
                super().put_if(key, data, if_version=if_version)
            raise TransientStorageError(f"{key}: connection reset")
        return super().put_if(key, data, if_version=if_version)


class RacingStorage(LocalStorage):
    """Every conditional put loses a race."""

    def put_if(self, key: str, data: bytes, *, if_version: str | None) -> str:
        raise PreconditionFailed(f"{key}: changed since it was read")


@pytest.mark.parametrize(
    ("reads", "puts", "land", "tries"),
    [
        (0, 0, False, 1),
        (1, 0, False, 2),  # the first read at startup failed once
        (6, 0, False, 7),  # more than botocore's and the storage layer's tries together
        (0, 1, False, 2),  # the put failed before it landed
        (0, 1, True, 2),  # the put landed, its answer lost: the re-read finds this process the holder
    ],
)
def test_acquire_retries_transient_failures(
    tmp_path: Path, reads: int, puts: int, land: bool, tries: int
) -> None:
    clock = FakeClock()
    store = FlakyStorage(tmp_path, reads=reads, puts=puts, land=land)
    lease = Lease.acquire(store, ME, ttl_s=30, clock=clock, sleep=clock.sleep)
    assert store.calls == tries
    current, _ = read_lease(store)
    assert current == lease.doc and current.holder == ME
    assert len(clock.sleeps) == reads + puts
    assert all(s > 0 for s in clock.sleeps)


def test_acquire_backs_off_and_gives_up_after_the_budget(tmp_path: Path) -> None:
    clock = FakeClock()
    store = FlakyStorage(tmp_path, reads=10_000)
    with pytest.raises(TransientStorageError):
        Lease.acquire(store, ME, ttl_s=30, clock=clock, sleep=clock.sleep)
    assert clock.now - 1000.0 == pytest.approx(30.0)  # one TTL by default, never longer
    assert max(clock.sleeps) <= 8.0
    assert clock.sleeps[:3] == sorted(clock.sleeps[:3])  # grows (each drawn from [b/2, b], b doubling)
    assert not (tmp_path / LEASE_KEY).exists()


def test_acquire_wait_budget_is_a_parameter(tmp_path: Path) -> None:
    clock = FakeClock()
    with pytest.raises(TransientStorageError):
        Lease.acquire(FlakyStorage(tmp_path, reads=10_000), ME, clock=clock, wait_s=0, sleep=clock.sleep)
    assert clock.sleeps == []


def test_acquire_lost_races_are_not_retried_as_transient(tmp_path: Path) -> None:
    clock = FakeClock()
    with pytest.raises(LeaseHeld, match="lost 5 races"):
        Lease.acquire(RacingStorage(tmp_path), ME, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == []
