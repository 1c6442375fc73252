"""The omniscient optimum: the least a job could have cost on a trace, knowing every tick in advance.

Backward induction over (tick, ticks of work done, what runs and how much of its restart is left),
under exactly the rules of simulate.py (a reclaim when the zone's capacity drops, a paid restart of
`restart_ticks` at every start, whole ticks). Vectorised over the work done, so a case of a few thousand
ticks takes a second or two. No policy can beat it; the benchmark reports every policy's cost against
it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from spotrun.tasks.deadlines.simulate import Job
from spotrun.tasks.market.traces import Trace


def optimum_cost(traces: Sequence[Trace], job: Job, *, start: int = 0) -> float:
    """The minimum cost to finish `job`, started at tick `start` of `traces`, by its deadline (inf when
    even on-demand cannot)."""
    w_all, o, z_count = job.work_ticks, job.restart_ticks, len(traces)
    inf = math.inf
    ks = max(o, 1)  # overhead left after a tick: 0..o-1 (0 only when o == 0)
    # value after the last tick: done or not
    terminal = np.full(w_all + 1, inf)
    terminal[w_all] = 0.0
    idle = terminal.copy()
    od = [terminal.copy() for _ in range(ks)]
    spot = [[terminal.copy() for _ in range(ks)] for _ in range(z_count)]

    def ran(values: list[np.ndarray], k: int, price: float) -> np.ndarray:
        """Cost of running the tick with `k` ticks of restart left, then going on optimally."""
        if k > 0:
            nxt = values[k - 1]
        else:
            nxt = np.empty_like(values[0])
            nxt[:-1] = values[0][1:]
            nxt[-1] = 0.0
        out = price + nxt
        out[w_all] = 0.0  # done: nothing more is paid
        return out

    for tick in range(job.deadline_ticks - 1, -1, -1):
        up = [t.at(start + tick) > 0 for t in traces]
        common = idle.copy()  # wait
        common = np.minimum(common, ran(od, o, job.on_demand_per_tick))  # start on-demand
        for z in range(z_count):
            if up[z]:
                common = np.minimum(common, ran(spot[z], o, job.spot_per_tick))  # start spot in z
        new_od = [np.minimum(common, ran(od, k, job.on_demand_per_tick)) for k in range(ks)]
        new_spot = [
            [np.minimum(common, ran(spot[z], k, job.spot_per_tick)) if up[z] else common for k in range(ks)]
            for z in range(z_count)
        ]
        idle, od, spot = common, new_od, new_spot
    return float(idle[0])
