"""Worker providers: where a job's trainers run, and how those places die.

- `base`: the seam. `Provider` (provision, watch, stop, release, stop_leftovers) and what it reports
  (`Worker`, `WatchResult`, the kill and notice reasons); `ProviderSettings`, what the controller asks
  of any provider's settings.
- `registry`: kind -> (settings model, factory); `ProviderConfig`, every kind's settings (the flow's
  parameter); `build_provider`. A new provider is one package plus its registry line.
- `local/`: trainers as subprocesses here, under a spot-market simulator (and the trainer fork server).
- `aws/`: EC2 spot instances in one region (launch, watch, placement policy, cost, IAM, sweeper).
- `trainer_env`: the environment every provider gives a trainer; `processes`: children that die with
  their parent (local trainers, a rehearsal's instances, spotrun's own Prefect server and worker).
"""

from spotrun.tasks.providers.base import (
    KillReason,
    NoticeKind,
    Provider,
    ProviderSettings,
    ProvisionError,
    StopCause,
    WatchResult,
    Worker,
    stop_cause,
)
from spotrun.tasks.providers.registry import (
    PROVIDERS,
    ProviderConfig,
    Registered,
    build_provider,
    parse_provider_config,
)

__all__ = [
    "PROVIDERS",
    "KillReason",
    "NoticeKind",
    "Provider",
    "ProviderConfig",
    "ProviderSettings",
    "ProvisionError",
    "Registered",
    "StopCause",
    "WatchResult",
    "Worker",
    "build_provider",
    "parse_provider_config",
    "stop_cause",
]
