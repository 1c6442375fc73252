"""docs/recipes.md's complete recipe, as printed there: it trains, refuses a bad arg in one line, and a
run killed mid-way resumes bitwise equal to an uninterrupted one (parameters, optimizer state, the EMA
kept as extra state, every per-step loss)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import yaml

from spotrun.trainer.checkpoint.format import step_dir
from tests.trainer_runs import REPO, assert_states_equal, trainer

DOC = REPO / "docs" / "recipes.md"
STEPS = 90  # 1,000 points / 64 per batch = 15 steps an epoch: six epochs, the kill in the third


def recipe_source() -> str:
    text = DOC.read_text()
    section = text.split("## A complete recipe", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/recipes.md lost its complete recipe"
    return blocks[0]


def job(tmp_path: Path, **args: object) -> Path:
    pkg = tmp_path / "src" / "myrecipes"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ridge.py").write_text(recipe_source())
    spec = {
        "name": "ridge",
        "recipe": "myrecipes.ridge:build",
        "args": {"width": 16, **args},
        "total_steps": STEPS,
        "threads": 1,
        "seed": 3,
        "checkpoint": {"every_steps": 10, "keep": 2},
    }
    path = tmp_path / "ridge.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def env(tmp_path: Path) -> dict[str, str]:
    return {"PYTHONPATH": f"{REPO}:{tmp_path / 'src'}"}


def losses(metrics: Path) -> dict[int, str]:
    import json

    out: dict[int, str] = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]  # a replayed step overwrites the dead attempt's value
    return out


def test_the_documented_recipe_resumes_bitwise(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir(), run.mkdir()
    cfg = job(tmp_path)
    done = trainer(cfg, str(ref / "store"), ref, env=env(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    killed = trainer(cfg, str(run / "store"), run, "--inject-fault", "sigkill@37", env=env(tmp_path))
    assert killed.returncode != 0
    resumed = trainer(cfg, str(run / "store"), run, env=env(tmp_path))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    found = re.search(r"resuming from step (\d+)", resumed.stderr)  # 30, or 20 while 30 was in flight
    assert found is not None and 0 < int(found.group(1)) < 37, resumed.stderr[-2000:]
    a, b = run / "store" / step_dir(STEPS), ref / "store" / step_dir(STEPS)
    assert_states_equal(a, b)
    ema_a = torch.load(a / "extra.ema.pt", weights_only=True)
    ema_b = torch.load(b / "extra.ema.pt", weights_only=True)
    assert all(torch.equal(ema_a["state"]["shadow"][k], v) for k, v in ema_b["state"]["shadow"].items())
    assert losses(run / "metrics.jsonl") == losses(ref / "metrics.jsonl")
    assert len(losses(ref / "metrics.jsonl")) == STEPS


def test_the_documented_recipe_refuses_a_bad_arg_in_one_line(tmp_path: Path) -> None:
    r = trainer(job(tmp_path, width=0), str(tmp_path / "store"), tmp_path, env=env(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "width 0 must be >= 1" in r.stderr and "Traceback" not in r.stderr
