"""The chaos campaign's stand-in for the worker's `python`: runs `python -P -m spotrun.trainer` with faults
wired in.

`install(dir)` writes an executable `chaos-python` that the local provider starts as its interpreter
(LocalProviderConfig.python). Before the trainer's own `__main__` runs, it reads the plan (JSON, path
in SPOTRUN_CHAOS_PLAN, read once at start: the campaign rewrites it before each attempt) and wraps:

  phases   write (local checkpoint dir), upload, verify (read-back), publish (`latest`), retention:
           {"kill": {"signal": "SIGKILL"|"SIGTERM", "phase": P, "nth": n, "delay_s": d}} sends the
           signal to this process d seconds after the n-th entry into phase P, from a timer thread,
           so it lands inside the phase (or just after it, when the phase is quicker than d);
           with "target": "parent" the signal goes to the trainer's parent, the controller
  disk     {"disk": {"errno": "ENOSPC"|"EIO", "nth": n}}: the n-th local checkpoint write fails the
           way a full or failing disk does: ENOSPC from the first optimizer.pt write (the weights
           already on disk), EIO from the manifest's fsync; a partial .tmp directory stays behind
  writes   every S3 put and delete of what only the lease's holder may write (`lease.needs_lease`:
           not the lease, the handoff, a replacement's standby or heartbeats, which other processes
           write by design) is appended to the plan's `publog` as {"pid", "op", "key"} before it is
           sent: the campaign finds two writers of one storage by interleaving in this log

Trainer code is not edited: the wrappers replace module attributes in this process only.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import runpy
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

PHASES = ("write", "upload", "verify", "publish", "retention")
PLAN_ENV = "SPOTRUN_CHAOS_PLAN"


def install(directory: Path) -> Path:
    """Write an executable `chaos-python` into `directory` and return its path."""
    exe = directory / "chaos-python"
    repo = str(Path(__file__).resolve().parents[1])
    exe.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {repo!r})\n"
        "from bench.chaos_hook import main\nmain()\n"
    )
    exe.chmod(0o755)
    return exe


def main() -> None:
    plan_path = os.environ.get(PLAN_ENV)
    plan: dict[str, Any] = json.loads(Path(plan_path).read_text()) if plan_path else {}
    _wrap(plan)
    args = sys.argv[2:] if sys.argv[1:2] == ["-P"] else sys.argv[1:]  # -P: this process's path is set
    if args[:2] != ["-m", "spotrun.trainer"]:
        raise SystemExit("chaos-python runs only `-P -m spotrun.trainer ...`")
    sys.argv = ["trainer", *args[2:]]
    runpy.run_module("spotrun.trainer", run_name="__main__", alter_sys=True)


def _wrap(plan: dict[str, Any]) -> None:
    import spotrun.trainer.checkpoint.format as fmt
    import spotrun.trainer.saving.checkpointer as ck
    import spotrun.trainer.saving.publish as pub
    from spotrun.trainer.storage import s3

    kill, disk, publog = plan.get("kill"), plan.get("disk"), plan.get("publog")
    names = {
        "write": "write_checkpoint_dir",
        "upload": "upload",
        "verify": "verify_remote",
        "publish": "write_latest",
        "retention": "apply_retention",
    }
    entries = dict.fromkeys(PHASES, 0)
    for phase, attr in names.items():
        # the pipeline looks its phases up in publish.py, the writer thread its retention in
        # checkpointer.py, and sharded.py imports verify_remote from checkpointer.py: one wrapper for all
        wrapped = _counted(getattr(ck if phase == "retention" else pub, attr), phase, entries, kill)
        for module in (pub, ck):
            if hasattr(module, attr):
                setattr(module, attr, wrapped)
    if disk is not None:
        real = pub.write_checkpoint_dir
        pub.write_checkpoint_dir = _disk_fault(real, fmt, int(disk["nth"]), getattr(errno, disk["errno"]))
    if publog is not None:
        _log_writes(s3.S3Storage, Path(publog))
    if plan.get("resumes") is not None:
        _log_resumes(plan["resumes"])


def _counted(fn: Callable[..., Any], phase: str, entries: dict[str, int], kill: Any) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        entries[phase] += 1
        if kill is not None and kill["phase"] == phase and entries[phase] == int(kill["nth"]):
            sig = signal.Signals[kill["signal"]]
            pid = os.getppid() if kill.get("target") == "parent" else os.getpid()
            threading.Timer(float(kill["delay_s"]), os.kill, (pid, sig)).start()
        return fn(*args, **kwargs)

    return wrapper


def _disk_fault(real: Callable[..., Any], fmt: Any, nth: int, code: int) -> Callable[..., Any]:
    calls = [0]

    def write_checkpoint_dir(parent: Path, snap: dict[str, Any], base: dict[str, Any], **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] != nth:
            return real(parent, snap, base, **kw)
        if code == errno.ENOSPC:
            orig = fmt.write_part

            def full(path: Path, *args: Any) -> Any:
                if not path.name.startswith("optimizer"):
                    return orig(path, *args)  # the weights fit
                path.write_bytes(b"\0" * 512)  # what fit before the disk filled up
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

            fmt.write_part = full
            try:
                return real(parent, snap, base, **kw)
            finally:
                fmt.write_part = orig
        orig_fsync = fmt.fsync_file

        def failing(path: Path) -> None:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

        fmt.fsync_file = failing
        try:
            return real(parent, snap, base, **kw)
        finally:
            fmt.fsync_file = orig_fsync

    return write_checkpoint_dir


def _log_writes(cls: Any, publog: Path) -> None:
    from spotrun.trainer.preemption.lease import needs_lease

    def note(op: str, key: str) -> None:
        if not needs_lease(key):
            return
        line = json.dumps({"pid": os.getpid(), "op": op, "key": key}) + "\n"
        fd = os.open(publog, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one write with O_APPEND: lines from processes never tear
        finally:
            os.close(fd)

    put, delete = cls.put, cls.delete

    def logged_put(self: Any, key: str, src: Path) -> None:
        note("put", key)
        put(self, key, src)

    def logged_delete(self: Any, keys: Any) -> None:
        for k in keys:
            note("delete", k)
        delete(self, keys)

    cls.put, cls.delete = logged_put, logged_delete


def _log_resumes(where: dict[str, str]) -> None:
    from bench.chaos_checks import newest_verified
    from spotrun.trainer.storage.options import S3Options
    from spotrun.trainer.storage.s3 import S3Storage, make_s3_client
    from spotrun.trainer.telemetry.records import Started
    from spotrun.trainer.telemetry.status import StatusReporter

    opts = S3Options(endpoint_url=where["endpoint"])
    direct = S3Storage(make_s3_client(opts), where["bucket"], where["prefix"], opts)
    report = StatusReporter.report

    def logged_report(self: Any, rec: Any) -> None:
        if isinstance(rec, Started):
            # read now, with the lease held: a trainer started at a notice waits while the one it
            # replaces trains on and checkpoints (trainer/preemption/handover.py); what it must resume from is
            # the newest checkpoint when it took over, not when its process started
            expected = newest_verified(direct, Path(where["cache"]) / str(os.getpid()))
            line = json.dumps({"pid": os.getpid(), "resumed_from": rec.resumed_from, "expected": expected})
            with open(where["log"], "a") as f:
                f.write(line + "\n")
        report(self, rec)

    StatusReporter.report = logged_report  # type: ignore[method-assign]
