"""The storage lease: who may take it (a table), and acquire/renew/fence/release on a local directory."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from trainer.errors import ConfigError, LeaseHeld, LeaseLost
from trainer.lease import (
    LEASE_KEY,
    FencedStorage,
    Holder,
    Lease,
    LeaseDoc,
    decide_takeover,
    read_lease,
)
from trainer.storage import LocalStorage, get_bytes, put_bytes
from trainer.storage.base import local_dir_name

NS, OTHER_NS = "boot-a:pid:[1]", "boot-b:pid:[1]"
ME = Holder("w-me", "run-2", "host-a", 200, NS)
URI = "s3://bkt/job"


def doc(holder: Holder, expires_at: float = 1100.0, released: bool = False, token: int = 3) -> LeaseDoc:
    return LeaseDoc(holder, token, 900.0, 1000.0, expires_at, 30.0, released)


def h(worker: str = "w-old", host: str = "host-a", pid: int = 100, ns: str = NS) -> Holder:
    return Holder(worker, "run-1", host, pid, ns)


ALIVE, DEAD = (lambda pid: True), (lambda pid: False)

TAKEOVER_TABLE = [
    # (lease, released ids, pid alive?, take?, reason contains)
    (None, (), ALIVE, True, "no lease"),
    (doc(h(), expires_at=999.0), (), ALIVE, True, "expired"),
    (doc(h(), expires_at=1000.0), (), ALIVE, True, "expired"),  # at the expiry instant: gone
    (doc(h(), released=True), (), ALIVE, True, "released by w-old"),
    (doc(h(pid=100)), (), DEAD, True, "is gone"),  # same machine, SIGKILLed: at once
    (doc(h(pid=100)), (), ALIVE, False, "held by worker w-old"),  # same machine, alive
    (doc(h(host="host-b", ns=OTHER_NS)), (), DEAD, False, "host host-b"),  # elsewhere: pids mean nothing
    (doc(h(host="host-b", ns=OTHER_NS)), ("w-old",), ALIVE, True, "released by the controller"),
    (doc(h(pid=100)), ("w-old",), ALIVE, True, "released by the controller"),
    (doc(h(worker="w-other", host="host-b", ns=OTHER_NS)), ("w-old",), ALIVE, False, "w-other"),
    (doc(ME), (), ALIVE, True, "this process"),
    (doc(h(worker="w-me", host="host-b", ns=OTHER_NS)), (), ALIVE, True, "earlier trainer of this worker"),
    (doc(h(worker="w-me", pid=150)), (), ALIVE, False, "held by worker w-me"),  # a 2nd trainer, same worker
    (doc(h(ns="")), (), DEAD, False, "held by"),  # unknown namespace: never trust a pid as dead
]


@pytest.mark.parametrize("current,released,alive,take,reason", TAKEOVER_TABLE)
def test_takeover_table(
    current: LeaseDoc | None, released: tuple[str, ...], alive: object, take: bool, reason: str
) -> None:
    verdict = decide_takeover(current, ME, 1000.0, released, alive, URI)  # type: ignore[arg-type]
    assert (verdict.take, reason in verdict.reason) == (take, True), verdict.reason


def test_refusal_is_one_line_naming_holder_and_expiry() -> None:
    verdict = decide_takeover(doc(h(host="host-b", ns=OTHER_NS)), ME, 1000.0, (), ALIVE, URI)
    assert verdict.reason == (
        "storage s3://bkt/job is held by worker w-old (flow run run-1, host host-b, pid 100) until "
        "1970-01-01 00:18:20 UTC (in 100 s); stop that run or wait for the lease to expire"
    )


def test_lease_doc_round_trip_and_garbage() -> None:
    d = doc(ME)
    assert LeaseDoc.from_json(d.to_json()) == d
    for bad in (b"[]", b'{"token": 1}', b'{"holder": 3}'):
        with pytest.raises(ValueError):
            LeaseDoc.from_json(bad)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def other(pid: int = 4_000_000) -> Holder:
    return Holder("w-other", "run-9", "host-b", pid, OTHER_NS)


def test_acquire_refuses_live_holder_until_expiry(tmp_path: Path) -> None:
    store, clock = LocalStorage(tmp_path), Clock()
    first = Lease.acquire(store, other(), ttl_s=30, clock=clock)
    with pytest.raises(LeaseHeld, match=r"held by worker w-other .* until .* \(in 30 s\)"):
        Lease.acquire(store, ME, ttl_s=30, clock=clock)
    clock.t += 30
    second = Lease.acquire(store, ME, ttl_s=30, clock=clock)
    assert second.doc.token == first.doc.token + 1 == 2
    first.renew()  # finds the new holder's token
    with pytest.raises(LeaseLost, match="taken over by worker w-me"):
        first.check()


def test_renew_extends_and_check_fails_once_unrenewed(tmp_path: Path) -> None:
    store, clock = LocalStorage(tmp_path), Clock()
    lease = Lease.acquire(store, ME, ttl_s=30, clock=clock)
    clock.t += 20
    lease.renew()
    assert read_lease(store)[0].expires_at == 1050.0  # type: ignore[union-attr]
    clock.t += 28  # 2 s left: inside the safety margin (ttl / 10 = 3 s)
    with pytest.raises(LeaseLost, match="ran out") as e:
        lease.check()
    assert e.value.taken_by is None


def test_renew_recognises_its_own_write_after_a_lost_reply(tmp_path: Path) -> None:
    store, clock = LocalStorage(tmp_path), Clock()
    lease = Lease.acquire(store, ME, ttl_s=30, clock=clock)
    clock.t += 10
    landed = dataclasses.replace(lease.doc, renewed_at=1010.0, expires_at=1040.0)
    store.put_if(LEASE_KEY, landed.to_json(), if_version=lease.version)  # the first try landed...
    lease.renew()  # ...and the retry gets a precondition failure
    lease.check(remote=True)
    assert lease.valid_until == 1040.0


def test_release_lets_the_next_holder_in_at_once_and_keeps_the_token(tmp_path: Path) -> None:
    store, clock = LocalStorage(tmp_path), Clock()
    Lease.acquire(store, other(), ttl_s=30, clock=clock).release()
    nxt = Lease.acquire(store, ME, ttl_s=30, clock=clock)
    assert nxt.doc.token == 2


def test_released_worker_is_taken_over_at_once(tmp_path: Path) -> None:
    store, clock = LocalStorage(tmp_path), Clock()
    old = Lease.acquire(store, other(), ttl_s=30, clock=clock)
    Lease.acquire(store, ME, ttl_s=30, released=["w-other"], clock=clock)
    with pytest.raises(LeaseLost):
        old.check(remote=True)


def test_malformed_lease_is_taken_over(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    put_bytes(store, LEASE_KEY, b"{not json")
    assert Lease.acquire(store, ME, clock=Clock()).doc.token == 1


def test_ttl_too_short_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--lease-ttl 1: use at least 3 seconds"):
        Lease.acquire(LocalStorage(tmp_path), ME, ttl_s=1)


def test_fenced_storage_refuses_writes_once_lost_but_still_reads(tmp_path: Path) -> None:
    store, clock = LocalStorage(tmp_path), Clock()
    lease = Lease.acquire(store, ME, ttl_s=30, clock=clock)
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
