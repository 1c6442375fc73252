"""State sent to the warm standby: a reclaim without notice loses about one copy interval of training
instead of everything since the last durable checkpoint.

A warm standby (tasks/control/warm.py) waits on the storage lease with the recipe built. It wins back the
cold start of a reclaim without notice, not the steps since the last checkpoint: those are written to
storage every `every_seconds` or `every_steps`, an interval chosen for what a write to the store costs
(an upload, its verification, retention). A copy into another machine's memory costs far less, as
Gemini (SOSP '23) found for in-memory checkpoints on peers: here the running trainer sends its state to
the standby every `standby_every_s` (at most that often: where a copy's measured cost to the loop, the
extra time of the steps it ran beside, would take more than BUDGET of the loop's time, copies are
spaced further apart), and the standby keeps the newest copy. When it takes the lease
(the worker is gone), it commits that copy to storage as an ordinary checkpoint if it is newer than
the newest one there, and resumes from it through the usual selection and validation.

The copy is the checkpoint format itself: the same snapshot of the full state at a step boundary, the
same step directory (trainer/checkpoint/format.py: hashed, signed with SPOTRUN_MANIFEST_KEY where set)
and the per-step metrics up to it, so a resume from it is bitwise the resume from a checkpoint of that
step. What crosses the socket:

    {"token": T, "step": S, "files": [[NAME, SIZE], ...], "sidecars": [[KEY, SIZE], ...]}\\n
    the bytes of each file, then of each sidecar, in that order

Trust. The standby's address and token travel in its signed `_standby.json` record
(trainer/preemption/handover.py). The sender only sends to an IP literal that is loopback or private
(a bucket someone else can write must not point a trainer's weights at the internet); the receiver
listens on loopback unless told otherwise and takes a stream only with its token, file names by the
checkpoint names rule (trainer/checkpoint/safe_names.py), sidecars only under the metrics prefix, and
at most `max_bytes` (twice its own state's size and a margin: the same model's checkpoint). A copy
that fails any of that, or arrives torn, is dropped, and the last durable checkpoint stands.

Only a job of one process (a handover between ranks is not built), and only what the trainer's loop
sees as steps: a `command:` script is not covered.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import shutil
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotrun.trainer.checkpoint.catalog import Catalog
from spotrun.trainer.checkpoint.format import MANIFEST, Manifest, step_dir, write_checkpoint_dir
from spotrun.trainer.checkpoint.safe_names import name_problem
from spotrun.trainer.checkpoint.state import Snapshotter, state_nbytes
from spotrun.trainer.errors import StorageError
from spotrun.trainer.preemption.handover import Advert, read_standby
from spotrun.trainer.saving.publish import upload
from spotrun.trainer.storage import Storage
from spotrun.trainer.telemetry.metrics_log import parse_metrics_key

log = logging.getLogger(__name__)

HEADER_MAX = 1 << 20  # a header line longer than this is no header
MAX_FILES = 10_000
CONNECT_TIMEOUT_S = 2.0
IO_TIMEOUT_S = 60.0
CHUNK = 1 << 20
MARGIN_BYTES = 64 << 20  # the manifest, the trainer's own part, sidecars: beside the tensors
SHM = "/dev/shm"
BUDGET = 0.03  # the share of the loop's time copies may take; they are spaced out to stay within it
QUIET_STEPS, MIN_QUIET = 50, 5  # step times with nothing in flight kept (the newest), and needed
FIND_EVERY_S = 0.5  # `_standby.json` is read at most this often while no standby takes copies (a GET on S3)


def address_problem(addr: str) -> str | None:
    """Why a sender must not send to `addr`; None when it may (an IP literal, loopback or private)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return f"standby address {addr!r} is not HOST:PORT"
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return f"standby address {addr!r} is not an IP address"
    if not (ip.is_loopback or ip.is_private) or ip.is_link_local or ip.is_multicast:
        return f"standby address {addr!r} is neither loopback nor private"
    return None


