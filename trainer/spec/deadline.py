"""A job's date and money: when it must be done (`deadline`) and what it may cost (`budget_usd`).

`deadline` is written the way people say it: an absolute time with its timezone
(`2026-12-07T08:00:00Z`, `2026-12-07T09:00:00+01:00`) or a duration from the job run's start (`12h`,
`90m`, `2d`, `3600s`, `1h30m`); a scheduled run's duration counts from its slot, not from when the
worker got to it. A time without a timezone is refused: on a worker in another zone it would mean
another instant. Nothing here knows the market; tasks/deadlines/ decides with these numbers.
"""

from __future__ import annotations

import re
from datetime import datetime

_UNITS = {"d": 86_400.0, "h": 3_600.0, "m": 60.0, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d+)?)"
_DURATION = re.compile("^" + "".join(f"(?:{_NUMBER}{unit})?" for unit in "dhms") + "$")


def duration_s(text: str) -> float | None:
    """Seconds in `12h`, `90m`, `1h30m`, `2d`, `3600s`; None when `text` is not a duration."""
    m = _DURATION.match(text.strip())
    if m is None or not any(m.groups()):
        return None
    return sum(float(v) * _UNITS[u] for v, u in zip(m.groups(), "dhms", strict=True) if v)


def deadline_problem(text: str) -> str | None:
    """Why `text` is not a deadline (one line naming the fix), or None."""
    if duration_s(text) is not None:
        return None if duration_s(text) else "deadline is a zero duration; give one like 12h"
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return (
            f"deadline {text!r} is neither a time (2026-12-07T08:00:00Z) nor a duration (12h, 90m, 2d); "
            "give one of those"
        )
    if when.tzinfo is None:
        return f"deadline {text!r} has no timezone; add one (Z for UTC, or +01:00)"
    return None


def deadline_at(text: str, start: float) -> float:
    """The deadline as epoch seconds, for a job run that started (or was scheduled) at `start`."""
    seconds = duration_s(text)
    if seconds is not None:
        return start + seconds
    return datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp()
