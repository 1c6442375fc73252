"""`python -m spotrun.trainer` for a job with a `distributed` spec: this machine's ranks under torchrun.

The process the provider started stays the worker's one voice: it runs `python -P -m
torch.distributed.run ... --no-python python -P -m spotrun.trainer <the same arguments>` (through
trainer/distributed/agent.py, which only silences torchrun's closing traceback; `-P`:
trainer/interpreter.py), relays rank 0's status records on its
own stdout (and to the storage heartbeat), and ends with one `exit` record whose code combines
every rank's. torchrun's own exit code says little: it returns 1 on SIGTERM though every worker
exited cleanly (measured, torch 2.13), and 1 for any failed rank. So each rank writes its exit code
and error to `$SPOTRUN_RANK_EXITS/rank<R>.json` before it leaves, and `combine` decides.

Signals: the provider signals this process's group; torchrun runs in a group of its own, so the
SIGTERM reaches it once, from here, and it forwards it to every rank (0.02-0.15 s, measured).
torchrun starts each rank in a new session, out of reach of a session-wide SIGKILL; each rank
therefore asks the kernel for SIGKILL when torchrun dies (`die_with_agent`), and torchrun gets the
same when this process dies: no rank outlives its worker.

Start-up: on CPU (gloo) torchrun and its ranks are forked from this process, which has imported torch
and the training stack already, instead of started as fresh interpreters: the agent runs torchrun's own
CLI with `--run-path trainer/rank.py --start-method fork`, after importing torch._dynamo once for all the
ranks. A fresh agent and two fresh ranks spent ~8 s of CPU in imports before the first step (torch
1.9 s and torch._dynamo 1.25 s each, on a 2-core VM), which every reclaim paid again. On CUDA the ranks
stay fresh processes: a process may not use CUDA after a fork from one that initialized it, and
`device: auto` asks CUDA whether it is there. SPOTRUN_RANK_START=exec forces fresh processes anywhere.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

from spotrun.trainer.distributed.rendezvous import LOOPBACK, STORE_FD
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.interpreter import child_env, python_m
from spotrun.trainer.parent_death import arm_pdeathsig, die_with
from spotrun.trainer.preemption.requests import StopRequest
from spotrun.trainer.spec.job import DistributedOptions
from spotrun.trainer.telemetry.records import Exit
from spotrun.trainer.telemetry.status import StatusReporter, parse_status_line

log = logging.getLogger(__name__)

RANK_EXITS = "SPOTRUN_RANK_EXITS"  # where ranks leave their exit codes (set by the launcher)
LAUNCHER_ID = "SPOTRUN_LAUNCHER_ID"  # the worker's identity, for rank 0's storage lease
NODE_RANK = "SPOTRUN_NODE_RANK"  # multi-node: this machine's index (the provider sets it)
MASTER_ADDR = "SPOTRUN_MASTER_ADDR"  # multi-node: the first machine's address
RANK_START = "SPOTRUN_RANK_START"  # "exec": fresh rank processes even on CPU (what CUDA jobs get)

# A rank's own verdict outranks a peer's crash: a rank that cannot load the checkpoint, or finds the
# lease held, ends the attempt with that reason, while its peers only see their collectives break.
_FATAL = (ExitCode.CONFIG_ERROR, ExitCode.DIVERGED, ExitCode.LEASE_HELD, ExitCode.LEASE_LOST)


def under_torchrun(env: Mapping[str, str]) -> bool:
    """Is this process a rank that torchrun started (rather than the command a provider ran)?"""
    return "TORCHELASTIC_RUN_ID" in env and "LOCAL_RANK" in env


@dataclass(frozen=True)
class RankExit:
    """What one rank left behind as it exited."""

    rank: int
    code: ExitCode
    error: str = ""
    step: int | None = None
    durable_step: int | None = None


def combine(exits: Mapping[int, RankExit], expected: Sequence[int]) -> tuple[ExitCode, str]:
    """One exit code for this machine from its ranks' (`expected`: their global ranks; a missing one
    died without a word).

    A fatal verdict from any rank wins (the lowest rank's); then a rank that died or crashed makes
    the attempt CRASHED; otherwise the ranks agree (they stop at the same step), and the lowest speaks."""
    for r in sorted(exits):
        if exits[r].code in _FATAL:
            return exits[r].code, f"rank {r}: {exits[r].error}" if exits[r].error else f"rank {r}"
    missing = [r for r in expected if r not in exits]
    if missing:
        return ExitCode.CRASHED, f"rank {missing[0]} died without an exit record (killed?)"
    crashed = [r for r in sorted(exits) if exits[r].code is ExitCode.CRASHED]
    if crashed:
        return ExitCode.CRASHED, f"rank {crashed[0]}: {exits[crashed[0]].error}"
    codes = {e.code for e in exits.values()}
    if len(codes) > 1:
        detail = ", ".join(f"rank {r} {exits[r].code.name}" for r in sorted(exits))
        return ExitCode.CRASHED, f"ranks disagree on how the attempt ended: {detail}"
    first = exits[min(exits)]
    return first.code, first.error


def write_rank_exit(directory: str, e: RankExit) -> None:
    """A rank's last act: its verdict, where the launcher reads it (tmp + rename: never half a file)."""
    path = Path(directory) / f"rank{e.rank}.json"
    tmp = path.with_suffix(".tmp")
    body = {"code": int(e.code), "error": e.error, "step": e.step, "durable_step": e.durable_step}
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


def read_rank_exits(directory: Path) -> dict[int, RankExit]:
    found: dict[int, RankExit] = {}
    for p in directory.glob("rank*.json"):
        try:
            rank, body = int(p.stem[4:]), json.loads(p.read_text())
            found[rank] = RankExit(
                rank=rank,
                code=ExitCode(int(body["code"])),
                error=str(body.get("error", "")),
                step=body.get("step"),
                durable_step=body.get("durable_step"),
            )
        except (ValueError, KeyError, TypeError):
            continue  # unreadable: that rank counts as missing
    return found


def resolve_nproc(opts: DistributedOptions) -> int:
    if isinstance(opts.nproc_per_node, int):
        return opts.nproc_per_node
    try:
        import torch

        return max(torch.cuda.device_count(), 1)
    except ImportError:  # pragma: no cover - the trainer always has torch
        return 1


def node_rank(env: Mapping[str, str]) -> int:
    return int(env.get(NODE_RANK, "0"))


def torchrun_args(
    opts: DistributedOptions, nproc: int, env: Mapping[str, str], store_port: int = 0
) -> list[str]:
    """torchrun's arguments for this machine: a static rendezvous at the first machine's address with
    this machine's `--node_rank`. Static, not c10d: c10d orders machines by host name and pid, so global
    rank 0 (the one that holds the lease and speaks) landed on the second machine in 3 of 6 rehearsals
    (measured); static pins rank = node x nproc + local rank, and each rank's data shard and RNG file
    follow its global rank across attempts. One node: the store on 127.0.0.1:`store_port`, served from
    a socket bound there (`loopback_listener`): torchrun's `--standalone` store listens on every
    interface, where anyone on the network could write the job's rendezvous keys."""
    args = [f"--nproc_per_node={nproc}", "--max_restarts=0", "--monitor_interval=0.5"]
    if opts.nnodes == 1:
        addr, port, rank = LOOPBACK, store_port, 0
    else:
        addr, port, rank = env.get(MASTER_ADDR, LOOPBACK), opts.port, node_rank(env)
    return [
        *args,
        f"--nnodes={opts.nnodes}",
        f"--node_rank={rank}",
        "--rdzv_backend=static",
        f"--master_addr={addr}",
        f"--master_port={port}",
    ]


def loopback_listener() -> socket.socket:
    """A listening socket on 127.0.0.1 and a free port, for a one-node job's store
    (trainer/distributed/agent.py serves it: a TCPStore of its own would bind every interface)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((LOOPBACK, 0))
    s.listen(128)
    return s


def fork_ranks(on_cpu: bool, env: Mapping[str, str], threads: Sequence[str]) -> tuple[bool, str]:
    """Whether torchrun and its ranks fork from this process, and why not where a fork was wanted."""
    if not on_cpu or env.get(RANK_START, "fork") == "exec":
        return False, ""
    if threads:
        return False, f"threads running ({', '.join(threads)})"
    return True, ""


@dataclass
class Launched:
    """This machine's ranks, started: torchrun's process and what `relay` needs to end the attempt."""

    proc: subprocess.Popen[str] | ForkedAgent
    exits: Path  # where the ranks leave their exit records
    mine: list[int]  # their global ranks
    previous: dict[int, Any]  # the signal handlers forwarding replaced


def start_ranks(
    opts: DistributedOptions,
    argv: list[str],
    threads: int | None,
    *,
    launcher_id: str,
    stop: StopRequest,
    fork: bool = False,
    private: int | None = None,
) -> Launched:
    """Start torchrun on this machine's ranks; SIGTERM/SIGINT here are forwarded to it from now on.
    With `fork` (the ranks train on CPU) torchrun is forked from this process, which must not have
    started a Python thread yet: a child forked while another thread held a lock inherits it held
    (measured: torchrun hung in `import` on a module lock the heartbeat thread held at the fork). Where
    one runs after all, torchrun starts as a fresh process instead. (torchrun's own second fork, of the
    ranks, happens beside its rendezvous keep-alive timer, whose first tick comes ~5 s later.)
    `private`: a descriptor of this process that torchrun and the ranks must not hold (the status
    stream the supervisor reads to EOF); a fresh torchrun never inherits one."""
    nproc = resolve_nproc(opts)
    world = nproc * opts.nnodes
    mine = [node_rank(os.environ) * nproc + local for local in range(nproc)]  # static rendezvous
    exits = Path(tempfile.mkdtemp(prefix="spotrun-ranks-"))
    cwd = os.getcwd()
    env = {k: v for k, v in child_env(cwd=cwd).items() if k != "SPOTRUN_WORKER_ID"}  # the heartbeat is ours
    # torchrun pins OMP_NUM_THREADS=1 unless it is set; the thread count is part of exactness
    env |= {RANK_EXITS: str(exits), LAUNCHER_ID: launcher_id, "OMP_NUM_THREADS": str(threads or 1)}
    env.setdefault("PYTHONUNBUFFERED", "1")
    listener = loopback_listener() if opts.nnodes == 1 else None
    if listener is not None:  # one node: the store and the collectives' sockets on loopback only
        env[STORE_FD] = str(listener.fileno())
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    torchrun = torchrun_args(opts, nproc, os.environ, listener.getsockname()[1] if listener else 0)
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    forked, why = fork_ranks(fork, os.environ, others)
    if why:
        log.warning("%s: starting torchrun as a fresh process, not forked", why)
    how = "forked" if forked else "fresh"
    log.info("launching %d %s rank(s) on this machine (world size %d)", nproc, how, world)
    proc: subprocess.Popen[str] | ForkedAgent
    try:
        if forked:
            proc = ForkedAgent.start([*torchrun, *FORK_ARGS, RANK_SCRIPT, *argv], env, private)
        else:
            proc = subprocess.Popen(
                fresh_agent_args(torchrun, argv),
                cwd=cwd,
                stdout=subprocess.PIPE,
                text=True,
                errors="replace",
                env=env,
                process_group=0,
                preexec_fn=arm_pdeathsig,
                pass_fds=(listener.fileno(),) if listener else (),
            )
    finally:
        if listener is not None:
            listener.close()  # the agent holds its own copy
    return Launched(proc, exits, mine, _forward_signals(proc.pid, stop))


def fresh_agent_args(torchrun: Sequence[str], argv: Sequence[str]) -> list[str]:
    """A fresh torchrun (trainer/distributed/agent.py) whose ranks run `python -P -m spotrun.trainer ARGV`:
    torchrun's own `-m` would start them as `python -u -m spotrun.trainer`, the working directory first on
    their path, so `--no-python` hands it the whole command instead (stdout unbuffered: PYTHONUNBUFFERED)."""
    return python_m(
        "spotrun.trainer.distributed.agent", *torchrun, "--no-python", *python_m("spotrun.trainer", *argv)
    )


def relay(launched: Launched, reporter: StatusReporter) -> tuple[ExitCode, str]:
    """Relay rank 0's status records until torchrun exits; returns the combined exit code and error."""
    proc = launched.proc
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            rec = parse_status_line(line)
            if rec is None:
                sys.stdout.write(line)
            elif not isinstance(rec, Exit):  # the exit record is this process's to write
                reporter.report(rec)
        rc = proc.wait()
    finally:
        for sig, handler in launched.previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(ProcessLookupError):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    ranks = read_rank_exits(launched.exits)
    shutil.rmtree(launched.exits, ignore_errors=True)
    code, error = combine(ranks, launched.mine)
    if ranks and ranks[min(ranks)].step is not None:
        reporter.last_step = ranks[min(ranks)].step
    log.info(
        "torchrun exited %d; ranks: %s -> %s",
        rc,
        {r: e.code.name for r, e in sorted(ranks.items())},
        code.name,
    )
    return code, error


def _forward_signals(pid: int, stop: StopRequest) -> dict[int, Any]:
    """SIGTERM/SIGINT here -> the same signal to torchrun (its own process group), once each."""

    def forward(signum: int, frame: FrameType | None) -> None:
        stop.notice(signal.Signals(signum).name)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    previous: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, forward)
    return previous


