"""A fork server for trainers: import torch and the training stack once, then fork one trainer per request.

A trainer started as a fresh process spends most of its start in imports: on a 2-core VM `import torch`
took 1.9 s and `torch._dynamo` (which every optimizer's first `step()` imports) 1.25 s, out of a 3.2 s
cold start (measured with -X importtime). A worker reclaimed without notice pays that again before its
replacement trains one step. Forked from this server, a trainer starts with both already imported.

`python -P -m spotrun.trainer.launch.zygote FD MODULES`: FD is this end of a SOCK_SEQPACKET socketpair,
MODULES a comma list to import before serving. One JSON object per packet:

    <- {"op": "ready", "preload_s": S}                      once, after the imports
    -> {"op": "spawn", "id": N, "module": M, "argv": [...], "env": {...}, "cwd": D}   + 2 fds (stdout, stderr)
    <- {"op": "spawned", "id": N, "pid": P}  or  {"op": "spawned", "id": N, "error": "..."}
    <- {"op": "exited", "pid": P, "returncode": RC}        Popen's convention: -SIG when killed by a signal
    -> {"op": "reap", "pid": P}                             the child stays a zombie until then, so that its
                                                            pid (its session's id) is not reused before the
                                                            provider has killed what is left of the session
    <- {"op": "reaped", "pid": P}

A child is what `python -P -m M ARGV` would have been (trainer/interpreter.py): its own session,
PR_SET_PDEATHSIG=SIGKILL tied to this server (which has the same tie to the provider's process, so a
controller that dies still takes its trainers along), stdin from /dev/null, the request's stdout, stderr,
environment, working directory and argv, and default signal handlers. Its sys.path is the server's:
PYTHONPATH's entries, never the working directory. What a process fixes at start-up (sys.flags, stdio
buffering, PYTHONPATH, how many OpenMP threads, their wait policy) is the same by construction: the
client keeps one server per interpreter and load-time environment (tasks/providers/local/fork_server.py).

The server runs in its own session and ignores SIGINT and SIGTERM: a Ctrl-C in the terminal or a
cancel's SIGTERM is the controller's to handle (it stops its trainers gracefully, and they save); the
server's death would SIGKILL every trainer at once. It exits when the client's end of the socket closes.
This module never imports torch itself: what it imports is MODULES.

`--pool LISTEN_FD SOCKET LOCK IDLE_S PYTHON MODULES` serves a trainer pool (trainer/launch/pool.py):
every controller that connects to the listening socket is a client as above, with `pid` and `key` (its
load key) in its `ready` packet; a client whose connection closes takes its running children along
(SIGKILL to their sessions), so a trainer still never outlives its controller. It also answers
`-> {"op": "stop"}` with `<- {"op": "stopping", "trainers": N}`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spotrun.trainer.interpreter import spotrun_version
from spotrun.trainer.launch.pool import Pool, kill_session, peer_refusal, peer_uid
from spotrun.trainer.parent_death import arm_pdeathsig

PR_SET_NAME = 15
MAX_PACKET = 1 << 20  # a request is argv + environment: a few KB
LOAD_TIME_PREFIXES = (
    "PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_", "LANG", "LC_",
    "TORCH", "PYTORCH_", "CUDA_",
)  # fmt: skip  # a packed list of names, grouped by purpose
LoadKey = tuple[str, tuple[tuple[str, str], ...]]
VERSION_KEY = "spotrun version"  # in a load key beside the variables: no variable has a space


@dataclass(frozen=True)
class Request:
    module: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    stdout: int
    stderr: int


def load_key(python: str, env: Mapping[str, str]) -> LoadKey:
    """What a child's start-up depends on: the interpreter, spotrun's version (a pool's server outlives
    the job that started it, and would fork the code of before an upgrade) and the load-time variables
    (those a process reads once at start-up: `PYTHON*`, OpenMP's and BLAS's thread settings, `LD_*`,
    locale, torch's import-time switches)."""
    loaded = ((k, v) for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES))
    return python, tuple(sorted([*loaded, (VERSION_KEY, spotrun_version())]))


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    first: list[socket.socket] = []
    pool: Pool | None = None
    if argv and argv[0] == "--pool":  # --pool LISTEN_FD SOCKET LOCK IDLE_S PYTHON MODULES
        listener = socket.socket(fileno=int(argv[1]))
        # the key of the environment it was given: the imports below change os.environ (torch._dynamo
        # sets TORCHINDUCTOR_CACHE_DIR), and a key read after them would match no client's
        pool = Pool(listener, argv[2], argv[3], idle_s=float(argv[4]), key=load_key(argv[5], os.environ))
        argv = argv[6:]
        if os.fork() > 0:  # the starter waits for this exit: from here on the server is nobody's child
            os._exit(0)
    else:
        first.append(socket.socket(fileno=int(argv[0])))
        argv = argv[1:]
    modules = [m for m in (argv[0] if argv else "").split(",") if m]
    started = time.monotonic()
    for name in modules:
        importlib.import_module(name)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use CUDA
        why = f"importing {modules} initialized CUDA; cannot fork trainers"
        for sock in first:
            send(sock, {"op": "error", "error": why})
        return 1
    request = _Server(pool, round(time.monotonic() - started, 3)).serve(first)
    if request is None:
        return 0
    return _run(request)  # in a child: what `python -m MODULE` would do, exit code included


