"""The registry's factory for `kind: aws` (tasks/providers/registry.py): EC2 workers, or their local
rehearsal, tagged with this installation's id, which its sweeper requires. A module of its own so that
the registry loads boto3 only when an EC2 provider is built."""

from __future__ import annotations

from pathlib import Path

from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.installation import installation_id
from spotrun.tasks.providers.aws.provider import AwsProvider
from spotrun.tasks.providers.aws.rehearsal import RehearsalProvider
from spotrun.tasks.providers.base import Provider
from spotrun.trainer.home import spotrun_home


def build(cfg: AwsProviderConfig, workdir: Path, flow_run_id: str | None) -> Provider:
    """The provider for `cfg`; a rehearsal plays its instances as processes under `workdir`."""
    installation = installation_id(spotrun_home())
    if cfg.rehearse_locally:
        return RehearsalProvider(cfg, workdir / "instances", flow_run_id, installation)
    return AwsProvider.from_config(cfg, flow_run_id=flow_run_id, installation=installation)