def die_with_agent() -> None:
    """In a rank: SIGKILL me when torchrun dies (it started me in a session of my own, which a
    worker-wide SIGKILL does not reach). If it is already gone, go now."""
    if not sys.platform.startswith("linux"):
        return
    die_with(os.getppid(), int(ExitCode.CRASHED))


RANK_SCRIPT = str(Path(__file__).parents[1] / "rank.py")
FORK_ARGS = ("--start-method=fork", "--run-path")


class ForkedAgent:
    """torchrun forked from this process (the launcher's side): its pid, its stdout, its exit code.

    The child takes its own process group (a provider's signal to the worker's group reaches torchrun
    once, from here, as for a fresh agent), SIGKILL on this process's death, the ranks' environment,
    stdout into a pipe and default signal handlers, then runs torchrun's CLI; it never returns."""

    def __init__(self, pid: int, stdout: IO[str]) -> None:
        self.pid, self.stdout = pid, stdout
        self.returncode: int | None = None

    @classmethod
    def start(cls, args: list[str], env: Mapping[str, str], private: int | None = None) -> ForkedAgent:
        r, w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # what is buffered now would be written twice
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child; measured through the distributed tests
            code = 1
            try:
                os.close(r)
                if private is not None and private > 2:
                    os.close(private)  # its Python file object is never closed here: no double close
                os.setpgid(0, 0)
                die_with(parent, int(ExitCode.CRASHED))
                os.dup2(w, 1)
                os.close(w)
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                os.environ.clear()
                os.environ.update(env)
                from spotrun.trainer.distributed.agent import run_forked

                code = run_forked(args)
            except BaseException:  # the child's boundary: say why, never return into the parent's stack
                import traceback

                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        os.close(w)
        return cls(pid, os.fdopen(r, "r", errors="replace"))

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        self.stdout.close()
        return self.returncode
