"""Where an attempt starts: the newest valid checkpoint, an explicit one, or scratch; and loading it.

The trainer is the one authority on the resume point: it validates against the model it built and
reports its selection, with every checkpoint it passed over, in its `started` status record.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotrun.trainer.checkpoint.catalog import Catalog, Selection
from spotrun.trainer.checkpoint.format import MANIFEST, Manifest, read_part
from spotrun.trainer.checkpoint.signing import KEY_ENV, OLD_KEYS_ENV
from spotrun.trainer.checkpoint.stateful import Codec, Registry, reconcile
from spotrun.trainer.checkpoint.validate import Expectation
from spotrun.trainer.errors import ConfigError, ResumeIncompatible, mark_echo
from spotrun.trainer.storage import Storage

if TYPE_CHECKING:
    from spotrun.trainer.distributed.ranks import (
        Ranks,  # imports torch.distributed: the controller reads this module too
    )

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumeSource:
    """`--resume-from`: a step of this job's storage, or of another storage (a fork or a rollback)."""

    step: int
    storage: Storage | None = None  # None: the job's own storage


def durable_here(selection: Selection, source: ResumeSource | None) -> int | None:
    """The resumed step is durable in this job's storage unless it came from another one (a fork)."""
    forked = source is not None and source.storage is not None
    return None if forked else selection.step


def select(storage: Storage, cache: Path, expect: Expectation, src: ResumeSource | None) -> Selection:
    """Pick the checkpoint to resume from; refuse another job's checkpoints and unusable explicit ones."""
    source = src.storage if src is not None and src.storage is not None else storage
    selection = Catalog(source, cache).select(expect, only_step=src.step if src else None)
    for r in selection.rejected:
        compat = [p for p in r.problems if p.kind == "compat"]
        if compat:
            detail = compat[0].detail
            fix = (
                ""
                if "; " in detail
                else "; use a new storage URI for a changed model, or restore the original settings"
            )
            raise ResumeIncompatible(f"checkpoint step {r.step} in {source.uri} {detail}{fix}")
    unverified = [r for r in selection.rejected if any(p.kind == "unverified" for p in r.problems)]
    if selection.step is None and unverified:  # never train from scratch over checkpoints we cannot check
        r = unverified[0]
        raise ConfigError(
            f"checkpoint step {r.step} in {source.uri} {r.reason()}; give this worker the key that "
            f"signed it ({KEY_ENV}, or {OLD_KEYS_ENV} for a retired one), or use a new storage URI"
        )
    if src is not None:
        _check_explicit_source(storage, source, src.step, selection)
    latest = Catalog(storage).latest()
    if latest is not None and latest != selection.step and src is None:
        log.info("'latest' marker says step %d; newest valid is %s", latest, selection.step)
    return selection


def select_together(
    storage: Storage, cache: Path, expect: Expectation, *, src: ResumeSource | None, ranks: Ranks
) -> Selection:
    """`select` on rank 0, its choice (or its refusal) broadcast: every rank resumes from exactly that
    checkpoint. Each node's first rank fetches it into the node's cache (a no-op where rank 0 already
    holds it); a rank that cannot fails the attempt on every rank with its line."""
    outcome: Selection | BaseException | None = None
    if ranks.is_zero:
        try:
            outcome = select(storage, cache, expect, src)
            if outcome.path is not None:
                outcome.world_size = Manifest.from_json((outcome.path / MANIFEST).read_bytes()).world_size
        except Exception as e:  # the same refusal on every rank, so each exits with the same code
            outcome = e
    outcome = ranks.broadcast(outcome)
    if isinstance(outcome, BaseException):
        mark_echo(outcome, not ranks.is_zero)  # logged once, by rank 0
        raise outcome
    assert outcome is not None
    error = None
    if outcome.step is not None and not ranks.is_zero and ranks.local_rank == 0:
        source = src.storage if src is not None and src.storage is not None else storage
        try:
            outcome.path = Catalog(source, cache).fetch(outcome.step)
        except Exception as e:
            error = f"cannot fetch checkpoint step {outcome.step}: {type(e).__name__}: {e}"
    ranks.fail_together(error)
    return outcome


def _check_explicit_source(storage: Storage, source: Storage, step: int, selection: Selection) -> None:
    if selection.step is None:
        why = selection.rejected[0].reason() if selection.rejected else "no such checkpoint"
        raise ConfigError(
            f"--resume-from: step {step} of {source.uri} is not usable ({why}); "
            "see 'spotrun checkpoints list'"
        )
    # Rolling back inside one storage would leave newer checkpoints of the abandoned timeline that a
    # later automatic resume would pick; they are committed work, so refuse rather than delete them.
    newer = [s for s, c in Catalog(storage).list().items() if c.committed and s > step]
    if newer:
        raise ConfigError(
            f"--resume-from {step}: {storage.uri} holds newer checkpoints {sorted(newer)[:3]}; "
            "resume into a new storage (--storage NEW --resume-from OLD_URI/step_...)"
        )


@dataclass
class Restored:
    """What `load_state` loaded but left to the caller: deferred parts' states, by name."""

    deferred: dict[str, Any]

    def apply(self, registry: Registry) -> None:
        """Load the deferred parts now (the RNG: once the epoch's data iterator exists)."""
        for name, state in self.deferred.items():
            registry[name].load_state_dict(state)
        self.deferred = {}


def load_state(path: Path, registry: Registry, skip: tuple[str, ...] = ()) -> Restored:
    """Load every part of `registry` from a checkpoint directory, by name, except the deferred ones.

    Like Fabric's `load(path, state) -> leftovers`, with leftovers an error: a registered part the
    checkpoint lacks, or a part in it that nothing registered, raises ResumeIncompatible naming it
    (the optional scaler is exempt: a checkpoint without one leaves the fresh scaler as it is).
    Sharded (DCP) parts are loaded by `sharded.load_sharded` first; `skip` names parts left as they are
    (a resharded resume's RNG: the checkpoint has no file for a rank it did not have)."""
    files = Manifest.from_json((path / MANIFEST).read_bytes()).files
    wanted = {n: f for n, f in registry.files().items() if n not in skip}
    missing, leftovers = reconcile(wanted, files, registry.sharded)
    leftovers = [p for p in leftovers if not any(p.startswith(repr(n)) for n in skip)]
    if missing or leftovers:
        what = [f"lacks {p}" for p in missing] + [f"holds {p}, which nothing here loads" for p in leftovers]
        raise ResumeIncompatible(
            f"checkpoint {path.name} {'; '.join(what)}: resume with the recipe's extra_state as it was"
        )
    deferred: dict[str, Any] = {}
    for name in registry:
        part = registry.part(name)
        if name in skip or part.spec.codec is Codec.DCP:
            continue
        if part.file not in files:  # an optional part (reconcile let it through)
            log.info("%s has no %s: %s starts fresh", path.name, part.file, name)
            continue
        state = read_part(path / part.file, part.spec.codec)
        if part.spec.deferred:
            deferred[name] = state
        else:
            part.obj.load_state_dict(state)
    return Restored(deferred)
