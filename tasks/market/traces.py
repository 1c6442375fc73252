"""Spot capacity traces: how many spot instances a zone could give, tick by tick.

The format is the one the *Can't Be Late* authors (NSDI '24) published their AWS measurements in:

    {"metadata": {"gap_seconds": G}, "data": [n0, n1, ...]}

one integer per tick of G seconds, the instances available (1-node traces: 0 or 1). A file is one
zone, named `<zone>_<anything>.json` (`us-east-1a_v100_1.json`); a folder of them is a region whose
zones share the clock. Both the local provider's replay (a spot worker preempted when its zone's
capacity drops: tasks/providers/local/market.py) and the deadline simulator (bench/deadline.py) read
traces through `load` and place a spot worker by `best_zone`, so that the two agree on where it runs.

A trace is input like a job file: a malformed one is refused in one line that names the file and the
problem, never half-read.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from spotrun.trainer.errors import ConfigError

DAY_S = 86_400.0
# A zone that took capacity back this recently ranks below every other zone with capacity: drops
# cluster (a zone that just emptied often empties again soon), and the last day's tally alone would
# still send the next worker into a zone with 23 good hours and a reclaim a minute ago.
RECLAIM_AVOID_S = 3_600.0


@dataclass(frozen=True)
class Trace:
    """One zone's capacity, tick by tick."""

    zone: str
    gap_s: float  # seconds per tick
    capacity: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.capacity)

    def at(self, tick: int) -> int:
        """Capacity at `tick`; past the end the trace repeats (a long job on a short trace)."""
        return self.capacity[tick % len(self.capacity)]

    def available(self) -> float:
        return sum(1 for c in self.capacity if c > 0) / len(self.capacity)

    def drops(self) -> int:
        """Ticks with capacity followed by one without."""
        c = self.capacity
        return sum(1 for a, b in itertools.pairwise(c) if a > 0 and b == 0)

    def window(self, start: int, ticks: int) -> Trace:
        """`ticks` ticks from `start` (wrapping)."""
        return Trace(self.zone, self.gap_s, tuple(self.at(start + i) for i in range(ticks)))

    def compressed(self, factor: float) -> Trace:
        """The same ticks, each `factor` times shorter (a replay in minutes of what took days)."""
        if factor <= 0:
            raise ConfigError(f"trace compression {factor} is not positive; use a factor like 100")
        return Trace(self.zone, self.gap_s / factor, self.capacity)


def zone_of(path: Path) -> str:
    """`us-east-1a` from `us-east-1a_v100_1.json`."""
    return path.stem.split("_", 1)[0]


def load_file(path: Path) -> Trace:
    """One zone's trace (ConfigError in one line for anything malformed)."""
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"spot trace {path}: cannot read it ({e.strerror}); check the path") from None
    except ValueError as e:
        raise ConfigError(f"spot trace {path} is not JSON ({e}); give a trace file") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"spot trace {path}: expected {{'metadata': {{'gap_seconds': G}}, 'data': [...]}}")
    meta, data = doc.get("metadata"), doc.get("data")
    gap = meta.get("gap_seconds") if isinstance(meta, dict) else None
    if not isinstance(gap, int | float) or isinstance(gap, bool) or not gap > 0:
        raise ConfigError(f"spot trace {path}: metadata.gap_seconds must be a positive number of seconds")
    if not isinstance(data, list) or not data:
        raise ConfigError(f"spot trace {path}: data must be a non-empty list of capacities, one per tick")
    bad = next(
        (i for i, c in enumerate(data) if not isinstance(c, int) or isinstance(c, bool) or c < 0), None
    )
    if bad is not None:
        raise ConfigError(
            f"spot trace {path}: data[{bad}] is {data[bad]!r}, not a capacity (an integer >= 0)"
        )
    return Trace(zone_of(path), float(gap), tuple(data))


def load(path: Path, zones: Sequence[str] = ()) -> list[Trace]:
    """A trace file (one zone) or a folder of them (a region: every zone, or those named in `zones`),
    zones in name order, all on one clock."""
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise ConfigError(f"spot trace folder {path} holds no .json trace; give a trace file or folder")
        traces = [load_file(f) for f in files]
    else:
        traces = [load_file(path)]
    if zones:
        known = {t.zone for t in traces}
        missing = [z for z in zones if z not in known]
        if missing:
            raise ConfigError(
                f"spot trace {path} has no zone {', '.join(missing)}; it has {', '.join(sorted(known))}"
            )
        traces = [t for t in traces if t.zone in zones]
    gaps = {t.gap_s for t in traces}
    if len(gaps) > 1:
        raise ConfigError(f"spot traces in {path} tick at different rates {sorted(gaps)}; give one clock")
    return traces


def best_zone(traces: Sequence[Trace], tick: int, caps: Sequence[bool]) -> int:
    """Of the zones with capacity now, one that reclaimed none within RECLAIM_AVOID_S, then the one that
    had the most over the last day (ties: name order)."""
    window = max(1, int(DAY_S / traces[0].gap_s))
    lo = max(0, tick - window)
    avoid = max(1, int(RECLAIM_AVOID_S / traces[0].gap_s))

    def seen(i: int) -> int:
        return sum(1 for k in range(lo, tick) if traces[i].at(k) > 0)

    candidates = [i for i, up in enumerate(caps) if up]
    return max(candidates, key=lambda i: (not reclaimed_within(traces[i], tick, avoid), seen(i), -i))


def reclaimed_within(trace: Trace, tick: int, ticks: int) -> bool:
    """Whether the zone's capacity dropped to 0 (from some) at a tick in the `ticks` up to `tick`."""
    return any(trace.at(k - 1) > 0 and trace.at(k) == 0 for k in range(max(1, tick - ticks + 1), tick + 1))
