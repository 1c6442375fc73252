"""Every process spotrun starts to run its own code is `python -P -m MODULE` (trainer/interpreter.py): the
local provider's trainer, the fork server, the checkpoint writer, a fresh torchrun and its ranks, EC2's user
data. The commands are read where they are built (the start itself replaced); one real start shows that a
user's `trainer.py` in the working directory is the user's `trainer`, beside spotrun's `spotrun.trainer`,
and that modules beside it and on PYTHONPATH import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import spotrun.trainer
from spotrun.tasks.providers.aws import launch
from spotrun.tasks.providers.local import LocalProvider, LocalProviderConfig, fork_server
from spotrun.trainer.interpreter import child_env, python_m, worker_path
from spotrun.trainer.launch.start import fresh_agent_args
from spotrun.trainer.saving import writer_proc
from spotrun.trainer.spec.job import load_spec


class Started(Exception):
    """Raised by a stand-in for the start: the command was recorded, nothing ran."""


def test_python_m_is_dash_p_dash_m() -> None:
    assert python_m("spotrun.trainer", "--config", "j") == [
        sys.executable,
        "-P",
        "-m",
        "spotrun.trainer",
        "--config",
        "j",
    ]
    assert python_m("m", python="/opt/py") == ["/opt/py", "-P", "-m", "m"]


def test_a_local_worker_starts_with_dash_p_in_an_explicit_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: j\nrecipe: digits\ntotal_steps: 1\nstorage: {tmp_path / 'store'}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/from/env")
    seen: dict[str, Any] = {}

    def start(self: Any, cmd: list[str], module: str, args: list[str], env: dict[str, str], cwd: Path) -> Any:
        seen.update(cmd=cmd, module=module, args=args, env=env, cwd=cwd)
        raise Started

    monkeypatch.setattr(LocalProvider, "_start", start)
    provider = LocalProvider(LocalProviderConfig(workdir=str(tmp_path / "work"), python="/opt/py"))
    with pytest.raises(Started):
        provider.provision(load_spec(spec), 1, spec, ["--max-steps", "3"])
    assert seen["cmd"] == python_m("spotrun.trainer", *seen["args"], python="/opt/py")
    assert seen["cmd"][:4] == ["/opt/py", "-P", "-m", "spotrun.trainer"] and "--max-steps" in seen["args"]
    assert seen["cwd"] == tmp_path
    # the directory (a loop beside the job file), then the environment's own; spotrun is installed
    path = seen["env"]["PYTHONPATH"].split(os.pathsep)
    assert path == [str(tmp_path), "/from/env"]


def test_the_fork_server_and_its_children_are_dash_p(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def popen(cmd: list[str], env: dict[str, str], fd: int) -> Any:
        seen.append(cmd)
        raise Started

    monkeypatch.setattr(fork_server, "_popen", popen)
    with pytest.raises(Started):
        fork_server.ForkServer("/opt/py", {}, preload=("torch",))
    assert seen[0][:4] == ["/opt/py", "-P", "-m", "spotrun.trainer.launch.zygote"] and seen[0][-1] == "torch"


def test_the_checkpoint_writer_is_dash_p(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def popen(cmd: list[str], **kw: Any) -> Any:
        seen.update(cmd=cmd, **kw)
        raise Started

    monkeypatch.setattr(writer_proc.subprocess, "Popen", popen)
    with pytest.raises(Started):
        writer_proc.WriterProcess(None, None, tmp_path, 1)  # type: ignore[arg-type]
    assert seen["cmd"][:4] == [sys.executable, "-P", "-m", "spotrun.trainer.saving.writer_proc"]
    assert seen["cwd"] == os.getcwd()
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == os.getcwd()


def test_a_fresh_torchrun_and_its_ranks_are_dash_p() -> None:
    """torchrun's `-m` would start each rank as `python -u -m spotrun.trainer`: `--no-python` gets ours
    instead, as torchrun's own parser reads it."""
    from torch.distributed.run import parse_args

    torchrun = ["--nproc_per_node=2", "--nnodes=1", "--rdzv_backend=static"]
    cmd = fresh_agent_args(torchrun, ["--config", "job.yaml"])
    assert cmd[:4] == [sys.executable, "-P", "-m", "spotrun.trainer.distributed.agent"]
    args = parse_args(cmd[4:])
    assert args.no_python and not args.module and not args.run_path
    assert [args.training_script, *args.training_script_args] == python_m(
        "spotrun.trainer", "--config", "job.yaml"
    )


def test_ec2_user_data_starts_the_trainer_with_dash_p() -> None:
    script = launch.build_user_data("name: j\n", [], python="python3", workdir="/w", job="j", attempt=1)
    assert (
        'exec "$@" python3 -P -m spotrun.trainer --config job.yaml --worker-id "$SPOTRUN_WORKER_ID"' in script
    )


def test_a_trainer_py_in_the_directory_is_the_users_beside_spotruns(tmp_path: Path) -> None:
    """A real start through the helper, as a worker's: in a directory holding a user's `trainer.py`, with
    the entry point's module in another directory on PYTHONPATH. `import trainer` is the user's module,
    `spotrun.trainer` is spotrun's; the module elsewhere and a module beside the `trainer.py` both import."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    (here / "trainer.py").write_text("OWNER = 'user'\n")
    (here / "beside_7c1.py").write_text("VALUE = 'beside'\n")
    (elsewhere / "loop_7c1.py").write_text(
        "import beside_7c1, trainer, spotrun.trainer.interpreter\n"
        "print(trainer.__file__, trainer.OWNER, spotrun.trainer.__file__, beside_7c1.VALUE, __name__)\n"
    )
    env = child_env({"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(elsewhere)}, cwd=here)
    done = subprocess.run(
        python_m("loop_7c1"), cwd=here, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    ours = spotrun.trainer.__file__
    assert done.stdout.split() == [str(here / "trainer.py"), "user", ours, "beside", "__main__"]


def test_the_worker_path_is_the_directory_then_pythonpath(tmp_path: Path) -> None:
    assert worker_path(tmp_path, f"/a{os.pathsep}{tmp_path}") == [str(tmp_path), "/a"]
    assert worker_path(None, None) == []
    assert child_env({"X": "1"}, cwd=tmp_path) == {"X": "1", "PYTHONPATH": str(tmp_path)}
