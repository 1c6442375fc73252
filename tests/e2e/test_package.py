"""spotrun as a user gets it: the wheel built from this tree, installed into a fresh virtual environment
outside the checkout, driving a project of the user's own that holds its own `trainer.py`, `tasks/`,
`flows/` and `utils.py` beside its loop.

The wheel holds one import package, `spotrun`; from the project's directory `import trainer` is the
user's module; `spotrun run job.yaml` with one reclaim without notice and one with notice completes and
ends bitwise equal to the same job trained without interruption; `spotrun deploy` from that directory
applies deployments that load their flows from the installed package and start their runs there. The
venv installs torch from the local CPU wheel and the rest from the index (uv's cache here: about 5 s).
A server of this module's own: `spotrun deploy` applies automations, which must not see other tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from spotrun.trainer.checkpoint.format import step_dir
from tests.prefect_server import PrefectServer
from tests.trainer_runs import assert_states_equal

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("spotrun", "trainer", "tasks", "flows", "deployments", "pyproject.toml", "README.md")
TORCH = "2.13.0"
STEPS = 1500  # 0.6 s of training before the second reclaim: reached before step 1,500 at 1,000 steps/s

# The user's project: modules named like spotrun's rooms, which the loop imports as its own.
PROJECT = {
    "trainer.py": '''"""The project's own trainer helpers (a name as common as it gets)."""
import torch.nn.functional as F


class Trainer:
    OWNER = "the user's project"

    @staticmethod
    def loss(model, x, y):
        return F.cross_entropy(model(x), y)
