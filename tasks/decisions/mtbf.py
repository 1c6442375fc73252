"""How often a job loses work to a reclaim: the M of `checkpoint.every: auto` (trainer/saving/interval.py).

M = (training seconds observed + w x prior) / (reclaims that lost work + w): the job's own history pulls
the spec's prior (`checkpoint.mtbf_prior_s`) towards what its workers really saw, one reclaim's worth of
weight at a time. Young/Daly's M is the time between failures that cost the steps since the last
checkpoint: a reclaim with notice whose emergency checkpoint made the last step durable costs its
restart, which no interval changes, and none of those steps. So what counts is an attempt that ended
preempted or lost and lost steps (a reclaim without notice, or a notice too short for the save); a job
whose reclaims all come with notice checkpoints for the ones that do not, at the prior's rate, and one
whose reclaims are a third without notice plans for a third of them. Planned stops (`--max-steps`),
cancels, crashes and completions never count. Only attempts on the same provider count: a local
rehearsal says nothing about EC2.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome

PRIOR_WEIGHT = 1.0  # the prior counts as one observed reclaim
RECLAIMS = (Outcome.PREEMPTED, Outcome.LOST)


@dataclass(frozen=True)
class Estimate:
    mtbf_s: float
    reclaims: int
    exposure_s: float  # training seconds the history covers

    def describe(self) -> str:
        if not self.reclaims and not self.exposure_s:
            return f"{self.mtbf_s:.0f} s between reclaims that lose work (the spec's prior: no history yet)"
        return (
            f"{self.mtbf_s:.0f} s between reclaims that lose work ({self.reclaims} in "
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
    seconds (a replacement started at its notice: its training counts, and the reclaim does not, since
    the notice's emergency checkpoint keeps its steps)."""
    exposure, reclaims = 0.0, 0
    if reclaimed_after_s is not None:
        exposure = max(reclaimed_after_s, 0.0)
    for a in attempts:
        if a.provider != provider:
            continue
        exposure += max(a.wall_s, 0.0)
        if a.outcome in RECLAIMS and a.trainer_code != "STOPPED" and lost_work(a):
            reclaims += 1
    return Estimate((exposure + prior_weight * prior_s) / (reclaims + prior_weight), reclaims, exposure)


def lost_work(a: AttemptRecord) -> bool:
    """Whether a reclaim cost steps: lost (no heartbeat: whatever ran since the last checkpoint), or
    steps done after its last durable checkpoint (tasks/decisions/lost_steps.py)."""
    return a.outcome is Outcome.LOST or a.lost_steps > 0
