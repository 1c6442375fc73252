"""The session: the step boundary every training loop runs on, a recipe's (trainer/loop.py) or a user's
own (`spotrun.session`, docs/your-loop.md)."""

from trainer.session.context import SessionEnded, UserSession, session
from trainer.session.core import Session
from trainer.session.options import AttemptOptions, AttemptResult

__all__ = ["AttemptOptions", "AttemptResult", "Session", "SessionEnded", "UserSession", "session"]
