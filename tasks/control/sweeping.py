"""The sweeper's Prefect side: which flow runs are live (asked of the Prefect API), and the task that
terminates EC2 workers of the others (tasks/providers/aws/sweeper.py)."""

from __future__ import annotations

from uuid import UUID

from prefect import get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import ObjectNotFound

from spotrun.tasks.providers.aws import ec2_client
from spotrun.tasks.providers.aws.sweeper import sweep


def flow_run_is_live(flow_run_id: str) -> bool:
    """True while the flow run exists and has not reached a final state (completed, failed, cancelled,
    crashed); a malformed or unknown id is not live."""
    try:
        run_id = UUID(flow_run_id)
    except ValueError:
        return False
    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(run_id)
        except ObjectNotFound:
            return False
    return run.state is None or not run.state.is_final()


@task(name="sweep-instances", cache_policy=NO_CACHE)
def sweep_instances(region: str, installation: str, endpoint_url: str | None = None) -> list[str]:
    """Terminate every instance of this installation in `region` whose flow run is not live; return
    their ids."""
    ec2 = ec2_client(region, endpoint_url or None)
    swept = sweep(ec2, flow_run_is_live, installation)
    get_run_logger().info("swept %d instance(s) in %s: %s", len(swept), region, ", ".join(swept) or "none")
    return swept
