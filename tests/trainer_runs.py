"""Run `python -m spotrun.trainer` in subprocesses and read back what it produced: shared by the e2e tests.

The trainers fork from a fork server (trainer/launch/zygote.py), as the local provider's do by default: a
fresh `python -m spotrun.trainer` spends ~2.3 s of CPU in `import torch` and `torch._dynamo` before its first
step, and these helpers start about a hundred trainers in the suite (most of them references and killed
attempts). Where no server can start, the trainer starts as a fresh process, as the provider's would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import torch
import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]


def write_spec(path: Path, **overrides: Any) -> Path:
    """A small digits job (dropout and noise on, so RNG restore matters), checkpointing every 7 steps."""
    spec: dict[str, Any] = {
        "name": "exact",
        "recipe": "digits",
        "args": {"hidden": 64, "dropout": 0.1, "noise": 0.1},
        "total_steps": 100,
        "batch_size": 64,  # 1797 samples -> 28 batches per epoch
        "seed": 7,
        "threads": 1,
        "num_workers": 0,
        "checkpoint": {"every_steps": 7, "keep": 2},
        "log_every": 50,
    }
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(spec.get(k), dict):
            spec[k] = {**spec[k], **v}
        else:
            spec[k] = v
    path.write_text(yaml.safe_dump(spec))
    return path


class Trainer:
    """A `python -m spotrun.trainer ARGS` process, forked or fresh, its output drained by threads (a pipe
    nobody reads would block a trainer that logs more than 64 KB)."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path) -> None:
        from spotrun.tasks.providers.local import fork_server

        try:
            server = fork_server.server_for(sys.executable, env)
            self.proc: Any = server.spawn("spotrun.trainer", args, env, str(cwd))
        except fork_server.ForkServerUnavailable:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spotrun.trainer", *args],
                cwd=cwd,
                env=env,
                text=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        self.pid: int = self.proc.pid
        self._out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._drains = [self._drain(self.proc.stdout, "stdout"), self._drain(self.proc.stderr, "stderr")]

    def _drain(self, pipe: IO[str], name: str) -> threading.Thread:
        def read() -> None:
            with pipe:
                self._out[name].append(pipe.read())

        t = threading.Thread(target=read, daemon=True)
        t.start()
        return t

    def poll(self) -> int | None:
        exited = self.proc.exited() if hasattr(self.proc, "exited") else self.proc.poll() is not None
        return self.proc.wait() if exited else None

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; past `timeout` the trainer's session is killed and TimeoutExpired raised."""
        try:
            rc: int = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait()
            raise
        for t in self._drains:
            t.join()
        return rc

    def result(self, cmd: list[str], timeout: float | None) -> subprocess.CompletedProcess[str]:
        rc = self.wait(timeout)
        out, err = ("".join(self._out[k]) for k in ("stdout", "stderr"))
        return subprocess.CompletedProcess(cmd, rc, out, err)


def trainer(
    config: Path,
    storage: str,
    workdir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """One attempt, to completion or death."""
    args = ["--config", str(config), "--storage", storage]
    args += ["--metrics", str(workdir / "metrics.jsonl"), "--cache", str(workdir / "cache"), *extra]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return Trainer(args, full_env, workdir).result([sys.executable, "-m", "spotrun.trainer", *args], timeout)


def trainer_killed_after(
    config: Path,
    storage: str,
    workdir: Path,
    lines: int,
    *,
    sig: signal.Signals,
    timeout: float = 120,
    group: bool = False,
) -> int:
    """Start an attempt and send `sig` once the metrics file holds `lines` more lines: a kill at an
    arbitrary instant (mid-step, mid-save, mid-upload), not at a step boundary. With `group`, the
    signal goes to the whole process group, as a container runtime sends it. Returns the exit code."""
    metrics = workdir / "metrics.jsonl"
    start = _count_lines(metrics)
    args = ["--config", str(config), "--storage", storage, "--metrics", str(metrics)]
    proc = Trainer(
        [*args, "--cache", str(workdir / "cache")], {**os.environ, "PYTHONPATH": str(REPO)}, workdir
    )
    deadline = time.monotonic() + timeout
    while _count_lines(metrics) - start < lines and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    if proc.poll() is None:
        # a trainer has its own session (forked ones always do): the group is the trainer's alone
        with contextlib.suppress(ProcessLookupError):
            (os.killpg if group else os.kill)(proc.pid, sig)
    return proc.wait(timeout=timeout)


def _count_lines(p: Path) -> int:
    try:
        return p.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def losses(workdir: Path) -> dict[int, str]:
    """Per-step losses (float.hex); a resumed attempt's value overwrites the dead attempt's."""
    out: dict[int, str] = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def final_state(ckpt_dir: Path) -> tuple[dict[str, torch.Tensor], Any]:
    model = load_file(str(ckpt_dir / "model.safetensors"))
    opt = torch.load(ckpt_dir / "optimizer.pt", weights_only=True)["state"]
    return model, opt


def assert_states_equal(a: Path, b: Path) -> None:
    """Bitwise: every parameter and every optimizer state tensor."""
    (ma, oa), (mb, ob) = final_state(a), final_state(b)
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), f"parameter {k} differs"
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for idx, st in oa["state"].items():
        for name, t in st.items():
            assert torch.equal(t, ob["state"][idx][name]), f"optimizer state {idx}/{name} differs"


def sharded_state(ckpt_dir: Path, scratch: Path) -> dict[str, Any]:
    """A format-2 checkpoint as one flat dict: DCP's model and optimizer gathered into one file
    (no process group needed), plus the scheduler and the trainer's data position."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{ckpt_dir.parent.name}-{ckpt_dir.name}.pt"
    dcp_to_torch_save(ckpt_dir, out)
    state = _flatten(torch.load(out, weights_only=False))
    state["/scheduler"] = torch.load(ckpt_dir / "scheduler.pt", weights_only=True)["state"]
    state["/position"] = torch.load(ckpt_dir / "trainer.pt", weights_only=True)["state"]["position"]
    return state


def _flatten(obj: Any, path: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, sub in obj.items() for k, v in _flatten(sub, f"{path}/{key}").items()}
    return {path: obj}


def assert_sharded_equal(a: Path, b: Path, scratch: Path) -> None:
    """Bitwise, for format 2: every parameter, every optimizer state tensor, scheduler, data position."""
    sa, sb = sharded_state(a, scratch), sharded_state(b, scratch)
    assert sa.keys() == sb.keys()
    assert any(k.startswith("/model/") for k in sa) and any(k.startswith("/optimizer/state/") for k in sa)
    for k, v in sa.items():
        same = torch.equal(v, sb[k]) if isinstance(v, torch.Tensor) else v == sb[k]
        assert same, f"{k} differs"
