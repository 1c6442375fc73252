"""When spot has had its chances: the on-demand fallback rules (`on_demand_after_preemptions`,
`on_demand_after_s`), in one place. The AWS provider applies them to a job without a deadline
(tasks/providers/aws/policy.py); the deadline policies name them `fixed` (tasks/deadlines/policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FixedRule:
    """The thresholds (None: that rule is off)."""

    after_preemptions: int | None = None
    after_s: float | None = None

    def on_demand_reason(self, *, preemptions: int, short_s: float | None) -> str | None:
        """Why spot is over (one line), or None. `short_s`: how long spot launches have been refused for
        capacity with no spot launch since (None: the last spot launch succeeded)."""
        if self.after_preemptions is not None and preemptions >= self.after_preemptions:
            return f"{preemptions} preemption(s) >= {self.after_preemptions}"
        if self.after_s is not None and short_s is not None and short_s >= self.after_s:
            return f"no spot for {short_s:.0f} s >= {self.after_s:g} s"
        return None
