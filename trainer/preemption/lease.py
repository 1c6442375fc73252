"""One writer per job: a lease object in the job's storage that a trainer must hold to publish.

Two trainers writing one storage root corrupt each other (one's retention deletes the other's files,
a read-back finds the other's bytes). So a trainer takes `_lease.json` at the storage root before it
publishes anything, renews it while it trains, and gives it back when it exits. The object:

    {"holder": {"worker_id", "flow_run_id", "host", "pid", "pid_ns"},
     "epoch": str, "token": int,   the fencing token: `token` +1 at every takeover within an epoch; a
                                   new epoch (the store's time and 64 random bits) only when no lease
                                   can be read (deleted, malformed), so a token is never issued twice
     "acquired_at", "renewed_at", "expires_at": the holder's wall clock, for people: never decided by
     "mono_expires_at": the holder's deadline on `monotonic()`, for its own processes (same boot)
     "ttl_s": float,
     "released": bool}             the holder gave it back (an expired lease, as far as takeover goes)

Every change is a compare-and-swap (`Storage.put_if` against the version read), so of two trainers
racing for it exactly one wins; an S3-compatible store that ignores the conditions is refused
(`S3Storage.require_conditional_puts`). Who may take a lease is `decide_takeover`, a pure function.
Recovery never waits on a dead holder: same pid namespace with the pid gone, or a worker the controller
says it released (`--lease-takeover`), is taken at once; only a live holder elsewhere is refused until
expiry. A storage that fails transiently while the lease is taken is retried for one TTL.

Clocks: no decision compares two machines' clocks. The holder counts its TTL on its own monotonic
clock from the moment it sent the renewal; a taker judges the lease's age by the store's clock (S3's
`Date` minus `Last-Modified`, a file's mtime against a touched file's: `Storage.read_stamped`), and
takes an unreleased holder elsewhere only once that age passes `ttl_s` plus the store clock's
one-second granularity. The store wrote the renewal after the holder sent it, so the holder's
deadline (less a margin of `ttl_s / 10`) comes before any taker's, whatever either machine's clock
says.

Fencing: `FencedStorage` wraps the storage the trainer writes through. Every write first checks that
the lease is still ours (within its TTL by the monotonic clock, no takeover seen); the commit points (a
manifest, `latest`, COMPLETED.json) also re-read the lease object. A check that passes just before the
holder stalls for longer than the margin (or before a slow multipart put) lets that one write land
after a takeover: fencing by a token only the storage could enforce, which S3 cannot do for ordinary
puts. The stale writer stops at its next check.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from spotrun.trainer.checkpoint.format import COMPLETED, LATEST, MANIFEST
from spotrun.trainer.checkpoint.signing import marker_problem, sign_marker
from spotrun.trainer.errors import (
    ConfigError,
    LeaseHeld,
    LeaseLost,
    PreconditionFailed,
    StorageError,
    TransientStorageError,
)
from spotrun.trainer.preemption.handover import STANDBY_KEY, Advert, write_standby
from spotrun.trainer.storage import ObjectInfo, Storage, get_bytes, put_bytes
from spotrun.trainer.storage.base import Stamped
from spotrun.trainer.telemetry.heartbeat import WORKERS_DIR

log = logging.getLogger(__name__)

LEASE_KEY = "_lease.json"
# Written by the controller once it has released a worker: {"released": [worker ids, newest last]}.
# A prewarmed trainer (started at a notice, while the old one still saves) takes over at once from a
# holder named here, as `--lease-takeover` would have let it had the release come before its start.
HANDOFF_KEY = "_handoff.json"
HANDOFF_KEEP = 16
# Written without the lease, each by a protocol of its own: the lease (and its lock and probe objects),
# the controller's handoff, the standby a replacement writes *while it waits* for the lease
# (trainer/preemption/handover.py), workers' heartbeats. Everything else under the root only the
# holder writes.
UNLEASED = (LEASE_KEY, HANDOFF_KEY, STANDBY_KEY, f"{WORKERS_DIR}/")
PREWARM_POLL_S = 0.1  # a GET per poll while a notice runs out: cheap; each 0.1 s is 0.05 s of idle job
DEFAULT_TTL_S = 30.0
MIN_TTL_S = 3.0
ACQUIRE_TRIES = 5  # each lost race re-reads; the winner of a race is live, so the next read refuses
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0  # between acquire tries the storage failed transiently
COMMIT_NAMES = (MANIFEST, LATEST, COMPLETED)
# S3's Date and Last-Modified are whole seconds: an age read from them may be up to 1 s short (or long)
STORE_CLOCK_SLACK_S = 1.0


_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def monotonic() -> float:
    """The holder's clock: never set or stepped, and on Linux (CLOCK_BOOTTIME) it also counts a
    suspend, so a holder that slept through its TTL knows it. One clock for all processes of a boot."""
    return time.clock_gettime(_CLOCK)


def needs_lease(key: str) -> bool:
    """Whether only the lease's holder may write `key` (a checkpoint's files, `latest`, COMPLETED.json)."""
    return not key.startswith(UNLEASED)


@dataclass(frozen=True)
class Holder:
    worker_id: str
    flow_run_id: str | None
    host: str
    pid: int
    pid_ns: str  # boot id + pid namespace: a pid means the same process only within one

    @classmethod
    def this_process(cls, worker_id: str | None, flow_run_id: str | None) -> Holder:
        """This trainer; without a worker id it is `local-<pid>`, what the local provider calls it."""
        pid = os.getpid()
        return cls(
            worker_id or f"local-{pid}", flow_run_id, socket.gethostname(), pid=pid, pid_ns=pid_namespace()
        )

    def same_process(self, other: Holder) -> bool:
        return bool(self.pid_ns) and self.pid_ns == other.pid_ns and self.pid == other.pid


@dataclass(frozen=True)
class LeaseDoc:
    holder: Holder
    token: int
    acquired_at: float
    renewed_at: float
    expires_at: float
    ttl_s: float
    released: bool = False
    epoch: str = ""  # "" in a lease written before epochs: it orders before every other
    mono_expires_at: float = 0.0

    @property
    def fence(self) -> tuple[str, int]:
        """The fencing token: equal only for the same holding; later holdings order after."""
        return self.epoch, self.token

    @property
    def fence_text(self) -> str:
        return f"{self.epoch}/{self.token}" if self.epoch else str(self.token)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LeaseDoc:
        """Parse a lease object; ValueError when it is not one."""
        try:
            d = json.loads(data)
            doc = cls(**{**d, "holder": Holder(**d["holder"])})
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"not a lease object: {e}") from None
        if not isinstance(doc.token, int) or not isinstance(doc.epoch, str):
            raise ValueError(f"not a lease object: token {doc.token!r}, epoch {doc.epoch!r}")
        return doc


def new_epoch(now: float, seen: str = "") -> str:
    """An epoch for a lease started afresh: a time in seconds, after `now` and after the epoch `seen`
    (the newest this process has read), so epochs order as long as clocks roughly agree; and 64
    random bits, so that no two are ever equal, whatever the clocks say."""
    seen_t = int(seen.partition("-")[0]) if seen[:10].isdigit() else 0
    return f"{max(int(now), seen_t + 1):010d}-{secrets.token_hex(8)}"


def next_fence(current: LeaseDoc | None, now: float, seen: str = "") -> tuple[str, int]:
    """The fencing token of the next holding: the counter goes on within the epoch read; with no lease
    to read (none yet, deleted, malformed) a new epoch starts, so no token is ever issued twice."""
    if current is None:
        return new_epoch(now, seen), 1
    return current.epoch, current.token + 1


@dataclass(frozen=True)
class Takeover:
    take: bool
    reason: str


def expires_in(doc: LeaseDoc, age_s: float) -> float:
    """Seconds until a taker may count the lease as expired, by the store's clock (<= 0: it may)."""
    return doc.ttl_s + STORE_CLOCK_SLACK_S - age_s


