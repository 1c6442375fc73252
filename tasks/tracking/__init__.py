"""Experiment tracking (MLflow) and the resume-fidelity check, on the controller's side (docs/tracking.md).

The trainer publishes each step's metrics to the job's storage once a checkpoint covers them
(trainer/telemetry/metrics_log.py); `Tracker` sends them, the preemptions, the resume checks and the final
model (with its evaluation, lineage and the promotion gate's alias move: versions.py) to one MLflow run per
job run; `ResumeChecker` compares what a lost attempt and its successor computed.
MLflow is imported lazily, in the tracker's thread only.
"""

from spotrun.tasks.tracking.fidelity import ResumeCheck as ResumeCheck
from spotrun.tasks.tracking.fidelity import ResumeChecker as ResumeChecker
from spotrun.tasks.tracking.fidelity import worst_verdict as worst_verdict
from spotrun.tasks.tracking.tracker import Tracker as Tracker
from spotrun.tasks.tracking.tracker import TrackingInfo as TrackingInfo
from spotrun.tasks.tracking.tracker import Where as Where
