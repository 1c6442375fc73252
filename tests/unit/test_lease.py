"""The storage lease: who may take it (a table), and acquire/renew/fence/release on a local directory."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from spotrun.trainer.errors import ConfigError, LeaseHeld, LeaseLost
from spotrun.trainer.preemption.lease import (
    LEASE_KEY,
    FencedStorage,
    Holder,
    Lease,
    LeaseDoc,
    LeaseView,
    decide_takeover,
    needs_lease,
    new_epoch,
    next_fence,
    read_lease,
)
from spotrun.trainer.storage import LocalStorage, get_bytes, put_bytes
from spotrun.trainer.storage.base import local_dir_name

NS, OTHER_NS = "boot-a:pid:[1]", "boot-b:pid:[1]"
ME = Holder("w-me", "run-2", "host-a", pid=200, pid_ns=NS)
URI = "s3://bkt/job"


def doc(holder: Holder, released: bool = False, token: int = 3) -> LeaseDoc:
    return LeaseDoc(
        holder,
        token,
        900.0,
        renewed_at=1000.0,
        expires_at=1030.0,
        ttl_s=30.0,
        released=released,
        epoch="0000000900-ab",
    )


def h(worker: str = "w-old", host: str = "host-a", pid: int = 100, ns: str = NS) -> Holder:
    return Holder(worker, "run-1", host, pid=pid, pid_ns=ns)


ALIVE, DEAD = (lambda pid: True), (lambda pid: False)

TAKEOVER_TABLE = [
    # (lease, its age by the store's clock, released ids, pid alive?, take?, reason contains)
    (None, 0.0, (), ALIVE, True, "no lease"),
    (doc(h(host="host-b", ns=OTHER_NS)), 31.0, (), ALIVE, True, "expired 0 s ago by the store's clock"),
    (doc(h(host="host-b", ns=OTHER_NS)), 95.0, (), ALIVE, True, "expired 64 s ago"),
    # ttl 30 plus the store clock's 1 s granularity: not yet, whatever the holder's own dates say
    (doc(h(host="host-b", ns=OTHER_NS)), 30.5, (), ALIVE, False, "(in 0 s)"),
    (doc(h(host="host-b", ns=OTHER_NS)), 0.0, (), ALIVE, False, "(in 31 s)"),
    (doc(h(), released=True), 0.0, (), ALIVE, True, "released by w-old"),
    (doc(h(pid=100)), 0.0, (), DEAD, True, "is gone"),  # same machine, SIGKILLed: at once
    (doc(h(pid=100)), 0.0, (), ALIVE, False, "held by worker w-old"),  # same machine, alive
    (doc(h(host="host-b", ns=OTHER_NS)), 0.0, (), DEAD, False, "host host-b"),  # elsewhere: pids mean nothing
    (doc(h(host="host-b", ns=OTHER_NS)), 0.0, ("w-old",), ALIVE, True, "released by the controller"),
    (doc(h(pid=100)), 0.0, ("w-old",), ALIVE, True, "released by the controller"),
    (doc(h(worker="w-other", host="host-b", ns=OTHER_NS)), 0.0, ("w-old",), ALIVE, False, "w-other"),
    (doc(ME), 0.0, (), ALIVE, True, "this process"),
    (doc(h(worker="w-me", host="host-b", ns=OTHER_NS)), 0.0, (), ALIVE, True, "earlier trainer of this"),
    (doc(h(worker="w-me", pid=150)), 0.0, (), ALIVE, False, "held by worker w-me"),  # a 2nd trainer here
    (doc(h(ns="")), 0.0, (), DEAD, False, "held by"),  # unknown namespace: never trust a pid as dead
]


@pytest.mark.parametrize("current,age,released,alive,take,reason", TAKEOVER_TABLE)
def test_takeover_table(
    current: LeaseDoc | None, age: float, released: tuple[str, ...], alive: object, take: bool, reason: str
) -> None:
    verdict = decide_takeover(current, ME, age, released=released, pid_alive=alive, uri=URI, now=1000.0)  # type: ignore[arg-type]
    assert (verdict.take, reason in verdict.reason) == (take, True), verdict.reason


def test_refusal_is_one_line_naming_holder_and_expiry() -> None:
    verdict = decide_takeover(
        doc(h(host="host-b", ns=OTHER_NS)), ME, 11.0, released=(), pid_alive=ALIVE, uri=URI, now=1000.0
    )
    assert verdict.reason == (
        "storage s3://bkt/job is held by worker w-old (flow run run-1, host host-b, pid 100) until "
        "1970-01-01 00:17:00 UTC (in 20 s); stop that run or wait for the lease to expire"
    )


def test_lease_doc_round_trip_and_garbage() -> None:
    d = doc(ME)
    assert LeaseDoc.from_json(d.to_json()) == d
    legacy = {k: v for k, v in json.loads(d.to_json()).items() if k not in ("epoch", "mono_expires_at")}
    assert LeaseDoc.from_json(json.dumps(legacy).encode()).fence == ("", 3)  # written before epochs
    for bad in (b"[]", b'{"token": 1}', b'{"holder": 3}', d.to_json().replace(b'"token":3', b'"token":"3"')):
        with pytest.raises(ValueError):
            LeaseDoc.from_json(bad)


class Clock:
    """A clock the test moves: the holder's monotonic clock, or a wall clock set off by a skew."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def other(pid: int = 4_000_000) -> Holder:
    return Holder("w-other", "run-9", "host-b", pid=pid, pid_ns=OTHER_NS)


