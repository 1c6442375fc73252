"""The sweeper: no EC2 worker outlives its job, even when the flow process that launched it died
without releasing it (SIGKILL, a lost machine). Scheduled by the `sweep-instances` deployment."""

from __future__ import annotations

from prefect import flow

from spotrun.tasks.control.sweeping import sweep_instances as sweep_task
from spotrun.tasks.providers.aws.installation import installation_id
from spotrun.tasks.settings import spotrun_home


@flow(name="sweep-instances", description="Terminate EC2 workers whose flow run is no longer live.")
def sweep_instances(regions: list[str], endpoint_url: str | None = None) -> dict[str, list[str]]:
    installation = installation_id(spotrun_home())  # this installation's: never another's workers
    return {region: sweep_task(region, installation, endpoint_url) for region in regions}
