"""Warm workers (`provider.warm: 1`): a standby trainer per job, so that a reclaim without notice costs a
lease poll and a restore instead of a cold start.

A reclaim without notice cost 3.5-3.7 s on a 2-core VM (docs/benchmarks.md): 2.0-2.2 s the
replacement's cold start (`import torch` 1.1 s, `torch._dynamo` 0.8 s, the recipe and its data) and
1.2-1.3 s of training since the last checkpoint. The fork server (tasks/providers/local/fork_server.py)
removes the imports, not the recipe's build or the wait for a new machine (an instance boot on EC2).

A warm worker is a prewarm (tasks/control/prewarm.py) started when the attempt's trainer reports
`started` instead of at its notice: by then that trainer holds the storage lease, so the standby cannot
take it first. The standby builds everything, imports `torch._dynamo`, then waits (`--prewarm-wait`) on
the lease. From there it is the prewarm's path:
- a reclaim without notice (the local simulator's SIGKILL): the controller sees the worker gone,
  releases it and writes the lease handoff; the standby takes the lease and resumes from the newest
  durable checkpoint (its holder is dead: nothing newer can become durable). It is the next attempt's
  worker, and its `started` arms the next standby: the pool refills in the background;
- a notice: the standby has already written `waiting` to `_standby.json`, so the noticed trainer's
  handover (trainer/preemption/handover.py) stops at once;
- the job completes or gives up: the standby is released unused.
Only one standby (`warm: 1`): during a refill (one cold start) a second reclaim without notice starts
cold, and several standbys would race for one lease with the controller unable to tell which won.

What it does not win back by itself: the steps since the last checkpoint. With `checkpoint.standby_every_s`
the running trainer sends the standby a copy of its state that often (trainer/saving/peer.py), the
standby commits the newest one when it takes over, and a reclaim without notice loses at most that much
training. Each step record names the newest copy the standby confirmed (`standby_step`); the attempt
row keeps it (`extra.standby_copy_step`), and the flow's estimate of where the next attempt resumes
counts it. The goodput report keeps lost steps and recovery apart.

Cost: a second worker for as long as it stands by. The attempt row's `extra.warm` holds its seconds and,
where the provider prices workers, their USD; `warm_idle_s` caps both per attempt (the standby is then
ended, and the attempt goes on without one). The goodput report adds that USD to the job's cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from spotrun.tasks.control.prewarm import PREWARM_WAIT_S, Prewarm
from spotrun.tasks.market.prices import Prices
from spotrun.tasks.providers.base import Provider, WarmSettings
from spotrun.trainer.telemetry.records import Started

WARM_REASON = "warm standby, started with the previous attempt"
WARM = "warm"  # the attempt extra's key: the standby this attempt kept (seconds, USD)
FROM_POOL = "from_warm_pool"  # the attempt extra's key: its worker was the previous attempt's standby
STANDBY_COPY = "standby_copy_step"  # the attempt extra's key: the newest step its standby held a copy of
# "as long as the attempt runs": a trainer's --prewarm-wait is finite; 30 days outlasts any attempt
NO_IDLE_LIMIT_S = 30 * 24 * 3600.0


def warm_of(provider: Provider) -> WarmSettings | None:
    """The provider's standby settings where it offers standbys and some are asked for, else None."""
    warm = getattr(provider, "warm", None)
    return warm if isinstance(warm, WarmSettings) and warm.size > 0 else None


def standby_s(armed_at: float, ended_at: float, idle_s: float | None) -> float:
    """Seconds a standby armed at `armed_at` stood by in an attempt that ended at `ended_at` (pure)."""
    stood = max(0.0, ended_at - armed_at)
    return stood if idle_s is None else min(stood, idle_s)


def standby_usd(seconds: float, prices: Prices | None) -> float | None:
    """What `seconds` of a standby spot worker cost, where the provider knows its price (pure)."""
    return None if prices is None else round(seconds * prices.spot_per_h / 3600, 6)


def from_pool(ready: Prewarm, now: float) -> dict[str, Any]:
    """The attempt extra of an attempt whose worker `ready` handed over: whether it was a warm standby."""
    if ready.reason != WARM_REASON:
        return {}
    return {FROM_POOL: {"stood_by_s": round(now - (ready.started_at or now), 3)}}


class WarmStandby:
    """One attempt's standby: armed at its trainer's `started`, costed at its end."""

    def __init__(self, settings: WarmSettings, ahead: Prewarm, args: Callable[[], list[str]]) -> None:
        self.settings, self.ahead, self.args = settings, ahead, args
        self.armed_at: float | None = None

    def started(self, then: Callable[[Started], None] | None) -> Callable[[Started], None]:
        """The watch's `started` call: `then`, and the standby armed."""

        def on_started(rec: Started) -> None:
            if then is not None:
                then(rec)
            self.arm()

        return on_started

    def arm(self) -> None:
        """Start the standby (in a thread) unless one is on its way already (a notice came first)."""
        if self.armed_at is not None or self.ahead.started:
            return
        self.armed_at = time.time()
        idle = self.settings.idle_s
        if idle is None:
            self.ahead.start(self.args, reason=WARM_REASON, wait_s=NO_IDLE_LIMIT_S)
        else:  # released after `idle` unless a notice confirms it; the trainer's own wait outlasts that
            self.ahead.start(self.args, stand_by_s=idle + PREWARM_WAIT_S, reason=WARM_REASON)

    def extra(self, ended_at: float, prices: Prices | None) -> dict[str, Any]:
        """The attempt extra: how long its standby stood by, and what that cost (None: no price)."""
        if self.armed_at is None:
            return {}
        stood = standby_s(self.armed_at, ended_at, self.settings.idle_s)
        usd = standby_usd(stood, prices)
        return {WARM: {"standby_s": round(stood, 3), "usd": usd, "idle_s": self.settings.idle_s}}