''',
    "tasks/__init__.py": 'REGISTRY = {"blobs": 4}  # a task registry, as fairseq and lm-eval keep one\n',
    "flows/__init__.py": '"""The project\'s own Prefect flows would live here."""\nNAME = "user-flows"\n',
    "utils.py": """import torch
from torch.utils.data import TensorDataset


def blobs(n, classes, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(classes, (n,), generator=g)
    centers = torch.randn(classes, 16, generator=torch.Generator().manual_seed(0)) * 2
    return TensorDataset(centers[y] + torch.randn(n, 16, generator=g), y)
""",
    "train.py": """import torch
from torch import nn

import spotrun
from flows import NAME
from tasks import REGISTRY
from trainer import Trainer
from utils import blobs

assert Trainer.OWNER == "the user's project" and NAME == "user-flows"


def main(args):
    classes = REGISTRY["blobs"]
    model = nn.Sequential(nn.Linear(16, args["hidden"]), nn.ReLU(), nn.Linear(args["hidden"], classes))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with spotrun.session(model=model, optimizer=opt) as s:
        for x, y in s.batches(blobs(2048, classes, seed=1)):
            opt.zero_grad(set_to_none=True)
            loss = Trainer.loss(s.model, x, y)
            loss.backward()
            opt.step()
            s.step_done(loss.item())
""",
}


def _uv() -> str:
    uv = Path(sys.executable).with_name("uv")
    if not uv.is_file():
        pytest.skip("uv is not installed beside this interpreter (make venv installs it)")
    return str(uv)


def _torch_requirement() -> str:
    """The local CPU wheel, where pip's configuration keeps local wheels (PIP_FIND_LINKS, as the Makefile
    reads it); without one the test is skipped: uv would resolve `torch==2.13.0` to a multi-GB CUDA build."""
    places = os.environ.get("PIP_FIND_LINKS", "").split()
    for place in places:
        found = sorted(Path(place.removeprefix("file://")).glob(f"torch-{TORCH}+cpu-cp311-*.whl"))
        if found:
            return str(found[0])
    pytest.skip(f"no local CPU wheel of torch {TORCH} (PIP_FIND_LINKS): a fresh venv would download CUDA's")


def _clean_env(venv: Path) -> dict[str, str]:
    """This environment as a user's shell in the venv would have it: no PYTHONPATH (nothing of the
    checkout), the venv's bin first; bytecode written (every process would otherwise compile torch)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
    }
    return env | {"PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(venv)}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, a fresh venv with it installed), built from a copy of the tracked sources."""
    uv, root = _uv(), tmp_path_factory.mktemp("package")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(
            REPO / name,
            src / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if (REPO / name).is_dir() else {}),
        )
    run = {"capture_output": True, "text": True, "timeout": 600}
    built = subprocess.run([uv, "build", "--wheel", "--out-dir", str(root / "dist"), str(src)], **run)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (root / "dist").glob("spotrun-*.whl")
    venv = root / "venv"
    made = subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], **run)
    assert made.returncode == 0, made.stderr[-2000:]
    py = str(venv / "bin" / "python")
    done = subprocess.run(
        [uv, "pip", "install", "-q", "--python", py, _torch_requirement(), str(wheel)], **run
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return wheel, venv


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    server = PrefectServer(tmp_path_factory.mktemp("prefect")).start()
    try:
        with server.clients():
            yield server
    finally:
        server.stop()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The user's project, as PROJECT lays it out."""
    root = tmp_path / "project"
    for name, text in PROJECT.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_wheel_holds_one_import_package(installed: tuple[Path, Path]) -> None:
    wheel, venv = installed
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"spotrun"}, tops
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert "spotrun/deployments/prefect.yaml" in shipped and "spotrun/deployments/jobs/digits.yaml" in shipped
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    assert not any((site / name).exists() for name in ("trainer", "tasks", "flows", "deployments"))


def test_a_users_project_runs_as_it_is_and_resumes_bitwise(
    installed: tuple[Path, Path], server: PrefectServer, project: Path, tmp_path: Path
) -> None:
    _, venv = installed
    job = {
        "name": "users-own",
        "entrypoint": "train:main",
        "args": {"hidden": 32},
        "total_steps": STEPS,
        "batch_size": 16,
        "seed": 3,
        "threads": 1,
        "log_every": 500,
        "checkpoint": {"every_steps": 50, "keep": 3},
        "tracking": {"mlflow": False},
    }
    (project / "job.yaml").write_text(yaml.safe_dump(job))
    env = _clean_env(venv) | server.env() | {"SPOTRUN_HOME": str(tmp_path / "home")}
    run = {"cwd": project, "env": env, "capture_output": True, "text": True, "timeout": 600}

    mine = subprocess.run(["python", "-c", "import trainer; print(trainer.__file__)"], **run)
    assert mine.returncode == 0 and mine.stdout.strip() == str(project / "trainer.py"), mine.stderr[-2000:]

    done = subprocess.run(["spotrun", "run", "job.yaml", "--preempt-at", "0.3:kill,0.3"], **run)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "Traceback" not in out and "shadow" not in out, out[-4000:]

    ref = subprocess.run(
        ["python", "-m", "spotrun.trainer", "--config", "job.yaml", "--storage", str(tmp_path / "reference")],
        **run,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    final = step_dir(STEPS)
    ours = tmp_path / "home" / "checkpoints" / "users-own"  # a relative storage is under SPOTRUN_HOME
    assert_states_equal(ours / final, tmp_path / "reference" / final)
    attempts = subprocess.run(["spotrun", "history", "users-own", "--json"], **run)
    assert attempts.returncode == 0, attempts.stderr[-2000:]
    outcomes = [a["outcome"] for a in yaml.safe_load(attempts.stdout)]
    assert outcomes == ["preempted", "preempted", "completed"], outcomes


def test_spotrun_deploy_works_from_the_wheel_in_any_directory(
    installed: tuple[Path, Path], server: PrefectServer, project: Path, tmp_path: Path
) -> None:
    """No checkout: the flows are the package's modules, the runs start in the directory `spotrun deploy`
    ran in, and a shipped example script is named by its path in the installed package."""
    from prefect import get_client

    _, venv = installed
    env = _clean_env(venv) | server.env() | {"SPOTRUN_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        ["spotrun", "deploy", "--json"], cwd=project, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    with get_client(sync_client=True) as client:
        training = client.read_deployment_by_name("resilient-training/resilient-training")
        example = client.read_deployment_by_name("resilient-training/transformers-example")
    assert training.entrypoint == "spotrun.flows.resilient_training:resilient_training"
    where = {"prefect.deployments.steps.set_working_directory": {"directory": str(project)}}
    assert training.pull_steps == [where]
    script = example.parameters["job"]["command"][1]
    assert script == str(site / "spotrun" / "deployments" / "jobs" / "scripts" / "hf_train.py")