def decide_takeover(
    current: LeaseDoc | None,
    me: Holder,
    age_s: float,
    *,
    released: Collection[str],
    pid_alive: Callable[[int], bool],
    uri: str,
    now: float,
) -> Takeover:
    """May `me` take the lease `current`, last written `age_s` ago by the store's clock? `now` (this
    machine's clock) only dates the refusal, the one line a person reads."""
    if current is None:
        return Takeover(True, "no lease")
    h = current.holder
    if current.released:
        return Takeover(True, f"released by {h.worker_id}")
    if (left := expires_in(current, age_s)) <= 0:
        ago = max(0.0, -left)
        return Takeover(True, f"lease of {h.worker_id} expired {ago:.0f} s ago by the store's clock")
    if me.same_process(h):
        return Takeover(True, "held by this process")
    if h.worker_id in released:
        return Takeover(True, f"{h.worker_id} was released by the controller")
    if h.pid_ns and h.pid_ns == me.pid_ns:
        if not pid_alive(h.pid):
            return Takeover(True, f"holder {h.worker_id} (pid {h.pid}) is gone")
    elif h.worker_id == me.worker_id:
        return Takeover(True, f"an earlier trainer of this worker ({h.worker_id})")
    return Takeover(False, held_message(current, left, now, uri))


