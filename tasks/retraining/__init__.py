"""Scheduled retraining: run keys resolved once per slot, the key's start in a flow run, what follows a
completed keyed run (promotion recorded, retention) and retention across the job's runs.

Modules: `run_keys`, `run_key_start`, `completion`, `run_retention`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.tasks.retraining.completion import after_completion as after_completion
    from spotrun.tasks.retraining.run_key_start import per_run_key as per_run_key
    from spotrun.tasks.retraining.run_keys import keyed_record as keyed_record
    from spotrun.tasks.retraining.run_keys import keys_to_run as keys_to_run
    from spotrun.tasks.retraining.run_keys import lineage_of as lineage_of
    from spotrun.tasks.retraining.run_keys import preview as preview

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "after_completion": "completion",
    "keyed_record": "run_keys",
    "keys_to_run": "run_keys",
    "lineage_of": "run_keys",
    "per_run_key": "run_key_start",
    "preview": "run_keys",
}
__getattr__ = lazy_exports(__name__, _WHERE)
