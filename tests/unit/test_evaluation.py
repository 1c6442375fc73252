"""The recipes' evaluate (held-out, deterministic, no gradients, the model's mode kept) and the eval
block's decisions (trainer/session/evaluation.py); COMPLETED.json itself is in test_warm_start.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from spotrun.trainer import recipes
from spotrun.trainer.recipes import Parts, RecipeContext
from spotrun.trainer.recipes.charlm import EVAL_BYTES, read_corpus
from spotrun.trainer.session.evaluation import evaluate_for_promotion, run_evaluate
from spotrun.trainer.spec.job import JobSpec

CPU = torch.device("cpu")


def _build(recipe: str, args: dict[str, Any], batch_size: int = 32) -> Parts:
    torch.manual_seed(0)
    return recipes.build(recipe, args, RecipeContext(0, 10, batch_size, CPU))


def _spec(**kw: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "e", "recipe": "digits", "total_steps": 10, "promote": {}, **kw})


@pytest.mark.parametrize(
    ("recipe", "args", "metrics"),
    [
        ("digits", {"hidden": 16, "holdout": 300}, {"eval_loss", "eval_accuracy"}),
        ("charlm", {"d_model": 16, "n_layers": 1, "seq_len": 16, "max_corpus_mb": 0.02}, {"eval_loss"}),
    ],
)
def test_evaluate_is_deterministic_gradient_free_and_keeps_the_mode(
    recipe: str, args: dict[str, Any], metrics: set[str]
) -> None:
    parts = _build(recipe, args)
    assert parts.evaluate is not None
    parts.model.train()
    first = parts.evaluate(parts.model)
    assert set(first) == metrics and first == parts.evaluate(parts.model)
    assert parts.model.training and all(m.training for m in parts.model.modules())
    assert all(p.grad is None for p in parts.model.parameters())
    assert torch.initial_seed() == 0 and all(v > 0 for v in first.values())


def test_digits_holds_out_the_last_images_and_trains_on_the_rest() -> None:
    assert len(_build("digits", {"hidden": 8}).dataset) == 1797  # type: ignore[arg-type]  # holdout 0: all
    parts = _build("digits", {"hidden": 8, "holdout": 297})
    assert len(parts.dataset) == 1500  # type: ignore[arg-type]
    with pytest.raises(Exception, match="holdout 1790 must be in"):
        _build("digits", {"hidden": 8, "holdout": 1790})


def test_charlm_trains_on_the_same_bytes_and_evaluates_on_those_after_the_cut() -> None:
    size = int(0.02 * 2**20)
    parts = _build("charlm", {"d_model": 16, "n_layers": 1, "seq_len": 16, "max_corpus_mb": 0.02})
    assert bytes(parts.dataset.data.numpy()) == read_corpus(size)  # type: ignore[attr-defined]
    assert read_corpus(size + EVAL_BYTES)[:size] == read_corpus(size)


def test_metrics_are_floats_and_a_non_finite_one_is_null() -> None:
    model = torch.nn.Linear(2, 2)
    out = run_evaluate(lambda m: {"eval_loss": torch.tensor(0.5), "other": float("nan")}, model)  # type: ignore[arg-type, dict-item]
    assert out == {"eval_loss": 0.5, "other": None}
    with pytest.raises(TypeError, match="expected dict"):
        run_evaluate(lambda m: [1.0], model)  # type: ignore[arg-type, return-value]


def _raises(m: torch.nn.Module) -> dict[str, float]:
    raise RuntimeError("held-out file vanished")


@pytest.mark.parametrize(
    ("spec", "evaluate", "skipped"),
    [
        ({"promote": None}, "recipe's", None),
        ({"distributed": {"nproc_per_node": 2}}, "recipe's", "the job is distributed"),
        ({}, None, "recipe digits defines no evaluate"),
        ({}, _raises, "evaluate raised RuntimeError: held-out file vanished"),
        ({}, "recipe's", ""),
    ],
)
def test_the_eval_block_says_why_nothing_was_evaluated(
    tmp_path: Path, spec: dict[str, Any], evaluate: Any, skipped: str | None
) -> None:
    parts = _build("digits", {"hidden": 8})
    if evaluate != "recipe's":
        parts.evaluate = evaluate
    block = evaluate_for_promotion(_spec(**spec), parts, tmp_path)
    if skipped is None:
        assert block is None
        return
    assert block is not None and block["skipped"].startswith(skipped) and block["champion"] is None
    assert bool(block["metrics"]) == (skipped == "") == (block["skipped"] == "")