class PeerReceiver:
    """The standby's side: a listening socket in a thread, the newest copy in `dir`."""

    def __init__(self, directory: Path, max_bytes: int, host: str = "127.0.0.1") -> None:
        self.dir, self.max_bytes = directory, max_bytes
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        self._token = secrets.token_hex(16)
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(2)
        port = self._sock.getsockname()[1]
        self.advert = Advert(f"{host}:{port}" if ":" not in host else f"[{host}]:{port}", self._token)
        self._lock = threading.Lock()
        self.newest: tuple[int, Path, dict[str, Path]] | None = None  # step, directory, sidecar files
        self.received = 0
        self._closed = self._committing = False
        self._thread = threading.Thread(target=self._serve, name="spotrun-peer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn, conn.makefile("rb") as reader:  # both closed: a refusal ends the connection
                try:
                    conn.settimeout(IO_TIMEOUT_S)
                    self._take(conn, reader)
                except (OSError, ValueError) as e:  # a torn or refused copy: the last durable one stands
                    log.warning("standby copy dropped: %s", e)

    def _take(self, conn: socket.socket, reader: Any) -> None:
        header = json.loads(reader.readline(HEADER_MAX))
        if not isinstance(header, dict) or not hmac.compare_digest(str(header.get("token", "")), self._token):
            raise ValueError("a copy without this standby's token")
        step = int(header["step"])
        if step < 0:
            raise ValueError(f"a copy of step {step}")
        files = _entries(header.get("files"), name_problem)
        sidecars = _entries(header.get("sidecars"), _sidecar_problem)
        total = sum(size for _, size in files + sidecars)
        if total > self.max_bytes:
            raise ValueError(f"a copy of {total} bytes is over this standby's {self.max_bytes}")
        tmp = self.dir / f".tmp-{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        for name, size in files:
            _receive(reader, tmp / step_dir(step) / name, size)
        for i, (_, size) in enumerate(sidecars):
            _receive(reader, tmp / "sidecars" / f"{i}", size)
        final = self.dir / f"{step}"
        with self._lock:
            if self._committing:  # the copy being committed stays as it is; this one came too late
                shutil.rmtree(tmp, ignore_errors=True)
                raise ValueError(f"the copy of step {step} arrived after the commit began")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            old, self.newest = (
                self.newest,
                (
                    step,
                    final / step_dir(step),
                    {key: final / "sidecars" / f"{i}" for i, (key, _) in enumerate(sidecars)},
                ),
            )
            self.received += 1
        conn.sendall(f"ok {step}\n".encode())  # the sender reports the step as held here
        if old is not None and old[1].parent != final:
            shutil.rmtree(old[1].parent, ignore_errors=True)

    def commit(self, storage: Storage) -> int | None:
        """Having taken the lease: the newest copy into storage as a checkpoint, if newer than every
        committed one there; the step committed, or None."""
        self.close()
        with self._lock:
            self._committing = True
            newest = self.newest
        if newest is None:
            return None
        step, local, sidecar_files = newest
        try:
            committed = [s for s, e in Catalog(storage).list().items() if e.committed]
            if committed and max(committed) >= step:
                log.info(
                    "standby copy of step %d not newer than checkpoint step %d: not used",
                    step,
                    max(committed),
                )
                return None
            manifest = Manifest.from_json((local / MANIFEST).read_bytes())
            if manifest.step != step:
                raise ValueError(f"the copy of step {step} holds a manifest of step {manifest.step}")
            sidecars = {key: path.read_bytes() for key, path in sidecar_files.items()}
            t0 = time.perf_counter()
            upload(storage, local, manifest, sidecars=sidecars)
        except (OSError, ValueError, StorageError) as e:  # the last durable checkpoint stands
            log.warning("standby copy of step %d not committed: %s", step, e)
            return None
        log.info(
            "standby copy of step %d committed to %s in %.2fs", step, storage.uri, time.perf_counter() - t0
        )
        return step


def _sidecar_problem(key: object) -> str | None:
    if not isinstance(key, str) or parse_metrics_key(key) is None:
        return f"sidecar {key!r} is not a metrics object"
    return None


def _entries(raw: Any, problem: Callable[[Any], str | None]) -> list[tuple[str, int]]:
    if not isinstance(raw, list) or len(raw) > MAX_FILES:
        raise ValueError("a copy's file list is not a list, or too long")
    out: list[tuple[str, int]] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], int) and item[1] >= 0):
            raise ValueError(f"a copy's file entry {item!r} is not [NAME, SIZE]")
        if (why := problem(item[0])) is not None:
            raise ValueError(why)
        out.append((item[0], item[1]))
    return out


