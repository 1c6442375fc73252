"""One attempt of training: the session, the step boundary every training loop runs on, a recipe's
(`loop`) or a user's own (`spotrun.session`, docs/your-loop.md).

A change here changes the loop. Modules: `context` (the user's `spotrun.session`), `core` (the step
boundary), `opening` and `state` (what an attempt opens and holds), `options` (what it is given, frozen),
`parts` (the checkpoint's trainer part), `loop` (the recipe loop), `resume` (where an attempt starts),
`warm_start` and `evaluation` (scheduled retraining's first weights and promotion metric), `faults`
(injected faults for rehearsals). Imports torch: names are imported when first read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.trainer.session.context import SessionEnded as SessionEnded
    from spotrun.trainer.session.context import UserSession as UserSession
    from spotrun.trainer.session.context import session as session
    from spotrun.trainer.session.core import Session as Session
    from spotrun.trainer.session.options import AttemptOptions as AttemptOptions
    from spotrun.trainer.session.options import AttemptResult as AttemptResult

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "AttemptOptions": "options",
    "AttemptResult": "options",
    "Session": "core",
    "SessionEnded": "context",
    "UserSession": "context",
    "session": "context",
}
__getattr__ = lazy_exports(__name__, _WHERE)
