"""The `local` provider (`kind: local`): each worker is a `python -m spotrun.trainer` subprocess on this
machine,
reclaimed on a plan by a spot-market simulator, so that a job's recovery is rehearsed before anyone pays
for GPUs.

- `config`: its settings (`LocalProviderConfig`) and the simulator's plan (`SpotSimulatorConfig`,
  `PlannedPreemption`, `plan_preemption`, `simulator_rng`).
- `provider`: `LocalProvider`, its factory `build`, where a job's workers keep their files
  (`worker_dir`) and how their threads wait (`OMP_WAIT`).
- `market`: the replay of a spot capacity trace (`TraceMarket`): where a spot worker starts, when its
  zone's capacity is gone, what an attempt costs.
- `fork_server`: trainers forked from a server that imported torch once (seconds less per attempt).
"""

from spotrun.tasks.providers.local.config import (
    LocalProviderConfig,
    PlannedPreemption,
    SpotSimulatorConfig,
    plan_preemption,
    simulator_rng,
)
from spotrun.tasks.providers.local.provider import OMP_WAIT, LocalProvider, build, worker_dir

__all__ = [
    "OMP_WAIT",
    "LocalProvider",
    "LocalProviderConfig",
    "PlannedPreemption",
    "SpotSimulatorConfig",
    "build",
    "plan_preemption",
    "simulator_rng",
    "worker_dir",
]
