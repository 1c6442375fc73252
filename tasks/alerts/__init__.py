"""Restart-storm, give-up, recovery, resume-mismatch, cannot-verify, disk-full, promotion, missed-run and
run-failed alerts: what they say, whether to send, and Slack delivery.

No Prefect here, except `tasks.alerts.secrets` (Secret blocks), which nothing here imports.
"""

from __future__ import annotations

from spotrun.tasks.alerts.decide import Action, Decision, decide
from spotrun.tasks.alerts.message import (
    AlertContext,
    AlertKind,
    PromotionFacts,
    ResumeFacts,
    SlackMessage,
    build_message,
    to_markdown,
)
from spotrun.tasks.alerts.service import AlertRequest, AlertResult, raise_alert
from spotrun.tasks.alerts.slack import Delivery, SlackConfigError, SlackTarget, deliver, target_from_env
from spotrun.tasks.history import AlertStatus

__all__ = [
    "Action",
    "AlertContext",
    "AlertKind",
    "AlertRequest",
    "AlertResult",
    "AlertStatus",
    "Decision",
    "Delivery",
    "PromotionFacts",
    "ResumeFacts",
    "SlackConfigError",
    "SlackMessage",
    "SlackTarget",
    "build_message",
    "decide",
    "deliver",
    "raise_alert",
    "target_from_env",
    "to_markdown",
]
