"""Who owns a job run: one flow run per job (a concurrency slot), a new controller adopting a dead one's
job run, restarting a run whose controller crashed, and how a run ends when its flow does not return.

Modules: `job_slot`, `adoption`, `recovery`, `endings`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.tasks.ownership.adoption import read_worker as read_worker
    from spotrun.tasks.ownership.endings import Ending as Ending
    from spotrun.tasks.ownership.endings import close_job_run_of as close_job_run_of
    from spotrun.tasks.ownership.endings import ending_for as ending_for
    from spotrun.tasks.ownership.endings import flow_run_state as flow_run_state
    from spotrun.tasks.ownership.endings import record_ending as record_ending
    from spotrun.tasks.ownership.job_slot import limit_name as limit_name
    from spotrun.tasks.ownership.job_slot import one_run_per_job as one_run_per_job
    from spotrun.tasks.ownership.job_slot import run_key_tag as run_key_tag
    from spotrun.tasks.ownership.job_slot import slot_id as slot_id
    from spotrun.tasks.ownership.recovery import JOB_CRASHED as JOB_CRASHED
    from spotrun.tasks.ownership.recovery import RESTART_TAG as RESTART_TAG
    from spotrun.tasks.ownership.recovery import RestartAction as RestartAction
    from spotrun.tasks.ownership.recovery import decide_controller_restart as decide_controller_restart
    from spotrun.tasks.ownership.recovery import idempotency_key as idempotency_key
    from spotrun.tasks.ownership.recovery import job_tag as job_tag
    from spotrun.tasks.ownership.recovery import parse_flow_run_id as parse_flow_run_id
    from spotrun.tasks.ownership.recovery import read_crashed_run as read_crashed_run
    from spotrun.tasks.ownership.recovery import recovered_run as recovered_run
    from spotrun.tasks.ownership.recovery import recovers_tag as recovers_tag
    from spotrun.tasks.ownership.recovery import restart_of as restart_of
    from spotrun.tasks.ownership.recovery import restart_times as restart_times

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "Ending": "endings",
    "JOB_CRASHED": "recovery",
    "RESTART_TAG": "recovery",
    "RestartAction": "recovery",
    "close_job_run_of": "endings",
    "decide_controller_restart": "recovery",
    "ending_for": "endings",
    "flow_run_state": "endings",
    "idempotency_key": "recovery",
    "job_tag": "recovery",
    "limit_name": "job_slot",
    "one_run_per_job": "job_slot",
    "parse_flow_run_id": "recovery",
    "read_crashed_run": "recovery",
    "read_worker": "adoption",
    "record_ending": "endings",
    "recovered_run": "recovery",
    "recovers_tag": "recovery",
    "restart_of": "recovery",
    "restart_times": "recovery",
    "run_key_tag": "job_slot",
    "slot_id": "job_slot",
}
__getattr__ = lazy_exports(__name__, _WHERE)
