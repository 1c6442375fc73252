"""The control loop of one job: provision, train, release, check, record, decide; repeat.

Modules: `loop` (`run_job`), `sinks` (where it reports), `watching` (one worker's watch), `ahead` (workers
started ahead of their attempt and the handover to them), `prewarm` (one such worker), `warm` (the warm
standby), `market` (spot, on-demand or wait), `watchdog` (hung steps), `runlog` (the job run's SQL rows and
records), `checkpoints` (the controller's integrity check), `trainer_args` (what the next trainer is told
from history), `hooks` (the hooks' events and `on_attempt_end`), `sweeping` (the sweeper's Prefect side).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.tasks.control.checkpoints import CHECKPOINT_UNVERIFIED as CHECKPOINT_UNVERIFIED
    from spotrun.tasks.control.checkpoints import CONTROLLER_DISK_FULL as CONTROLLER_DISK_FULL
    from spotrun.tasks.control.checkpoints import completed_at as completed_at
    from spotrun.tasks.control.loop import run_job as run_job
    from spotrun.tasks.control.sinks import PlainSink as PlainSink
    from spotrun.tasks.control.sweeping import sweep_instances as sweep_instances

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "CHECKPOINT_UNVERIFIED": "checkpoints",
    "CONTROLLER_DISK_FULL": "checkpoints",
    "PlainSink": "sinks",
    "completed_at": "checkpoints",
    "run_job": "loop",
    "sweep_instances": "sweeping",
}
__getattr__ = lazy_exports(__name__, _WHERE)
