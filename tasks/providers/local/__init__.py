"""The `local` provider (`kind: local`): each worker is a `python -m spotrun.trainer` subprocess on this
machine, reclaimed on a plan by a spot-market simulator, so that a job's recovery is rehearsed before anyone
pays for GPUs.

- `config`: its settings (`LocalProviderConfig`) and the simulator's plan (`SpotSimulatorConfig`,
  `PlannedPreemption`, `plan_preemption`, `simulator_rng`).
- `provider`: `LocalProvider`, its factory `build`, where a job's workers keep their files
  (`worker_dir`) and how their threads wait (`OMP_WAIT`).
- `market`: the replay of a spot capacity trace (`TraceMarket`): where a spot worker starts, when its
  zone's capacity is gone, what an attempt costs.
- `fork_server`: trainers forked from a server that imported torch once (seconds less per attempt).
"""

from spotrun.tasks.providers.local.config import LocalProviderConfig as LocalProviderConfig
from spotrun.tasks.providers.local.config import PlannedPreemption as PlannedPreemption
from spotrun.tasks.providers.local.config import SpotSimulatorConfig as SpotSimulatorConfig
from spotrun.tasks.providers.local.config import plan_preemption as plan_preemption
from spotrun.tasks.providers.local.config import simulator_rng as simulator_rng
from spotrun.tasks.providers.local.provider import OMP_WAIT as OMP_WAIT
from spotrun.tasks.providers.local.provider import LocalProvider as LocalProvider
from spotrun.tasks.providers.local.provider import build as build
from spotrun.tasks.providers.local.provider import worker_dir as worker_dir
