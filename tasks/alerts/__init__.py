"""Restart-storm, give-up, recovery, resume-mismatch, cannot-verify, disk-full, promotion, missed-run and
run-failed alerts: what they say, whether to send, and Slack delivery.

No Prefect here, except `tasks.alerts.secrets` (Secret blocks), which nothing here imports.
"""

from __future__ import annotations

from spotrun.tasks.alerts.decide import Action as Action
from spotrun.tasks.alerts.decide import Decision as Decision
from spotrun.tasks.alerts.decide import decide as decide
from spotrun.tasks.alerts.message import AlertContext as AlertContext
from spotrun.tasks.alerts.message import AlertKind as AlertKind
from spotrun.tasks.alerts.message import PromotionFacts as PromotionFacts
from spotrun.tasks.alerts.message import ResumeFacts as ResumeFacts
from spotrun.tasks.alerts.message import SlackMessage as SlackMessage
from spotrun.tasks.alerts.message import build_message as build_message
from spotrun.tasks.alerts.message import to_markdown as to_markdown
from spotrun.tasks.alerts.service import AlertRequest as AlertRequest
from spotrun.tasks.alerts.service import AlertResult as AlertResult
from spotrun.tasks.alerts.service import raise_alert as raise_alert
from spotrun.tasks.alerts.slack import Delivery as Delivery
from spotrun.tasks.alerts.slack import SlackConfigError as SlackConfigError
from spotrun.tasks.alerts.slack import SlackTarget as SlackTarget
from spotrun.tasks.alerts.slack import deliver as deliver
from spotrun.tasks.alerts.slack import target_from_env as target_from_env
from spotrun.tasks.history import AlertStatus as AlertStatus