def age(store_dir: Path, seconds: float) -> None:
    """Make the store's clock say the lease object was written `seconds` ago (its mtime, set back)."""
    t = time.time() - seconds
    os.utime(store_dir / LEASE_KEY, (t, t))


def test_acquire_refuses_live_holder_until_expiry_by_the_stores_clock(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    first = Lease.acquire(store, other(), ttl_s=30, clock=Clock())
    with pytest.raises(LeaseHeld, match=r"held by worker w-other .* until .* \(in 31 s\)"):
        Lease.acquire(store, ME, ttl_s=30)
    age(tmp_path, 30.7)  # past the TTL, not past the store clock's granularity (0.3 s left: rounds to 0)
    with pytest.raises(LeaseHeld, match=r"\(in 0 s\)"):
        Lease.acquire(store, ME, ttl_s=30)
    age(tmp_path, 31.5)
    second = Lease.acquire(store, ME, ttl_s=30)
    assert second.doc.fence == (first.doc.epoch, 2)
    first.renew()  # finds the new holder's token
    with pytest.raises(LeaseLost, match="taken over by worker w-me"):
        first.check()


# The holder's own clock (`wall`) off by a minute either way, the taker's the other way; the store's
# clock says how long ago the last renewal landed, the holder's monotonic clock how long ago it sent
# it (the same here: the closest the two can be). ttl 30: the holder stops writing at 27 (a tenth as
# a margin), a taker may take from 31 (the store's 1 s granularity): never both.
SKEW_TABLE = [
    # (seconds since the renewal, the holder may write, a taker may take)
    (0.0, True, False),
    (15.0, True, False),
    (26.9, True, False),
    (27.0, False, False),
    (30.0, False, False),
    (31.5, False, True),
    (90.0, False, True),
]


@pytest.mark.parametrize("skew", [-60.0, 60.0])
@pytest.mark.parametrize(("elapsed", "writes", "taken"), SKEW_TABLE)
def test_a_skewed_holder_never_overlaps_another_writer(
    tmp_path: Path, skew: float, elapsed: float, writes: bool, taken: bool
) -> None:
    store, mono = LocalStorage(tmp_path), Clock(500.0)
    holder = Lease.acquire(store, other(), ttl_s=30, clock=mono, wall=lambda: time.time() + skew)
    mono.t += elapsed
    age(tmp_path, elapsed)
    try:
        holder.check()
    except LeaseLost:
        wrote = False
    else:
        wrote = True
    try:
        Lease.acquire(store, ME, ttl_s=30, wall=lambda: time.time() - skew)
    except LeaseHeld:
        took = False
    else:
        took = True
    assert (wrote, took) == (writes, taken)
    assert not (wrote and took)


def test_renew_extends_and_check_fails_once_unrenewed(tmp_path: Path) -> None:
    store, clock, wall = LocalStorage(tmp_path), Clock(), Clock(5000.0)
    lease = Lease.acquire(store, ME, ttl_s=30, clock=clock, wall=wall)
    clock.t += 20
    wall.t -= 3600  # the wall clock stepped back an hour: nothing that decides reads it
    lease.renew()
    renewed = read_lease(store)[0]
    assert renewed is not None and (renewed.mono_expires_at, renewed.expires_at) == (1050.0, 1430.0)
    clock.t += 26.9
    lease.check()
    clock.t += 0.2  # 2.9 s left: inside the safety margin (ttl / 10 = 3 s)
    with pytest.raises(LeaseLost, match="ran out") as e:
        lease.check()
    assert e.value.taken_by is None


def test_renew_recognises_its_own_write_after_a_lost_reply(tmp_path: Path) -> None:
    store, clock, wall = LocalStorage(tmp_path), Clock(), Clock()
    lease = Lease.acquire(store, ME, ttl_s=30, clock=clock, wall=wall)
    clock.t += 10
    wall.t += 10
    landed = dataclasses.replace(lease.doc, renewed_at=1010.0, expires_at=1040.0, mono_expires_at=1040.0)
    store.put_if(LEASE_KEY, landed.to_json(), if_version=lease.version)  # the first try landed...
    lease.renew()  # ...and the retry gets a precondition failure
    lease.check(remote=True)
    assert lease.valid_until == 1040.0


def test_release_lets_the_next_holder_in_at_once_and_keeps_the_token(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    first = Lease.acquire(store, other(), ttl_s=30)
    first.release()
    nxt = Lease.acquire(store, ME, ttl_s=30)
    assert nxt.doc.fence == (first.doc.epoch, 2)


def test_released_worker_is_taken_over_at_once(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    old = Lease.acquire(store, other(), ttl_s=30)
    Lease.acquire(store, ME, ttl_s=30, released=["w-other"])
    with pytest.raises(LeaseLost):
        old.check(remote=True)


DAMAGE = {
    "deleted": lambda store: store.delete([LEASE_KEY]),
    "malformed": lambda store: put_bytes(store, LEASE_KEY, b"{not json"),
    "not a lease": lambda store: put_bytes(store, LEASE_KEY, b'{"token": 1}'),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_deleted_or_malformed_lease_never_restarts_the_token(tmp_path: Path, damage: str) -> None:
    store = LocalStorage(tmp_path)
    first = Lease.acquire(store, other(), ttl_s=30)
    first.release()
    holder = Lease.acquire(store, other(pid=4_000_001), ttl_s=30)  # token 2: still writing
    DAMAGE[damage](store)
    taker = Lease.acquire(store, ME, ttl_s=30)  # nothing to read: a new epoch, its counter at 1
    issued = {first.doc.fence, holder.doc.fence}
    assert taker.doc.fence not in issued and taker.doc.fence > max(issued)
    with pytest.raises(LeaseLost, match="taken over by worker w-me"):  # not fooled by an equal number
        holder.check(remote=True)
    again = Lease.acquire(store, other(), ttl_s=30, released=["w-me"])
    assert again.doc.fence == (taker.doc.epoch, 2)


def test_epochs_are_distinct_and_follow_the_newest_seen() -> None:
    assert new_epoch(1000.0) != new_epoch(1000.0)
    assert new_epoch(1000.0).startswith("0000001000-")
    assert new_epoch(1000.0, seen="0000002000-ab").startswith("0000002001-")  # a clock behind
    assert next_fence(doc(ME), 0.0) == ("0000000900-ab", 4)


def test_writer_view_follows_the_holders_monotonic_deadline(tmp_path: Path) -> None:
    store, clock = LocalStorage(tmp_path), Clock()
    lease = Lease.acquire(store, ME, ttl_s=30, clock=clock)
    view = LeaseView(store, lease.doc.fence, clock=clock)
    clock.t += 26.9
    view.check()
    clock.t += 0.2
    with pytest.raises(LeaseLost, match="ran out"):
        view.check()
    lease.renew()
    view.check()
    with pytest.raises(LeaseLost, match="taken over"):
        LeaseView(store, (lease.doc.epoch, 1 + lease.doc.token), clock=clock).check()


def test_ttl_too_short_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--lease-ttl 1: use at least 3 seconds"):
        Lease.acquire(LocalStorage(tmp_path), ME, ttl_s=1)


def test_fenced_storage_refuses_writes_once_lost_but_still_reads(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    lease = Lease.acquire(store, ME, ttl_s=30)
    fenced = FencedStorage(store, lease)
    put_bytes(fenced, "step_000000007/model.bin", b"m")
    # the thief writes a higher token; the next commit point re-reads the lease and stops
    stolen = dataclasses.replace(lease.doc, holder=other(), token=lease.doc.token + 1)
    store.put_if(LEASE_KEY, stolen.to_json(), if_version=lease.version)
    put_bytes(fenced, "step_000000014/model.bin", b"m")  # a data file: checked by the local clock only
    with pytest.raises(LeaseLost, match="taken over by worker w-other"):
        put_bytes(fenced, "step_000000014/manifest.json", b"{}")
    for write in (lambda: fenced.delete(["x"]), lambda: put_bytes(fenced, "latest", b"{}")):
        with pytest.raises(LeaseLost):
            write()
    assert get_bytes(fenced, "step_000000007/model.bin") == b"m"
    assert not (tmp_path / "step_000000014" / "manifest.json").exists()
    lease.release()  # lost: gives nothing back, overwrites nothing
    assert read_lease(store)[0] == stolen


def test_local_dir_name_keys_by_storage() -> None:
    a, b = local_dir_name("job", "/data/a"), local_dir_name("job", "/data/b")
    assert a != b and a.startswith("job-") and len(a) == len("job-") + 8
    assert local_dir_name("job", "file:///data/a") == a
    assert local_dir_name("job", "s3://bkt/p/") == local_dir_name("job", "s3://bkt/p")


def test_renewal_thread_renews_until_released(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    lease = Lease.acquire(store, ME, ttl_s=3).start()  # renews every second
    first = lease.doc.renewed_at
    deadline = time.monotonic() + 60
    while read_lease(store)[0].renewed_at == first:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "never renewed"
        time.sleep(0.05)
    lease.check(remote=True)
    lease.release()
    assert read_lease(store)[0].released  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("key", "needs"),
    [
        ("step_000000007/manifest.json", True),
        ("step_000000007/model.safetensors", True),
        ("latest", True),
        ("COMPLETED.json", True),
        (LEASE_KEY, False),
        ("_lease.json.probe-0123abcd", False),  # the conditional-put probe (S3)
        ("_handoff.json", False),  # the controller's
        ("_standby.json", False),  # a replacement's, written while it waits for the lease
        ("_workers/i-0abc/heartbeat.json", False),
    ],
)
def test_what_only_the_holder_writes(key: str, needs: bool) -> None:
    assert needs_lease(key) == needs
