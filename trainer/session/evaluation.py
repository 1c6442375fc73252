"""Evaluation for the promotion gate: this run's final model and the champion's, on the same data.

A job with `promote` moves a model alias to its new version only if that beats the version the alias
holds (the controller decides, tasks/). The comparison needs both measured on the same data, which only
the trainer has: at completion, a single-process job (a distributed one records `skipped`) calls the
recipe's `Parts.evaluate` on the final model and on the champion's final weights (`promote.champion`,
picked by the controller), loaded through the catalog with validation into a copy of this run's model,
and records both in COMPLETED.json's `eval` block:

    "eval": {"metrics": {"eval_loss": 0.41, ...},         this run's final model ({} when skipped)
             "champion": {"metrics": {...} | null,         null: could not be loaded or evaluated
                          "job", "run_key", "step", "version",
                          "reason": ""} | null,            null: no champion (the first version)
             "skipped": ""}                                why nothing was evaluated, else ""

A metric that is not finite is recorded as null (JSON has no NaN). Nothing here can fail a completed
run: a recipe's evaluate that raises, or a champion that cannot be read, is recorded with the reason.
It runs after the final checkpoint is durable, outside the training loop and its timings; a crash
during it leaves no COMPLETED.json, and the next attempt (resuming at the final step) evaluates again.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from spotrun.trainer.checkpoint.stateful import unwrap
from spotrun.trainer.errors import TransientStorageError
from spotrun.trainer.recipes import Evaluate, Parts, evaluating
from spotrun.trainer.session.warm_start import (
    OpenStore,
    SourceUnusable,
    load_parts,
    read_final,
    source_opener,
)
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.spec.runs import RunSource

log = logging.getLogger(__name__)

Metrics = dict[str, float | None]


def evaluate_for_promotion(
    spec: JobSpec,
    parts: Parts,
    cache: Path,
    *,
    open_store: OpenStore | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any] | None:
    """COMPLETED.json's `eval` block for a job with `promote` (None: no promote, nothing to evaluate)."""
    if spec.promote is None:
        return None
    why = _cannot_evaluate(spec, parts)
    if why:
        log.warning("no evaluation for the promotion gate: %s", why)
        return skipped(why)
    assert parts.evaluate is not None
    t0 = time.perf_counter()
    model = unwrap(parts.model)
    try:
        metrics = run_evaluate(parts.evaluate, model)
    except Exception as e:  # the recipe's code: its failure is recorded, the completed run stays completed
        log.exception("evaluate failed on the final model")
        return skipped(f"evaluate raised {type(e).__name__}: {e}"[:300])
    if spec.promote.metric not in metrics:
        log.warning(
            "evaluate returned no %s (promote.metric); it returned %s", spec.promote.metric, sorted(metrics)
        )
    champion = None
    if spec.promote.champion is not None:
        opener = open_store or source_opener(spec)
        champion = evaluate_champion(
            spec.promote.champion, parts.evaluate, model, cache=cache, open_store=opener, sleep=sleep
        )
    log.info(
        "evaluation: %s; champion: %s (%.2f s)",
        metrics,
        champion["metrics"] if champion else None,
        time.perf_counter() - t0,
    )
    return {"metrics": metrics, "champion": champion, "skipped": ""}


def skipped(why: str) -> dict[str, Any]:
    """The `eval` block when nothing could be evaluated."""
    return {"metrics": {}, "champion": None, "skipped": why}


def _cannot_evaluate(spec: JobSpec, parts: Parts) -> str:
    if spec.distributed is not None:  # rank 0 alone calling a wrapped model would wait on the others
        return "the job is distributed; evaluation runs in single-process jobs only"
    if parts.evaluate is None:
        if spec.entrypoint is not None:
            return f"entrypoint {spec.entrypoint} passes no evaluate to spotrun.session(evaluate=...)"
        return f"recipe {spec.recipe} defines no evaluate (trainer/recipes: Parts.evaluate)"
    return ""


def run_evaluate(evaluate: Evaluate, model: torch.nn.Module) -> Metrics:
    """`evaluate(model)` without gradients in eval mode, its values as floats (None: not finite)."""
    with evaluating(model):
        out = evaluate(model)
    if not isinstance(out, Mapping) or not all(isinstance(k, str) for k in out):
        raise TypeError(f"evaluate returned {type(out).__name__}, expected dict[str, float]")
    values = {k: float(v) for k, v in out.items()}
    return {k: v if math.isfinite(v) else None for k, v in values.items()}


def evaluate_champion(
    src: RunSource,
    evaluate: Evaluate,
    model: torch.nn.Module,
    *,
    cache: Path,
    open_store: OpenStore,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """The champion's entry: its final weights loaded (validated) into a copy of `model`, evaluated."""
    out: dict[str, Any] = {
        "metrics": None,
        "job": src.job,
        "run_key": src.run_key,
        "step": src.step,
        "version": src.version,
        "reason": "",
    }
    try:
        theirs = copy.deepcopy(model)  # this recipe's model; every weight is overwritten by the load
        load_parts(
            theirs,
            None,
            read_final(
                src, ("model",), theirs, optimizer=None, cache=cache, open_store=open_store, sleep=sleep
            ),
        )
        out["metrics"] = run_evaluate(evaluate, theirs)
    except SourceUnusable as e:
        out["reason"] = str(e)
    except TransientStorageError as e:
        out["reason"] = f"storage unreachable after retries: {e}"
    except Exception as e:  # a copy or an evaluate that fails on it: recorded, the run stays completed
        log.exception("evaluating the champion failed")
        out["reason"] = f"{type(e).__name__}: {e}"[:300]
    if out["reason"]:
        log.warning("champion not evaluated: %s", out["reason"])
    return out