def held_message(doc: LeaseDoc, left: float, now: float, uri: str) -> str:
    h = doc.holder
    until = datetime.fromtimestamp(now + left, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (
        f"storage {uri} is held by worker {h.worker_id} (flow run {h.flow_run_id or '-'}, host {h.host}, "
        f"pid {h.pid}) until {until} (in {max(0, round(left))} s); "
        "stop that run or wait for the lease to expire"
    )


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists here (a zombie counts: it is not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def pid_namespace() -> str:
    """`<boot id>:<pid namespace>`, or "" where unknown (then no pid is trusted as dead)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def read_lease(storage: Storage) -> tuple[LeaseDoc | None, str | None]:
    """The lease and its version; (None, None) if absent, (None, version) if unreadable."""
    try:
        data, version = storage.read_versioned(LEASE_KEY)
    except FileNotFoundError:
        return None, None
    return _parse(storage, data), version


def read_lease_stamped(storage: Storage) -> tuple[LeaseDoc | None, Stamped | None]:
    """The lease, with its version and age by the store's clock; (None, None) if absent."""
    try:
        stamped = storage.read_stamped(LEASE_KEY)
    except FileNotFoundError:
        return None, None
    return _parse(storage, stamped.data), stamped


def _parse(storage: Storage, data: bytes) -> LeaseDoc | None:
    try:
        doc = LeaseDoc.from_json(data)
    except ValueError as e:
        log.warning("ignoring a malformed lease %s/%s (%s): taking it over", storage.uri, LEASE_KEY, e)
        return None
    _saw(doc.epoch)
    return doc


class Lease:
    """A held lease: `acquire` it, `start` renewing, `check` before publishing, `release` at exit.

    `clock` is monotonic (`monotonic()`): the TTL and every deadline are counted on it. `wall` only
    fills the object's dates, which people read and no decision uses."""

    def __init__(
        self,
        storage: Storage,
        doc: LeaseDoc,
        version: str,
        *,
        valid_until: float,
        clock: Callable[[], float] = monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.storage, self.doc, self.version = storage, doc, version
        self.clock, self.wall = clock, wall
        self.valid_until = valid_until  # by `clock`: when the last successful renewal was sent, + ttl
        self.lost: LeaseLost | None = None
        self._lock = threading.Lock()  # guards doc, version, valid_until, lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def margin_s(self) -> float:
        return self.doc.ttl_s / 10

    @classmethod
    def acquire(
        cls,
        storage: Storage,
        me: Holder,
        ttl_s: float = DEFAULT_TTL_S,
        *,
        released: Collection[str] = (),
        clock: Callable[[], float] = monotonic,
        wait_s: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
        wall: Callable[[], float] = time.time,
    ) -> Lease:
        """Take the lease or raise LeaseHeld naming the live holder.

        Storage that fails transiently (TransientStorageError: the storage layer's own retries ran out)
        is retried with backoff for `wait_s`, by default one TTL: a holder that cannot reach storage
        for that long gives its lease up (`check`), so a trainer that cannot reach it for as long could
        not train safely either, and its controller's retry policy takes over. Within the budget, a
        burst of throttling or resets at startup costs seconds instead of a crashed attempt."""
        if ttl_s < MIN_TTL_S:
            raise ConfigError(f"--lease-ttl {ttl_s:g}: use at least {MIN_TTL_S:g} seconds")
        deadline = clock() + (ttl_s if wait_s is None else wait_s)
        races, backoff = 0, FIRST_BACKOFF_S
        while True:
            try:
                return cls._try_acquire(storage, me, ttl_s, released=released, clock=clock, wall=wall)
            except PreconditionFailed:  # someone else wrote it meanwhile: read again and decide again
                races += 1
                if races >= ACQUIRE_TRIES:
                    raise LeaseHeld(
                        f"storage {storage.uri}: lost {ACQUIRE_TRIES} races for its lease; try again"
                    ) from None
            except TransientStorageError as e:
                # a put that failed this way may still have landed: the re-read finds us the holder
                left = deadline - clock()
                if left <= 0:
                    raise
                pause = min(left, random.uniform(backoff / 2, backoff))
                log.warning("lease of %s: %s; again in %.1f s (%.0f s left)", storage.uri, e, pause, left)
                sleep(pause)
                backoff = min(MAX_BACKOFF_S, backoff * 2)

    @classmethod
    def _try_acquire(
        cls,
        storage: Storage,
        me: Holder,
        ttl_s: float,
        *,
        released: Collection[str],
        clock: Callable[[], float],
        wall: Callable[[], float],
    ) -> Lease:
        """One read, decide, conditional put; PreconditionFailed when another write came between."""
        current, stamped = read_lease_stamped(storage)
        now = wall()
        age = stamped.age_s if stamped is not None else 0.0
        verdict = decide_takeover(
            current, me, age, released=released, pid_alive=pid_alive, uri=storage.uri, now=now
        )
        if not verdict.take:
            raise LeaseHeld(verdict.reason)
        epoch, token = next_fence(current, now, _newest_epoch_seen)
        sent = clock()
        doc = LeaseDoc(
            me,
            token,
            now,
            renewed_at=now,
            expires_at=now + ttl_s,
            ttl_s=ttl_s,
            epoch=epoch,
            mono_expires_at=sent + ttl_s,
        )
        new_version = storage.put_if(
            LEASE_KEY, doc.to_json(), if_version=stamped.version if stamped is not None else None
        )
        _saw(epoch)
        log.info("lease of %s taken (token %s): %s", storage.uri, doc.fence_text, verdict.reason)
        return cls(storage, doc, new_version, valid_until=sent + ttl_s, clock=clock, wall=wall)

    def start(self) -> Lease:
        """Renew in a daemon thread every ttl/3."""
        self._thread = threading.Thread(target=self._renew_loop, name="spotrun-lease", daemon=True)
        self._thread.start()
        return self

    def check(self, remote: bool = False) -> None:
        """Raise LeaseLost unless the lease is still ours; `remote` also re-reads the lease object."""
        with self._lock:
            if self.lost is None and self.clock() >= self.valid_until - self.margin_s:
                self.lost = LeaseLost(f"the lease of {self.storage.uri} ran out without a renewal")
            if self.lost is not None:
                raise self.lost
            fence = self.doc.fence
        if remote:
            current, _ = read_lease(self.storage)
            if current is None or current.fence != fence or current.released:
                raise self._lose(current)

    def renew(self) -> None:
        """One conditional put extending the lease; marks it lost when someone else took it."""
        with self._lock:
            if self.lost is not None:
                return
            sent, now = self.clock(), self.wall()
            ttl = self.doc.ttl_s
            doc = replace(self.doc, renewed_at=now, expires_at=now + ttl, mono_expires_at=sent + ttl)
            version = self.version
        try:
            new_version = self.storage.put_if(LEASE_KEY, doc.to_json(), if_version=version)
        except PreconditionFailed:
            current, current_version = read_lease(self.storage)
            if current != doc or current_version is None:  # not our own write landing on a retry
                self._lose(current)
                return
            new_version = current_version
        with self._lock:
            self.doc, self.version, self.valid_until = doc, new_version, sent + ttl

    def release(self) -> None:
        """Stop renewing and give the lease back (marked released, token kept for the next holder)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            if self.lost is not None:
                return
            now = self.wall()
            doc = replace(self.doc, renewed_at=now, expires_at=now, mono_expires_at=0.0, released=True)
            version = self.version
            # fenced from here on: a write still in flight (an upload thread on an error path) must not
            # land after the next holder may have taken over
            self.lost = LeaseLost(f"the lease of {self.storage.uri} was released by this trainer")
        try:
            self.storage.put_if(LEASE_KEY, doc.to_json(), if_version=version)
        except Exception as e:  # boundary: exiting anyway; an unreleased lease just expires (ttl_s)
            log.warning("could not release the lease of %s (%s); it expires by itself", self.storage.uri, e)
        else:
            log.info("lease of %s released", self.storage.uri)

    def _lose(self, current: LeaseDoc | None) -> LeaseLost:
        """Mark the lease lost (once) and return the error that says to whom."""
        with self._lock:
            if self.lost is not None:
                return self.lost
            if current is None or current.released:
                self.lost = LeaseLost(f"the lease of {self.storage.uri} was removed or released by another")
            else:
                h = current.holder
                self.lost = LeaseLost(
                    f"the lease of {self.storage.uri} was taken over by worker {h.worker_id} (flow run "
                    f"{h.flow_run_id or '-'}, host {h.host}, pid {h.pid}, token {current.fence_text}); "
                    "this trainer stopped without publishing more",
                    taken_by=h.worker_id,
                )
            lost = self.lost
        log.error("%s", lost)  # when it is found (the renewal may find it steps before a write does)
        return lost.mark(logged=True)  # the exit does not say it again

    def _renew_loop(self) -> None:
        every = self.doc.ttl_s / 3
        while not self._stop.wait(every):
            try:
                self.renew()
            except Exception as e:  # boundary: keep trying; check() fails once the TTL runs out
                log.warning("lease renewal of %s failed: %s: %s", self.storage.uri, type(e).__name__, e)
            if self.lost is not None:
                return


_newest_epoch_seen = ""  # of the leases this process took: a new epoch starts after it


def _saw(epoch: str) -> None:
    global _newest_epoch_seen
    _newest_epoch_seen = max(_newest_epoch_seen, epoch)


class LeaseView:
    """A lease held by another process of this trainer (the checkpoint writer's view of its parent's
    lease, trainer/saving/writer_proc.py): it cannot see the parent's renewals, so every `check` reads the
    lease object. Ours while the fencing token is ours, not released, and not within the margin of
    the parent's own deadline: `mono_expires_at`, on `monotonic()`, which the processes of one boot
    share."""

    def __init__(
        self, storage: Storage, fence: tuple[str, int], clock: Callable[[], float] = monotonic
    ) -> None:
        self.storage, self.fence, self.clock = storage, fence, clock

    def check(self, remote: bool = False) -> None:
        current, _ = read_lease(self.storage)
        if current is None or current.released or current.fence != self.fence:
            who = "removed or released" if current is None or current.released else "taken over"
            raise LeaseLost(
                f"the lease of {self.storage.uri} was {who} (token {'/'.join(map(str, self.fence))} was "
                "ours); the checkpoint writer stopped without publishing more",
                taken_by=None if current is None or current.released else current.holder.worker_id,
            )
        if self.clock() >= current.mono_expires_at - current.ttl_s / 10:
            raise LeaseLost(f"the lease of {self.storage.uri} ran out without a renewal")


class LeaseCheck(Protocol):
    def check(self, remote: bool = False) -> None: ...


class FencedStorage:
    """The storage a lease holder writes through: every write checks the lease first (see module doc)."""

    def __init__(self, inner: Storage, lease: LeaseCheck) -> None:
        self.inner, self.lease, self.uri = inner, lease, inner.uri

    def put(self, key: str, src: Path) -> None:
        self.lease.check(remote=key.rpartition("/")[2] in COMMIT_NAMES)
        self.inner.put(key, src)

    def get(self, key: str, dst: Path) -> None:
        self.inner.get(key, dst)

    def read(self, key: str) -> Iterator[bytes]:
        return self.inner.read(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, keys: Sequence[str]) -> None:
        self.lease.check()
        self.inner.delete(keys)

    def cleanup_incomplete(self, older_than_s: float) -> int:
        self.lease.check()
        return self.inner.cleanup_incomplete(older_than_s)

    def local_path(self, key: str) -> Path | None:
        return self.inner.local_path(key)

    def staging(self) -> Path | None:
        return self.inner.staging()

    def adopt(self, files: Sequence[tuple[str, Path]]) -> None:
        self.lease.check(remote=any(key.rpartition("/")[2] in COMMIT_NAMES for key, _ in files))
        self.inner.adopt(files)

    def checked_size(self, key: str) -> int | None:
        return self.inner.checked_size(key)

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        return self.inner.read_versioned(key)

    def read_stamped(self, key: str) -> Stamped:
        return self.inner.read_stamped(key)

    def put_if(self, key: str, data: bytes, *, if_version: str | None) -> str:
        self.lease.check()
        return self.inner.put_if(key, data, if_version=if_version)


@contextlib.contextmanager
def held(
    storage: Storage,
    me: Holder,
    ttl_s: float = DEFAULT_TTL_S,
    *,
    released: Collection[str] = (),
    wait_s: float = 0.0,
    peer: Advert | None = None,
) -> Iterator[FencedStorage]:
    """Acquire (waiting up to `wait_s` for the holder to let go), renew while the block runs, release
    after it: the block writes through the result. `peer`: where this waiting trainer takes copies of the
    holder's state (trainer/saving/peer.py), told to the holder with its standby record."""
    lease = (
        wait_for_lease(storage, me, ttl_s, released=released, wait_s=wait_s, peer=peer)
        if wait_s > 0
        else Lease.acquire(storage, me, ttl_s, released=released)
    ).start()
    try:
        yield FencedStorage(storage, lease)
    finally:
        lease.release()


def read_handoff(storage: Storage) -> list[str]:
    """The workers the controller says it has released (newest last); [] if none or unreadable."""
    try:
        body = json.loads(get_bytes(storage, HANDOFF_KEY))
        released = [str(w) for w in body.get("released", [])]
    except FileNotFoundError:
        return []
    except (ValueError, TypeError, AttributeError):
        log.warning("ignoring a malformed %s/%s", storage.uri, HANDOFF_KEY)
        return []
    problem = marker_problem(body)  # with SPOTRUN_MANIFEST_KEY, only the controller's signed word counts
    if problem is not None:
        log.warning("ignoring %s/%s: %s", storage.uri, HANDOFF_KEY, problem)
        return []
    return released


def write_handoff(storage: Storage, worker_id: str) -> None:
    """The controller's word that `worker_id` is gone: a waiting trainer may take its lease now."""
    earlier = [w for w in read_handoff(storage) if w != worker_id][-(HANDOFF_KEEP - 1) :]
    ids = [*earlier, worker_id]
    body = sign_marker({"released": ids, "at": time.time()})
    put_bytes(storage, HANDOFF_KEY, json.dumps(body).encode())


def wait_for_lease(
    storage: Storage,
    me: Holder,
    ttl_s: float,
    *,
    released: Collection[str],
    wait_s: float,
    clock: Callable[[], float] = monotonic,
    sleep: Callable[[float], None] = time.sleep,
    peer: Advert | None = None,
) -> Lease:
    """A prewarmed trainer's acquire: the recipe is built and the data loaded; the worker it replaces
    still writes its emergency checkpoint. Poll until the lease is free (its holder released it at exit,
    after that checkpoint became durable; it expired; or the controller's handoff names the holder as
    released), for up to `wait_s`; then LeaseHeld. Whatever is taken, the checkpoint chosen next is
    one the old holder had made durable: it publishes nothing after giving the lease back."""
    deadline, logged, stood_by = clock() + wait_s, False, False
    while True:
        try:
            return Lease.acquire(
                storage, me, ttl_s, released=[*released, *read_handoff(storage)], clock=clock
            )
        except LeaseHeld as e:
            if clock() >= deadline:
                raise
            if not logged:
                log.info("prewarmed: waiting up to %.0f s for the storage lease (%s)", wait_s, e)
                logged = True
            stood_by = stood_by or _stand_by(storage, me, peer)  # again at each poll until it is written
            sleep(PREWARM_POLL_S)


def _stand_by(storage: Storage, me: Holder, peer: Advert | None = None) -> bool:
    """Tell the holder, which may be training through its notice, that its replacement is ready;
    whether that was written."""
    doc, _ = read_lease(storage)
    if doc is None:
        return False
    try:
        write_standby(storage, doc.holder.worker_id, "waiting", me.worker_id, peer=peer)
    except (OSError, StorageError) as e:  # retried at the next poll; meanwhile the holder trains on
        log.warning("prewarmed: standby not written (%s)", e)
        return False
    return True
