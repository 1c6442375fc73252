"""Experiment tracking (MLflow) and the resume-fidelity check, on the controller's side (docs/tracking.md).

The trainer publishes each step's metrics to the job's storage once a checkpoint covers them
(trainer/telemetry/metrics_log.py); `Tracker` sends them, the preemptions, the resume checks and the final
model (with its evaluation, lineage and the promotion gate's alias move: versions.py) to one MLflow run per
job run; `ResumeChecker` compares what a lost attempt and its successor computed.
MLflow is imported lazily, in the tracker's thread only.
"""

from spotrun.tasks.tracking.fidelity import ResumeCheck, ResumeChecker, worst_verdict
from spotrun.tasks.tracking.tracker import Tracker, TrackingInfo, Where

__all__ = ["ResumeCheck", "ResumeChecker", "Tracker", "TrackingInfo", "Where", "worst_verdict"]