class _Server:
    """The request loop: one client (a private server) or every controller of a pool."""

    def __init__(self, pool: Pool | None, preload_s: float) -> None:
        self.pool, self.preload_s, self.pid = pool, preload_s, os.getpid()
        self.conns: dict[socket.socket, dict[int, bool]] = {}  # client -> its children: pid -> exit reported
        self.last_request = time.monotonic()
        self.stopping = False
        self.sel = selectors.DefaultSelector()

    def serve(self, first: list[socket.socket]) -> Request | None:
        """Answer requests until the client goes away or the pool ends (None), or return the request
        in a freshly forked child."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd sees SIGCHLD
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        self.sel.register(wake_r, selectors.EVENT_READ)
        if self.pool is not None and self.pool.listener is not None:
            self.sel.register(self.pool.listener, selectors.EVENT_READ)
        for sock in first:
            self._admit(sock)
        while self.pool is not None or self.conns:  # a private server's one client may be gone already
            for key, _ in self.sel.select(timeout=1.0):
                if key.fileobj == wake_r:
                    while _drain(wake_r):
                        pass
                elif self.pool is not None and key.fileobj is self.pool.listener:
                    with contextlib.suppress(OSError):  # a caller that gave up before we accepted
                        self._admit(self.pool.listener.accept()[0])
                elif isinstance(key.fileobj, socket.socket):
                    sock = key.fileobj
                    answered = self._answer(sock)
                    if isinstance(answered, Request):  # the child: leave the server's loop and its fds
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        for fd in (wake_r, wake_w):
                            os.close(fd)
                        self._leave()
                        return answered
                    if not answered:
                        if self.pool is None:
                            return None  # the client is gone: our children get SIGKILL as we exit
                        self._drop(sock)
            self._report_exits()
            if self.pool is not None and self._over(self.pool):
                return None
        return None

    def _admit(self, sock: socket.socket) -> None:
        if self.pool is not None:
            why = peer_refusal(peer_uid(sock), os.getuid())
            if why is not None:
                with contextlib.suppress(OSError):
                    send(sock, {"op": "error", "error": why})
                sock.close()
                return
        ready = {"op": "ready", "preload_s": self.preload_s, "pid": self.pid}
        if self.pool is not None:
            ready["key"] = self.pool.key
            ready["trainers"] = sum(len(c) for c in self.conns.values())
        try:
            send(sock, ready)
        except OSError:
            sock.close()
            return
        self.conns[sock] = {}
        self.sel.register(sock, selectors.EVENT_READ)

    def _answer(self, sock: socket.socket) -> Request | bool:
        """Handle one request: True, False when the client is gone, or in a forked child its request."""
        children = self.conns[sock]
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_PACKET, 2)
            if not data:
                return False
            msg = json.loads(data)
            self.last_request = time.monotonic()
            if msg["op"] == "reap":
                _reap(children, int(msg["pid"]))
                send(sock, {"op": "reaped", "pid": int(msg["pid"])})
            elif msg["op"] == "stop" and self.pool is not None:
                self.stopping = True
                self.pool.close()
                send(sock, {"op": "stopping", "trainers": sum(len(c) for c in self.conns.values())})
            elif msg["op"] == "spawn" and self.stopping:
                send(sock, {"op": "spawned", "id": msg["id"], "error": "the pool is stopping"})
                for fd in fds:
                    os.close(fd)
            elif msg["op"] == "spawn":
                pid = _fork(sock, msg, fds, self.pid)
                if pid == 0:
                    return _request(msg, fds)
                if pid > 0:
                    children[pid] = False
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def _leave(self) -> None:
        """In a forked child: close what belongs to the server."""
        self.sel.close()
        for sock in self.conns:
            sock.close()
        if self.pool is not None and self.pool.listener is not None:
            self.pool.listener.close()

    def _drop(self, sock: socket.socket) -> None:
        """A pool's client is gone: its trainers go with it, as they would with a private server."""
        self.sel.unregister(sock)
        for pid, reported in self.conns.pop(sock).items():
            if not reported:
                kill_session(pid)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        sock.close()

    def _over(self, pool: Pool) -> bool:
        """Whether a pool server ends now: no trainer left, and stopped or idle for `idle_s`."""
        if any(self.conns.values()):
            return False
        if not self.stopping and time.monotonic() - self.last_request < pool.idle_s:
            return False
        if pool.listener is not None and not pool.close_if_unasked():
            self.last_request = time.monotonic() - pool.idle_s + 1  # look again in a second
            return False
        return True

    def _report_exits(self) -> None:
        for sock, children in self.conns.items():
            with contextlib.suppress(OSError):  # a client gone: its EOF is read next
                _report_exits(sock, children)


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _fork(sock: socket.socket, msg: dict[str, Any], fds: list[int], server_pid: int) -> int:
    """Fork for one spawn request; the parent answers with the pid (or the error) and closes the fds."""
    if len(fds) != 2:
        send(
            sock,
            {"op": "spawned", "id": msg["id"], "error": f"expected 2 fds (stdout, stderr), got {len(fds)}"},
        )
        for fd in fds:
            os.close(fd)
        return -1
    sys.stdout.flush()
    sys.stderr.flush()
    settled_r, settled_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        send(sock, {"op": "spawned", "id": msg["id"], "error": f"fork failed: {e}"})
        pid = -1
    if pid == 0:
        os.close(settled_r)
        _become_child(server_pid, str(msg["module"]))
        os.close(settled_w)  # the pid is a session id now: the provider may kill the session
        return 0
    os.close(settled_w)
    for fd in fds:
        os.close(fd)
    if pid > 0:
        os.read(settled_r, 1)  # EOF once the child has its own session (or has died)
        send(sock, {"op": "spawned", "id": msg["id"], "pid": pid})
    os.close(settled_r)
    return pid


