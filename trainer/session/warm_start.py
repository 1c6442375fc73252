"""Warm start: a new run's model (and its optimizer's state) from an earlier run's final checkpoint.

Scheduled retraining starts each night from the last good model (`init_from`, trainer/spec/runs.py).
The controller picks the source run (`init_from.source`); the trainer reads that run's final checkpoint
through the catalog, so it is validated like any resume (names, digests, signature, shapes against the
model just built) and never unpickled unchecked, and loads it into the freshly built parts of an attempt
that has no checkpoint of its own. The run then trains from step 0 on its own schedule: the optimizer's
per-parameter state is loaded, its `param_groups` are not (the old run's final learning rate would
override this run's step 0). Once the run has a checkpoint of its own it resumes from that, never from
the source again, so a resumed warm-started run ends bitwise equal to an uninterrupted one.

A source that is missing, damaged, or of another shape is no source: a fresh start with a warning
(`on_missing: fresh`, the first night) or a one-line ConfigError (`refuse`). A source that cannot be
verified (signed with a key this worker lacks) refuses either way, as resume does: training from scratch
over a checkpoint nobody checked would hide a configuration fault. A transient read error is retried;
once the retries run out it is raised (the attempt is retried), never taken for a missing source.

`read_final` is shared with the promotion gate's evaluation of the champion (trainer/session/evaluation.py).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from spotrun.trainer.checkpoint.catalog import Catalog
from spotrun.trainer.checkpoint.format import MANIFEST, Manifest, read_part
from spotrun.trainer.checkpoint.signing import KEY_ENV, OLD_KEYS_ENV
from spotrun.trainer.checkpoint.stateful import Expectation, spec_of, unwrap
from spotrun.trainer.errors import ConfigError, StorageError, TransientStorageError
from spotrun.trainer.recipes import Parts
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.spec.runs import RunSource
from spotrun.trainer.storage import Storage
from spotrun.trainer.telemetry.records import WarmStarted

log = logging.getLogger(__name__)

OpenStore = Callable[[str], Storage]
RETRY_DELAYS_S = (1.0, 2.0, 4.0)  # after the storage layer's own retries: a blip, not an outage
SOURCE_CACHE = ".run-source"  # under the job's cache; prune_local leaves it, read_final removes it


class SourceUnusable(Exception):
    """The source run's final checkpoint is missing, damaged or of another shape: no source."""

    def __init__(self, message: str, unverified: bool = False) -> None:
        super().__init__(message)
        self.unverified = unverified


def describe(src: RunSource) -> str:
    """The source run in one phrase, for log lines and refusals."""
    key = f" run {src.run_key}" if src.run_key else ""
    return f"job {src.job}{key} (step {src.step} of {src.storage})"


