"""Pure decisions of the control plane, tested with tables: what an attempt was and how it ended, retry or
stop, how often workers die, lost steps by one rule, and the promotion gate. No I/O, no Prefect.

Modules: `attempts`, `outcome`, `policy`, `mtbf`, `lost_steps`, `promotion`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.tasks.decisions.attempts import AttemptRecord as AttemptRecord
    from spotrun.tasks.decisions.attempts import Outcome as Outcome
    from spotrun.tasks.decisions.lost_steps import kept_step as kept_step
    from spotrun.tasks.decisions.lost_steps import trained_at as trained_at
    from spotrun.tasks.decisions.lost_steps import walk as walk
    from spotrun.tasks.decisions.mtbf import estimate_mtbf as estimate_mtbf
    from spotrun.tasks.decisions.outcome import add_facts as add_facts
    from spotrun.tasks.decisions.outcome import classify as classify
    from spotrun.tasks.decisions.outcome import provision_failed_record as provision_failed_record
    from spotrun.tasks.decisions.outcome import resharded as resharded
    from spotrun.tasks.decisions.outcome import to_record as to_record
    from spotrun.tasks.decisions.policy import DuplicateRuns as DuplicateRuns
    from spotrun.tasks.decisions.policy import RetryPolicy as RetryPolicy
    from spotrun.tasks.decisions.policy import decide as decide
    from spotrun.tasks.decisions.promotion import KEPT as KEPT
    from spotrun.tasks.decisions.promotion import PROMOTED as PROMOTED
    from spotrun.tasks.decisions.promotion import PROMOTION_LABEL as PROMOTION_LABEL
    from spotrun.tasks.decisions.promotion import PromotionDecision as PromotionDecision
    from spotrun.tasks.decisions.promotion import decide_from_eval as decide_from_eval
    from spotrun.tasks.decisions.promotion import event_payload as event_payload
    from spotrun.tasks.decisions.promotion import promotion_for as promotion_for

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "AttemptRecord": "attempts",
    "DuplicateRuns": "policy",
    "KEPT": "promotion",
    "Outcome": "attempts",
    "PROMOTED": "promotion",
    "PROMOTION_LABEL": "promotion",
    "PromotionDecision": "promotion",
    "RetryPolicy": "policy",
    "add_facts": "outcome",
    "classify": "outcome",
    "decide": "policy",
    "decide_from_eval": "promotion",
    "estimate_mtbf": "mtbf",
    "event_payload": "promotion",
    "kept_step": "lost_steps",
    "promotion_for": "promotion",
    "provision_failed_record": "outcome",
    "resharded": "outcome",
    "to_record": "outcome",
    "trained_at": "lost_steps",
    "walk": "lost_steps",
}
__getattr__ = lazy_exports(__name__, _WHERE)