def _comm(module: str) -> bytes:
    """The process name for `module` (at most 15 bytes, the kernel's limit): `spotrun.trainer` is
    `trainer`."""
    return module.removeprefix("spotrun.").encode()[:15]


def _become_child(server_pid: int, module: str) -> None:
    """Its own session, its module's name without the package as the process name (`ps -o comm`,
    `pgrep -x trainer`; the command line stays the server's), and SIGKILL when the server dies
    (PR_SET_PDEATHSIG, Linux)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(_comm(module)), 0, 0, 0)
        arm_pdeathsig()
        if os.getppid() != server_pid:  # the server died before prctl: no signal would ever come
            os._exit(1)


def _request(msg: dict[str, Any], fds: list[int]) -> Request:
    return Request(
        str(msg["module"]),
        list(msg["argv"]),
        dict(msg["env"]),
        cwd=str(msg["cwd"]),
        stdout=fds[0],
        stderr=fds[1],
    )


def _report_exits(sock: socket.socket, children: dict[int, bool]) -> None:
    for pid, reported in list(children.items()):
        if reported:
            continue
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info, children[pid] = None, True
        if info is not None:
            rc = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            send(sock, {"op": "exited", "pid": pid, "returncode": rc})
            children[pid] = True


def _reap(children: dict[int, bool], pid: int) -> None:
    if pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        del children[pid]


def _run(req: Request) -> int:
    """In the child: become `python -P -m MODULE ARGV` with the request's stdio, environment and directory."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(req.stdout, 1)
    os.dup2(req.stderr, 2)
    for fd in {devnull, req.stdout, req.stderr} - {0, 1, 2}:
        os.close(fd)
    os.chdir(req.cwd)
    os.environ.clear()
    os.environ.update(req.env)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not sys.flags.safe_path:  # a server started without -P: what a plain `python -m` puts first
        sys.path[0] = req.cwd
    sys.argv = [req.module, *req.argv]
    # the preload imported MODULE.__main__ for what it imports; runpy runs its code afresh either way,
    # and would warn on stderr ("found in sys.modules ... unpredictable behaviour") for every trainer
    sys.modules.pop(f"{req.module}.__main__", None)
    runpy.run_module(req.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
