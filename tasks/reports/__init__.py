"""What a job run is shown as: goodput from its attempt rows, the summary and timeline at its end, Prefect
events and artifacts, the Prefect sink of the control loop, and its MLflow feed.

A change here changes what a user reads about a run. Modules: `goodput`, `timeline`, `run_summary`,
`reporting`, `prefect_sink`, `run_tracking`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.tasks.reports.goodput import GoodputReport as GoodputReport
    from spotrun.tasks.reports.goodput import RunInfo as RunInfo
    from spotrun.tasks.reports.goodput import compute as compute
    from spotrun.tasks.reports.goodput import progress as progress
    from spotrun.tasks.reports.goodput import summary_rows as summary_rows
    from spotrun.tasks.reports.prefect_sink import PrefectSink as PrefectSink
    from spotrun.tasks.reports.reporting import JOB_COMPLETED as JOB_COMPLETED
    from spotrun.tasks.reports.reporting import JOB_GAVE_UP as JOB_GAVE_UP
    from spotrun.tasks.reports.reporting import JOB_RESTARTED as JOB_RESTARTED
    from spotrun.tasks.reports.reporting import MODEL_PROMOTION as MODEL_PROMOTION
    from spotrun.tasks.reports.reporting import RESTARTED_LABEL as RESTARTED_LABEL
    from spotrun.tasks.reports.reporting import RESUME_CHECKED as RESUME_CHECKED
    from spotrun.tasks.reports.reporting import VERDICT_LABEL as VERDICT_LABEL
    from spotrun.tasks.reports.reporting import artifact_key as artifact_key
    from spotrun.tasks.reports.run_summary import Ending as Ending
    from spotrun.tasks.reports.run_summary import RunReport as RunReport
    from spotrun.tasks.reports.run_summary import Summary as Summary
    from spotrun.tasks.reports.run_tracking import RunTracking as RunTracking
    from spotrun.tasks.reports.timeline import AttemptTrace as AttemptTrace
    from spotrun.tasks.reports.timeline import plot_timeline as plot_timeline

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "AttemptTrace": "timeline",
    "Ending": "run_summary",
    "GoodputReport": "goodput",
    "JOB_COMPLETED": "reporting",
    "JOB_GAVE_UP": "reporting",
    "JOB_RESTARTED": "reporting",
    "MODEL_PROMOTION": "reporting",
    "PrefectSink": "prefect_sink",
    "RESTARTED_LABEL": "reporting",
    "RESUME_CHECKED": "reporting",
    "RunInfo": "goodput",
    "RunReport": "run_summary",
    "RunTracking": "run_tracking",
    "Summary": "run_summary",
    "VERDICT_LABEL": "reporting",
    "artifact_key": "reporting",
    "compute": "goodput",
    "plot_timeline": "timeline",
    "progress": "goodput",
    "summary_rows": "goodput",
}
__getattr__ = lazy_exports(__name__, _WHERE)
