"""What supervisors see of a trainer: typed status records, the `@spotrun` status lines, the heartbeat
object in storage and the per-step metrics published once a checkpoint covers them.

A change here changes what a controller, a provider or MLflow is told. Modules: `records`, `status`,
`heartbeat`, `metrics_log`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.trainer.telemetry.heartbeat import HEARTBEAT_EVERY_S as HEARTBEAT_EVERY_S
    from spotrun.trainer.telemetry.heartbeat import MAX_LOSSES as MAX_LOSSES
    from spotrun.trainer.telemetry.heartbeat import WORKERS_DIR as WORKERS_DIR
    from spotrun.trainer.telemetry.heartbeat import HeartbeatWriter as HeartbeatWriter
    from spotrun.trainer.telemetry.heartbeat import heartbeat_losses as heartbeat_losses
    from spotrun.trainer.telemetry.heartbeat import heartbeat_records as heartbeat_records
    from spotrun.trainer.telemetry.heartbeat import read_heartbeat as read_heartbeat
    from spotrun.trainer.telemetry.metrics_log import PREFIX as PREFIX
    from spotrun.trainer.telemetry.metrics_log import MetricsLog as MetricsLog
    from spotrun.trainer.telemetry.metrics_log import parse_metrics_key as parse_metrics_key
    from spotrun.trainer.telemetry.metrics_log import prune_after as prune_after
    from spotrun.trainer.telemetry.records import Durable as Durable
    from spotrun.trainer.telemetry.records import Exit as Exit
    from spotrun.trainer.telemetry.records import Interval as Interval
    from spotrun.trainer.telemetry.records import Notice as Notice
    from spotrun.trainer.telemetry.records import Record as Record
    from spotrun.trainer.telemetry.records import Started as Started
    from spotrun.trainer.telemetry.records import Step as Step
    from spotrun.trainer.telemetry.records import Stopping as Stopping
    from spotrun.trainer.telemetry.records import WarmStarted as WarmStarted
    from spotrun.trainer.telemetry.status import StatusReporter as StatusReporter
    from spotrun.trainer.telemetry.status import open_status as open_status
    from spotrun.trainer.telemetry.status import parse_status_line as parse_status_line

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "Durable": "records",
    "Exit": "records",
    "HEARTBEAT_EVERY_S": "heartbeat",
    "HeartbeatWriter": "heartbeat",
    "Interval": "records",
    "MAX_LOSSES": "heartbeat",
    "MetricsLog": "metrics_log",
    "Notice": "records",
    "PREFIX": "metrics_log",
    "Record": "records",
    "Started": "records",
    "StatusReporter": "status",
    "Step": "records",
    "Stopping": "records",
    "WORKERS_DIR": "heartbeat",
    "WarmStarted": "records",
    "heartbeat_losses": "heartbeat",
    "heartbeat_records": "heartbeat",
    "open_status": "status",
    "parse_metrics_key": "metrics_log",
    "parse_status_line": "status",
    "prune_after": "metrics_log",
    "read_heartbeat": "heartbeat",
}
__getattr__ = lazy_exports(__name__, _WHERE)