def warm_start(
    spec: JobSpec,
    parts: Parts,
    cache: Path,
    *,
    open_store: OpenStore | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> WarmStarted | None:
    """Apply `spec.init_from` to a fresh attempt's freshly built parts; what happened (None: no init_from)."""
    init = spec.init_from
    if init is None:
        return None
    src = init.source
    if src is None:
        why = f"job {init.job} has no run to warm-start from ({init.which})"
        return _no_source(spec, why, None, f"complete a run of job {init.job} first")
    if spec.distributed is not None:
        raise ConfigError(
            "init_from: a warm start loads one process's model and this job is distributed (its ranks "
            "hold wrapped or sharded models), which is not supported yet; remove init_from or distributed"
        )
    opener = open_store or source_opener(spec)
    want = tuple(init.parts)
    try:
        state = read_final(
            src, want, parts.model, optimizer=parts.optimizer, cache=cache, open_store=opener, sleep=sleep
        )
    except SourceUnusable as e:
        if e.unverified:
            raise ConfigError(
                f"init_from: {describe(src)} cannot be verified ({e}); give this worker the key that "
                f"signed it ({KEY_ENV}, or {OLD_KEYS_ENV} for a retired one), or pick another run "
                "with init_from.which"
            ) from None
        return _no_source(spec, str(e), src, "pick another run with init_from.which")
    load_parts(parts.model, parts.optimizer if "optimizer" in want else None, state)
    log.info("warm start: loaded %s from %s; training from step 0", " and ".join(want), describe(src))
    return WarmStarted(job=src.job, run_key=src.run_key, step=src.step, parts=want, loaded=True)


def source_opener(spec: JobSpec) -> OpenStore:
    """How a source run's storage is opened: with this job's S3 options, never created."""
    return lambda uri: spec.open_storage(uri, create=False)


def _no_source(spec: JobSpec, why: str, src: RunSource | None, fix: str) -> WarmStarted:
    """`on_missing`: fresh, with a warning, or refuse in one line."""
    init = spec.init_from
    assert init is not None
    if init.on_missing == "refuse":
        raise ConfigError(f"init_from: {why}; {fix}, or set init_from.on_missing: fresh")
    log.warning("no run to warm-start from (%s); starting fresh", why)
    return WarmStarted(
        job=src.job if src else init.job,
        run_key=src.run_key if src else None,
        step=src.step if src else None,
        parts=tuple(init.parts),
        loaded=False,
        reason=why,
    )


def read_final(
    src: RunSource,
    want: Collection[str],
    model: torch.nn.Module,
    *,
    optimizer: torch.optim.Optimizer | None,
    cache: Path,
    open_store: OpenStore,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """The `want`ed parts ("model", "optimizer") of `src`'s final checkpoint, validated against `model`
    (and `optimizer`'s parameters), as states ready to load: SourceUnusable when there is no such
    checkpoint or it fails validation; TransientStorageError once the retries ran out."""
    work = cache / SOURCE_CACHE
    try:
        for delay in (*RETRY_DELAYS_S, None):
            try:
                return _read_once(src, want, model, optimizer=optimizer, work=work, open_store=open_store)
            except TransientStorageError as e:
                if delay is None:
                    raise
                log.warning("reading %s: %s; retrying in %.0f s", describe(src), e, delay)
                sleep(delay)
        raise AssertionError("unreachable")
    finally:
        shutil.rmtree(work, ignore_errors=True)  # a copy (S3): the source itself is untouched


def _read_once(
    src: RunSource,
    want: Collection[str],
    model: torch.nn.Module,
    *,
    optimizer: torch.optim.Optimizer | None,
    work: Path,
    open_store: OpenStore,
) -> dict[str, Any]:
    model = unwrap(model)
    expect = _expectation(model, optimizer if "optimizer" in want else None)
    try:
        storage = open_store(src.storage)
        selection = Catalog(storage, work).select(expect, only_step=src.step)
    except (ConfigError, FileNotFoundError) as e:  # no such directory; deleted since the listing
        raise SourceUnusable(f"{describe(src)}: {e}") from None
    except TransientStorageError:
        raise
    except StorageError as e:  # denied, no bucket: no source to read here
        raise SourceUnusable(f"{describe(src)} cannot be read: {e}") from None
    if selection.path is None:
        rejected = selection.rejected[0] if selection.rejected else None
        why = rejected.reason() if rejected else "no such checkpoint (deleted, or never written)"
        unverified = rejected is not None and any(p.kind == "unverified" for p in rejected.problems)
        raise SourceUnusable(f"{describe(src)}: {why}", unverified)
    try:
        return _load_files(selection.path, want, model, optimizer)
    except ValueError as e:  # a sharded checkpoint DCP cannot load; states that do not fit
        raise SourceUnusable(f"{describe(src)}: {e}") from None


def _expectation(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Expectation:
    """What validation checks the source against: this recipe's model (keys, shapes, dtypes) and, when
    its optimizer state is wanted, the parameters it belongs to. Not the job's parts or spec: another
    job, another registry of extras, other training settings are all fine to start from."""
    sd = model.state_dict()
    shapes = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]] if optimizer else None
    return Expectation(model={k: (tuple(v.shape), v.dtype) for k, v in sd.items()}, param_shapes=shapes)


def _load_files(
    path: Path, want: Collection[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """The validated checkpoint's parts, read safely; a sharded one's optimizer state re-keyed by index."""
    manifest = Manifest.from_json((path / MANIFEST).read_bytes())
    if manifest.sharded:
        from spotrun.trainer.checkpoint.safe_load import (
            load_full_state,  # DCP's imports: only for a sharded source
        )

        full = load_full_state(path, manifest.files, keys=tuple(want))
        state: dict[str, Any] = {"model": full["model"]}
        if "optimizer" in want:
            assert optimizer is not None
            state["optimizer"] = _by_index(full["optimizer"], model, optimizer)
    else:
        state = {name: read_part(path / spec_of(name).file, spec_of(name).codec) for name in want}
        if "optimizer" in want:
            state["optimizer"] = state["optimizer"]["state"]
    _check_fits(state, model, optimizer if "optimizer" in want else None)
    return state


def _by_index(
    osd: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[int, Any]:
    """DCP's optimizer state (keyed by parameter name) keyed as `optimizer.state_dict()` keys it: by the
    parameter's position across this optimizer's groups."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_name = osd.get("state", {})
    return {i: by_name[names[id(p)]] for i, p in enumerate(params) if names.get(id(p)) in by_name}


def _check_fits(
    state: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """ValueError unless every tensor fits this model and optimizer: nothing is loaded half-way."""
    ours = model.state_dict()
    theirs = state["model"]
    if set(theirs) != set(ours):
        raise ValueError(f"model keys differ from this recipe's: {sorted(set(theirs) ^ set(ours))[:3]}")
    for k, t in theirs.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"model entry {k} is a {type(t).__name__}, not a tensor")
        if tuple(t.shape) != tuple(ours[k].shape):
            raise ValueError(f"{k}: {tuple(t.shape)}, this recipe's model has {tuple(ours[k].shape)}")
    if optimizer is None:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for idx, st in state["optimizer"].items():
        if not isinstance(idx, int) or not 0 <= idx < len(params) or not isinstance(st, Mapping):
            raise ValueError(f"optimizer state for parameter {idx!r}, which this optimizer does not have")
        for name, t in st.items():
            if isinstance(t, torch.Tensor) and t.dim() and tuple(t.shape) != tuple(params[idx].shape):
                raise ValueError(
                    f"optimizer state {idx}/{name}: {tuple(t.shape)} != {tuple(params[idx].shape)}"
                )


def load_parts(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: Mapping[str, Any]
) -> None:
    """Load `read_final`'s states: the model's weights, and the optimizer's per-parameter state (when
    given) under this optimizer's own param groups, so its learning rates and schedule stand."""
    unwrap(model).load_state_dict(state["model"])
    if optimizer is not None:
        groups = optimizer.state_dict()["param_groups"]  # parameter ids 0..n-1, this run's lr
        optimizer.load_state_dict({"state": dict(state["optimizer"]), "param_groups": groups})