def _receive(reader: Any, path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    left = size
    with open(path, "wb") as f:
        while left:
            chunk = reader.read(min(CHUNK, left))
            if not chunk:
                raise ValueError(f"a copy ended {left} bytes short")
            f.write(chunk)
            left -= len(chunk)


class PeerSender:
    """The running trainer's side: finds its standby in `_standby.json`, sends copies in a thread, one at
    a time (a copy still in flight when the next is due skips that one)."""

    def __init__(self, storage: Storage, me: str, cache: Path, every_s: float) -> None:
        self.storage, self.me, self.dir, self.every_s = storage, me, cache, every_s
        self.spacing_s = every_s  # every_s, or more where the copies' measured cost asks for it
        self.cost_s = 0.0  # the last copy's cost to the loop
        self._quiet: deque[float] = deque(maxlen=QUIET_STEPS)  # step times with nothing in flight
        self._beside: list[float] = []  # step times while the copy in flight ran
        self._pending = False  # a copy was sent whose cost is not accounted yet
        self._last = self._looked = time.monotonic() - FIND_EVERY_S
        self._advert: Advert | None = None
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self._snapshotter = Snapshotter()
        self.acked: int | None = None  # the newest step the standby confirmed holding

    def step(self, seconds: float, beside_save: bool) -> None:
        """One step's time, at each step boundary: what a copy costs the loop is the extra time of the
        steps that ran beside it (its snapshot's stall falls into the next step), over the median of
        steps with nothing in flight; copies are then spaced so that they cost at most BUDGET of it."""
        if self._pending:
            self._beside.append(seconds)
            if self.busy:
                return
            self._pending = False
            if len(self._quiet) >= MIN_QUIET:
                usual = statistics.median(self._quiet)
                self.cost_s = sum(max(0.0, s - usual) for s in self._beside)
                self.spacing_s = max(self.every_s, self.cost_s / BUDGET)
            self._beside = []
        elif not beside_save:
            self._quiet.append(seconds)

    def due(self) -> bool:
        """A copy is due, none is in flight, and a standby that takes them is known."""
        if time.monotonic() - self._last < self.spacing_s or self.busy:
            return False
        now = self._last = time.monotonic()
        if self._advert is None and now - self._looked >= FIND_EVERY_S:
            self._looked = now
            self._advert = self._find()
        return self._advert is not None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def send(self, state: dict[str, Any], base: dict[str, Any], sidecars: dict[str, bytes]) -> float:
        """Snapshot `state` (the loop waits for this copy into host memory, as for a checkpoint), then
        write it as a step directory and send it, in a thread. Returns the seconds the loop waited."""
        advert = self._advert
        assert advert is not None
        snap = self._snapshotter.snapshot(state)  # its buffers are reused: one copy in flight at a time
        self._pending = True
        self._thread = threading.Thread(
            target=self._send, args=(advert, snap, base, sidecars), name="spotrun-peer-send", daemon=True
        )
        self._thread.start()
        return self._snapshotter.last_seconds

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=IO_TIMEOUT_S)

    def _find(self) -> Advert | None:
        standby = read_standby(self.storage)
        if standby is None or standby.replacing != self.me or standby.state != "waiting":
            return None
        advert = standby.peer
        if advert is None:
            return None
        problem = address_problem(advert.addr)
        if problem is not None:
            if problem not in self._warned:
                self._warned.add(problem)
                log.warning("not sending state to the standby: %s", problem)
            return None
        return advert

    def _send(
        self, advert: Advert, snap: dict[str, Any], base: dict[str, Any], sidecars: dict[str, bytes]
    ) -> None:
        step = int(base["step"])
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            local, manifest = write_checkpoint_dir(self.dir, snap, base)
            names = [*sorted(manifest.files), MANIFEST]
            files = [[n, (local / n).stat().st_size] for n in names]
            header = {
                "token": advert.token,
                "step": step,
                "files": files,
                "sidecars": [[k, len(v)] for k, v in sidecars.items()],
            }
            host, _, port = advert.addr.rpartition(":")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S) as conn:
                conn.settimeout(IO_TIMEOUT_S)
                conn.sendall(json.dumps(header).encode() + b"\n")
                for n in names:
                    with open(local / n, "rb") as f:
                        conn.sendfile(f)
                for body in sidecars.values():
                    conn.sendall(body)
                with conn.makefile("rb") as answer:
                    ack = answer.readline(64).decode(errors="replace").split()
            if ack != ["ok", str(step)]:
                raise OSError(f"the standby did not confirm the copy ({' '.join(ack) or 'no answer'})")
            self.acked = step
        except OSError as e:  # the standby is gone or not listening: find it again next time
            log.info("state copy of step %d not sent to the standby: %s", step, e)
            self._advert = None
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def receiver_for(state: dict[str, Any], cache: Path, host: str = "127.0.0.1") -> PeerReceiver:
    """A standby's receiver, taking copies of at most twice its own state's size (and a margin)."""
    return PeerReceiver(
        cache.parent / f"{cache.name}.standby-{os.getpid()}", 2 * state_nbytes(state) + MARGIN_BYTES, host
    )


def sender_for(storage: Storage, me: str, cache: Path, *, every_s: float, state_bytes: int) -> PeerSender:
    """The running trainer's sender. Its copies are written in memory (/dev/shm) where that has room for
    two, else beside (never inside) the checkpoint cache: a copy of the digits recipe's state took
    6 ms of CPU there against 10 ms (16 ms wall) on this VM's disk, whose fsyncs a copy does not need."""
    name = f"{cache.name}.to-standby-{os.getpid()}"
    try:
        shm = os.statvfs(SHM)
        roomy = shm.f_bavail * shm.f_frsize > 2 * state_bytes + MARGIN_BYTES
    except OSError:
        roomy = False
    return PeerSender(storage, me, Path(SHM) / name if roomy else cache.parent / name, every_s)
