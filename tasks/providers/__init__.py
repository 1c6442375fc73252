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

from spotrun.tasks.providers.base import KillReason as KillReason
from spotrun.tasks.providers.base import NoticeKind as NoticeKind
from spotrun.tasks.providers.base import Provider as Provider
from spotrun.tasks.providers.base import ProviderSettings as ProviderSettings
from spotrun.tasks.providers.base import ProvisionError as ProvisionError
from spotrun.tasks.providers.base import StopCause as StopCause
from spotrun.tasks.providers.base import WatchResult as WatchResult
from spotrun.tasks.providers.base import Worker as Worker
from spotrun.tasks.providers.base import stop_cause as stop_cause
from spotrun.tasks.providers.registry import PROVIDERS as PROVIDERS
from spotrun.tasks.providers.registry import ProviderConfig as ProviderConfig
from spotrun.tasks.providers.registry import Registered as Registered
from spotrun.tasks.providers.registry import build_provider as build_provider
from spotrun.tasks.providers.registry import parse_provider_config as parse_provider_config
