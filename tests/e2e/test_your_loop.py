"""docs/your-loop.md's loop, exactly as printed: a plain training loop (gradient accumulation, an eval pass,
an EMA in `extra`, AdamW with warm-up) in a module of its own, named by `entrypoint:`. Through the flow
(as `spotrun run` runs it) it is SIGKILLed twice and noticed once, and ends with the same parameters,
optimizer state, EMA and per-step losses as the same job trained without interruption."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from spotrun.trainer.checkpoint.format import step_dir
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.spec.job import JobSpec
from tests.e2e.test_flow import run_flow, schedule
from tests.trainer_runs import assert_sharded_equal, assert_states_equal, losses, trainer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "your-loop.md"
STEPS = 1200  # the doc's 150 steps end within the first reclaim's 0.3 s; the loop is the same


def doc_block(starts: str) -> str:
    """The fenced block of docs/your-loop.md that starts with `starts`."""
    blocks = re.findall(r"```(?:python|yaml)\n(.*?)```", DOC.read_text(), flags=re.S)
    return next(b for b in blocks if b.startswith(starts))


@pytest.fixture
def your_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The doc's module where a worker finds it (PYTHONPATH, which local workers inherit)."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "your_loop.py").write_text(doc_block('"""your_loop.py'))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(code), str(REPO)]))
    return code


def job(tmp_path: Path) -> JobSpec:
    spec: dict[str, Any] = yaml.safe_load(doc_block("name: blobs"))
    spec |= {"total_steps": STEPS, "checkpoint": {"every_steps": 100, "keep": 3}, "log_every": 400}
    return JobSpec.model_validate(spec | {"storage": str(tmp_path / "store"), "tracking": {"mlflow": False}})


def test_the_docs_loop_survives_two_kills_and_a_notice_bitwise(
    prefect_api: str, home: Path, tmp_path: Path, your_loop: Path
) -> None:
    spec = job(tmp_path)
    state = run_flow(spec, schedule((0.3, False), (0.3, False), (0.4, True)))
    assert state.is_completed(), state.message
    assert state.result()["attempts"] == 4
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "job.yaml").write_text(json.dumps(spec.model_dump(mode="json")))
    r = trainer(
        reference / "job.yaml",
        str(reference / "store"),
        reference,
        env={"PYTHONPATH": os.environ["PYTHONPATH"]},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    evals = [json.loads(x)["m"] for x in _objects(reference / "store") if '"m":' in x]
    assert len(evals) == STEPS // 50 and all("eval_loss" in m for m in evals)  # each eval pass, recorded once
    final = step_dir(STEPS)
    ours, theirs = Path(spec.storage) / final, reference / "store" / final
    assert_states_equal(ours, theirs)
    ema = [torch.load(d / "extra.ema.pt", weights_only=True)["state"]["shadow"] for d in (ours, theirs)]
    assert ema[0].keys() == ema[1].keys() and all(torch.equal(ema[0][k], ema[1][k]) for k in ema[0])
    workers = list((home / "jobs" / spec.name / "workers").glob("*/metrics.jsonl"))
    assert len(workers) == 1
    assert losses(workers[0].parent) == losses(reference)  # every step's loss, the replayed ones too


def test_the_docs_loop_under_ddp_falls_back_past_a_corrupted_checkpoint_bitwise(
    tmp_path: Path, your_loop: Path
) -> None:
    """Two ranks (gloo), rank 1 SIGKILLed after step 33; the newest checkpoint's shard then goes bad, and
    the next attempt resumes from the one before it and still ends bitwise."""
    doc: dict[str, Any] = yaml.safe_load(doc_block("name: blobs"))
    doc |= {"total_steps": 60, "checkpoint": {"every_steps": 10, "keep": 3}, "tracking": {"mlflow": False}}
    doc |= {"distributed": {"nproc_per_node": 2, "strategy": "ddp"}, "batch_size": 4}  # 4 x 4 a step
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]}
    (tmp_path / "job.yaml").write_text(json.dumps(doc))
    reference, store = tmp_path / "reference", tmp_path / "store"
    reference.mkdir()
    r = trainer(tmp_path / "job.yaml", str(reference / "store"), reference, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    r = trainer(tmp_path / "job.yaml", str(store), tmp_path, "--inject-fault", "sigkill@33:1", env=env)
    assert r.returncode == ExitCode.CRASHED, r.stderr[-3000:]
    newest = max(store.glob("step_*"))
    for shard in newest.glob("*.distcp"):
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    fresh = ["--cache", str(tmp_path / "fresh-cache")]  # no local copy: the damaged bytes are all there is
    r = trainer(tmp_path / "job.yaml", str(store), tmp_path, *fresh, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (started,) = [json.loads(x[len("@spotrun ") :]) for x in r.stdout.splitlines() if '"kind":"started"' in x]
    assert started["resumed_from"] < int(newest.name.removeprefix("step_")), started
    assert_sharded_equal(store / step_dir(60), reference / "store" / step_dir(60), tmp_path)
    assert losses(tmp_path) == losses(reference) and len(losses(reference)) == 60


def _objects(store: Path) -> list[str]:
    """The per-step metrics lines the trainer published (metrics/step_<S>.jsonl)."""
    return [line for f in sorted((store / "metrics").glob("*.jsonl")) for line in f.read_text().splitlines()]
