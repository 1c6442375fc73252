"""The checkpoint writer as a separate process: serialize, hash, write, upload, confirm, publish.

Why a process: in a thread, torch.save's pickler, safetensors' serializer and the upload client hold
the GIL in turns with the training loop, and the step slows down while a checkpoint is in flight.
PyTorch's own async checkpointing took its background time from 436 s to 67 s by moving the writer out
of the training process for that reason. Here the loop copies the state into a shared arena
(trainer/saving/shm.py) and hands the writer a job: the state's structure with a `Slot` per tensor and the
manifest fields. The writer maps the arena, runs the same pipeline the thread ran (write the step
directory fsynced and hashed in one pass, upload manifest last, confirm, move `latest`, retention),
and answers with the timings or the error. The loop's side keeps one job in flight (the arena is
reused), so its `save` waits for the previous answer before it copies again.

The writer runs at nice 10 with one torch thread, ignores SIGINT/SIGTERM (its parent decides when it
stops: the emergency checkpoint at a notice must not die with the signal that asked for it), and gets
SIGKILL when the parent dies (PR_SET_PDEATHSIG). It opens its own storage from a picklable opener the
store gives (`opener_of`, `Reopenable`): a boto3 client cannot cross a process. Fencing is kept: writes go
through a `FencedStorage` whose lease check reads the lease object (`lease.LeaseView`) before every write.

Started with `python -P -m spotrun.trainer.saving.writer_proc FD`, not multiprocessing's spawn, which would
import the trainer's `__main__` module (the whole training stack) in the child.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import Any

from spotrun.trainer.errors import CheckpointError, LeaseLost
from spotrun.trainer.interpreter import child_env, python_m
from spotrun.trainer.parent_death import arm_pdeathsig
from spotrun.trainer.storage import Reopenable, Storage

log = logging.getLogger(__name__)

WRITER_NICE = 10

Opener = Callable[[], Storage]


@dataclass(frozen=True)
class Init:
    opener: Opener
    lease_fence: tuple[str, int] | None  # the parent's lease (its fencing token): writes are fenced on it
    cache: Path
    keep: int
    log_level: int


@dataclass(frozen=True)
class Job:
    structure: Any  # Registry.capture() with a shm.Slot per tensor
    base: dict[str, Any]  # the manifest's fields but files
    sidecars: dict[str, bytes]  # written before the manifest (publish.put_sidecars)


@dataclass(frozen=True)
class Done:
    step: int
    write_s: float
    upload_s: float
    verify_s: float
    nbytes: int
    sidecars_written: bool


@dataclass(frozen=True)
class Failed:
    kind: str  # "lost": LeaseLost; "error": anything else
    message: str
    taken_by: str | None = None

    def exception(self) -> BaseException:
        if self.kind == "lost":
            return LeaseLost(self.message, taken_by=self.taken_by)
        return CheckpointError(self.message)


def opener_of(storage: Any) -> tuple[Opener, tuple[str, int] | None] | None:
    """A picklable way to open `storage` again in another process (the store's own answer,
    `Reopenable.reopener`), and the lease's fencing token that fences it; None for a storage that cannot
    be reopened (a test double, an in-memory store): its checkpoints stay in a thread."""
    from spotrun.trainer.preemption.lease import FencedStorage, Lease

    fence = None
    if isinstance(storage, FencedStorage):
        if not isinstance(storage.lease, Lease):
            return None
        fence, storage = storage.lease.doc.fence, storage.inner
    opener = storage.reopener() if isinstance(storage, Reopenable) else None
    return None if opener is None else (opener, fence)


class WriterProcess:
    """The parent's handle on one writer process. `persist` sends a job and waits for its answer (from
    the checkpointer's background thread, which thus holds the GIL only to send and receive)."""

    def __init__(self, opener: Opener, lease_fence: tuple[str, int] | None, cache: Path, keep: int) -> None:
        ours, theirs = socket.socketpair()
        cwd = os.getcwd()  # first on its path, as `python -m` here would have it
        self.proc = subprocess.Popen(
            python_m("spotrun.trainer.saving.writer_proc", str(theirs.fileno()), str(os.getpid())),
            cwd=cwd,
            env=child_env(cwd=cwd),
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.generation = 0
        level = logging.getLogger().getEffectiveLevel()
        self.conn.send(Init(opener, lease_fence, cache, keep=keep, log_level=level))

    def persist(
        self,
        structure: Any,
        arena_fd: int,
        generation: int,
        *,
        base: dict[str, Any],
        sidecars: dict[str, bytes],
    ) -> Done:
        try:
            if generation != self.generation:
                self.conn.send(("arena", os.fstat(arena_fd).st_size))
                send_handle(self.conn, arena_fd, self.proc.pid)
                self.generation = generation
            self.conn.send(Job(structure, base, sidecars))
            reply = self.conn.recv()
        except (EOFError, OSError) as e:
            raise CheckpointError(f"the checkpoint writer process died ({self._how()})") from e
        if isinstance(reply, Failed):
            raise reply.exception()
        if not isinstance(reply, Done):
            raise CheckpointError(f"the checkpoint writer answered {reply!r}")
        return reply

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the writer to exit (after its job, if one runs), then make sure it has."""
        with contextlib.suppress(OSError):
            self.conn.send(("stop",))
        self.conn.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _how(self) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(1.0)
        rc = self.proc.returncode
        if rc is None:
            return "it stopped answering"
        return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"


# -- the writer process ------------------------------------------------------------------------------


class _Writer:
    def __init__(self, init: Init) -> None:
        from spotrun.trainer.preemption.lease import FencedStorage, LeaseView

        storage = init.opener()
        if init.lease_fence is not None:
            storage = FencedStorage(storage, LeaseView(storage, init.lease_fence))
        self.storage, self.cache, self.keep = storage, init.cache, init.keep
        self.buf: mmap.mmap | None = None

    def map_arena(self, fd: int, size: int) -> None:
        if self.buf is not None:
            with contextlib.suppress(BufferError):
                self.buf.close()
        self.buf = mmap.mmap(fd, size)
        os.close(fd)

    def run(self, job: Job) -> Done:
        from spotrun.trainer.checkpoint.catalog import apply_retention, prune_local
        from spotrun.trainer.saving.publish import persist
        from spotrun.trainer.saving.shm import rebuild

        if self.buf is None:
            raise CheckpointError("a job came before its arena")
        snap = rebuild(job.structure, self.buf)
        try:
            done = persist(self.storage, self.cache, snap, base=job.base, sidecars=job.sidecars)
        finally:
            del snap  # the views of the arena: released before it may be replaced
        step = done.manifest.step
        apply_retention(self.storage, step, self.keep)
        prune_local(self.cache, {step})
        return Done(
            step,
            done.write_s,
            done.upload_s,
            verify_s=done.verify_s,
            nbytes=done.nbytes,
            sidecars_written=done.sidecars_written,
        )


def _serve(conn: Connection) -> None:
    init = conn.recv()
    logging.basicConfig(
        level=init.log_level,
        format="%(asctime)s %(levelname)s writer %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import torch

    torch.set_num_threads(1)  # serialization and hashing are single-threaded; leave the cores to training
    torch.serialization.set_crc32_options(False)  # as in the thread writer: the manifest's digest checks
    try:
        writer: _Writer | Failed = _Writer(init)
    except Exception as e:  # boundary: every job is answered with why the writer could not start
        writer = Failed("error", f"the checkpoint writer could not open its storage: {type(e).__name__}: {e}")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return  # the parent closed its end (or died): nothing more to do
        if isinstance(msg, tuple) and msg[0] == "arena":
            fd = recv_handle(conn)
            if isinstance(writer, _Writer):
                writer.map_arena(fd, int(msg[1]))
            else:
                os.close(fd)
        elif isinstance(msg, Job):
            conn.send(writer if isinstance(writer, Failed) else _answer(writer, msg))
        else:
            return


def _answer(writer: _Writer, job: Job) -> Done | Failed:
    try:
        return writer.run(job)
    except LeaseLost as e:
        return Failed("lost", str(e), e.taken_by)
    except Exception as e:  # boundary of the job: the parent raises it in the loop
        return Failed("error", f"{type(e).__name__}: {e}")


def _detach_from_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    arm_pdeathsig()
    with contextlib.suppress(OSError):
        os.nice(WRITER_NICE)


def main(argv: list[str]) -> int:
    _detach_from_signals()
    if os.getppid() != int(argv[1]):  # the parent died before the death signal was armed
        return 1
    conn = Connection(int(argv[0]))
    with contextlib.suppress(EOFError, KeyboardInterrupt):
        _serve(conn)
    return 0


if __name__ == "__main__":
    # run as the module proper, not `__main__`: the parent pickles trainer.saving.writer_proc.Job, and
    # isinstance against a second copy of the class (this file as __main__) would never match
    from spotrun.trainer.saving import writer_proc

    sys.exit(writer_proc.main(sys.argv[1:]))
