"""How often a job's workers are reclaimed: the M of `checkpoint.every: auto` (trainer/saving/interval.py).

M = (training seconds observed + w x prior) / (reclaims observed + w): the job's own history pulls the
spec's prior (`checkpoint.mtbf_prior_s`) towards what its workers really saw, one reclaim's worth of
weight at a time. A reclaim is an attempt that ended preempted (notice or not) or lost; planned stops
(`--max-steps`), cancels, crashes and completions are not. Only attempts on the same provider count:
a local rehearsal says nothing about EC2.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tasks.decisions.attempts import AttemptRecord, Outcome

PRIOR_WEIGHT = 1.0  # the prior counts as one observed reclaim
RECLAIMS = (Outcome.PREEMPTED, Outcome.LOST)


@dataclass(frozen=True)
class Estimate:
    mtbf_s: float
    reclaims: int
    exposure_s: float  # training seconds the history covers

    def describe(self) -> str:
        if not self.reclaims and not self.exposure_s:
            return f"{self.mtbf_s:.0f} s between reclaims (the spec's prior: no history yet)"
        return (
            f"{self.mtbf_s:.0f} s between reclaims ({self.reclaims} reclaim(s) in "
            f"{self.exposure_s:.0f} s of training, with the prior)"
        )


def estimate_mtbf(
    attempts: Iterable[AttemptRecord],
    provider: str,
    prior_s: float,
    *,
    prior_weight: float = PRIOR_WEIGHT,
    reclaimed_after_s: float | None = None,
) -> Estimate:
    """`reclaimed_after_s`: an attempt not in the history yet is being reclaimed now, after this many
    seconds (the estimate for a replacement started at the notice counts it)."""
    exposure, reclaims = 0.0, 0
    if reclaimed_after_s is not None:
        exposure, reclaims = max(reclaimed_after_s, 0.0), 1
    for a in attempts:
        if a.provider != provider:
            continue
        exposure += max(a.wall_s, 0.0)
        if a.outcome in RECLAIMS and a.trainer_code != "STOPPED":
            reclaims += 1
    return Estimate((exposure + prior_weight * prior_s) / (reclaims + prior_weight), reclaims, exposure)
