"""Worker providers: one Protocol (`base.Provider`); the local spot simulator and EC2 spot behind it.

`ProviderConfig` is what the flow takes: either provider's typed settings, told apart by `kind`, so
the Prefect UI offers a choice and then that provider's form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field

from tasks.providers.aws_config import AwsProviderConfig
from tasks.providers.base import Provider
from tasks.providers.local import LocalProvider, LocalProviderConfig

ProviderConfig = Annotated[LocalProviderConfig | AwsProviderConfig, Field(discriminator="kind")]


def build_provider(cfg: LocalProviderConfig | AwsProviderConfig, workdir: Path, flow_run_id: str) -> Provider:
    """The provider for `cfg`; local workers keep their files under `workdir` unless set."""
    if isinstance(cfg, AwsProviderConfig):
        return _aws_provider(cfg, workdir, flow_run_id or None)
    if cfg.workdir is None:
        cfg = cfg.model_copy(update={"workdir": str(workdir)})
    return LocalProvider(cfg, flow_run_id or None)


def _aws_provider(cfg: AwsProviderConfig, workdir: Path, flow_run_id: str | None) -> Provider:
    """EC2 workers (or their rehearsal) tagged with this installation's id, which its sweeper requires."""
    from tasks.providers.aws_installation import installation_id
    from tasks.settings import spotrun_home

    installation = installation_id(spotrun_home())
    if cfg.rehearse_locally:
        from tasks.providers.aws_rehearsal import RehearsalProvider

        return RehearsalProvider(cfg, workdir / "instances", flow_run_id, installation)
    from tasks.providers.aws import AwsProvider  # boto3 loads only when EC2 is used

    return AwsProvider.from_config(cfg, flow_run_id=flow_run_id, installation=installation)
