"""A training run that only waits: a flow named as the training flow and tagged as the deployment runs
that send heartbeats are, so the zombie automation watches it; SIGKILLed, it goes silent as a lost
controller does. Used by tests/e2e/test_prefect_postgres.py and bench/scale.py.

    python -m tests.fakes.silent_flow SECONDS    # prints `flow-run <id>`, then waits
"""

from __future__ import annotations

import sys
import time

from prefect import flow, tags
from prefect.runtime import flow_run

from spotrun.deployments.alert_parts import TRAINING_FLOW
from spotrun.deployments.automations import HEARTBEAT_TAG


@flow(name=TRAINING_FLOW)
def silent(wait_s: float) -> None:
    """Say which flow run this is, then wait (its heartbeat thread beats meanwhile)."""
    print(f"flow-run {flow_run.get_id()}", flush=True)
    time.sleep(wait_s)


if __name__ == "__main__":
    with tags(HEARTBEAT_TAG):
        silent(float(sys.argv[1]))
