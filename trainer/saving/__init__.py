"""How a save is fast: the snapshot into pinned or shared memory, then serialize, hash, write, upload and
publish off the training loop, in a thread or a writer process; sharded (DCP) saves; the interval.

A change here changes what a save costs the loop, never what a checkpoint holds (trainer/checkpoint/).
Modules: `checkpointer`, `writer_proc`, `shm`, `publish`, `sharded`, `interval`, and `peer` (copies of the
state sent to a warm standby, between checkpoints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.trainer.saving.checkpointer import Checkpointer as Checkpointer
    from spotrun.trainer.saving.interval import Choice as Choice
    from spotrun.trainer.saving.interval import IntervalTuner as IntervalTuner
    from spotrun.trainer.saving.sharded import ShardedCheckpointer as ShardedCheckpointer
    from spotrun.trainer.saving.sharded import dcp_state as dcp_state
    from spotrun.trainer.saving.sharded import load_sharded as load_sharded

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "Checkpointer": "checkpointer",
    "Choice": "interval",
    "IntervalTuner": "interval",
    "ShardedCheckpointer": "sharded",
    "dcp_state": "sharded",
    "load_sharded": "sharded",
}
__getattr__ = lazy_exports(__name__, _WHERE)
