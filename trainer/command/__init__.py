"""An unchanged script (`command:` in the job file): its checkpoints restored before the start, found and
published with a manifest while it runs, a notice forwarded, its exit classified; and the script's side of
that link, which the framework callbacks (spotrun.integrations) use.

A change here changes how spotrun runs code it does not own; what a checkpoint is stays in
trainer/checkpoint/ (layout `directory`, checked by trainer/checkpoint/foreign.py).
Modules: `layouts`, `publish`, `link`, `runner`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.trainer.command.layouts import MARKER as MARKER
    from spotrun.trainer.command.layouts import Found as Found
    from spotrun.trainer.command.layouts import find as find
    from spotrun.trainer.command.link import CommandLink as CommandLink
    from spotrun.trainer.command.publish import restore as restore
    from spotrun.trainer.command.runner import run_command as run_command

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "CommandLink": "link",
    "Found": "layouts",
    "MARKER": "layouts",
    "find": "layouts",
    "restore": "publish",
    "run_command": "runner",
}
__getattr__ = lazy_exports(__name__, _WHERE)
