"""The ranks of one attempt: the process group, how the model is wrapped, and what ranks agree on.

Every decision that changes what a rank does next is taken together, or one rank would wait forever
in a collective the others never enter: whether to stop (a SIGTERM or notice seen by any rank), whether
a time-triggered checkpoint is due (clocks differ), whether the loss diverged, where to resume, and
whether an emergency checkpoint fits before the deadline. Per step that is one all-reduce of three
numbers (loss, stop, due) on the training group: median 0.35 ms on gloo, 2 ranks of a loaded 2-core
machine (measured, 2,000 calls); the mean
loss it yields is what the metrics record, the same number whatever the world size.

Checkpoint traffic (DCP's plans, the commit protocol's gather) runs on a second gloo group from the
checkpoint thread, so it never interleaves with the training group's collectives.

Without a `distributed` spec, `Ranks.solo()` answers the same questions for one process, locally.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import DistributedOptions

log = logging.getLogger(__name__)

# A hung (alive but silent) peer is caught only by the process group's timeout (a dead one in ~15 ms:
# the socket resets): training's collectives wait at most this long. The checkpoint group waits
# longer: rank 0 may spend minutes fetching and validating a large checkpoint while the rest wait.
PG_TIMEOUT = datetime.timedelta(minutes=5)
CKPT_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class Agreement:
    """What all ranks decided at a step boundary."""

    loss: float  # the mean over ranks (one rank: its own loss, untouched)
    stop: bool  # some rank has a stop request
    due: bool  # some rank's clock says a checkpoint is due
    failed: bool = False  # some rank's background save ended in an error (a lost lease, a failed save)


@dataclass
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str | None = None  # ddp | fsdp; None: one process, no process group
    ckpt_group: Any = None  # gloo group for checkpoint collectives

    @classmethod
    def solo(cls) -> Ranks:
        return cls()

    @classmethod
    def start(cls, opts: DistributedOptions, env: Mapping[str, str], device_type: str) -> Ranks:
        """Join the process group torchrun set up for this rank (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
        backend = opts.backend if opts.backend != "auto" else ("nccl" if device_type == "cuda" else "gloo")
        if backend == "nccl" and device_type != "cuda":
            raise ConfigError("distributed.backend: nccl needs CUDA; use backend: auto or gloo on CPU")
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        expected = opts.world_size(
            int(env.get("LOCAL_WORLD_SIZE", "1")) if opts.nproc_per_node == "auto" else 0
        )
        if world != expected:
            raise ConfigError(
                f"distributed: the spec makes {expected} rank(s), torchrun started {world}; "
                "run `python -m spotrun.trainer` without torchrun and let it start the ranks"
            )
        local = int(env.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=PG_TIMEOUT)
        ckpt = dist.new_group(backend="gloo", timeout=CKPT_TIMEOUT)
        return cls(rank, world, local, strategy=opts.strategy, ckpt_group=ckpt)

    @property
    def distributed(self) -> bool:
        return self.strategy is not None

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    def agree(self, loss: float, stop: bool, due: bool, failed: bool = False) -> Agreement:
        """One all-reduce a step. `failed`: this rank's saver holds an error; the verdict of a sharded
        save reaches every rank's saver in one broadcast, so the others wait for theirs and all stop at
        the same step (one rank stopping alone would leave the rest in the next collective)."""
        if not self.distributed:
            return Agreement(loss, stop, due, failed)
        t = torch.tensor(
            [loss, float(stop), float(due), float(failed)], dtype=torch.float64, device=_device()
        )
        dist.all_reduce(t)
        total, stops, dues, failures = t.tolist()
        return Agreement(total / self.world_size, stops > 0, dues > 0, failures > 0)

    def all_true(self, flag: bool) -> bool:
        """Whether every rank says yes (an emergency save only if every rank can finish it in time)."""
        if not self.distributed:
            return flag
        t = torch.tensor([0.0 if flag else 1.0], dtype=torch.float64, device=_device())
        dist.all_reduce(t)
        return bool(t.item() == 0)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.ckpt_group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.ckpt_group)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (None elsewhere), over the checkpoint group."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.ckpt_group)
        return out

    def fail_together(self, error: str | None) -> None:
        """Raise on every rank if any rank has an error (the lowest rank's line), before a collective
        step that a failed rank would never enter (loading a checkpoint)."""
        errors = self.all_gather(error)
        first = next(((r, e) for r, e in enumerate(errors) if e), None)
        if first is not None:
            raise ConfigError(first[1] if first[0] == self.rank else f"rank {first[0]}: {first[1]}")

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    def device(self, base: torch.device) -> torch.device:
        return torch.device("cuda", self.local_rank) if base.type == "cuda" and self.distributed else base


def _device() -> torch.device:
    # NCCL's collectives take CUDA tensors; gloo's CPU ones
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wrap(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks) -> torch.nn.Module:
    """DDP or FSDP2 around the recipe's model. FSDP2 replaces every parameter with a sharded one, so
    the optimizer the recipe built is re-pointed at them, group by group (its state is still empty)."""
    if ranks.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [ranks.local_rank] if next(model.parameters()).is_cuda else None
        return DDP(model, device_ids=ids)
    if ranks.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        names = {id(p): n for n, p in model.named_parameters()}
        for unit in shard_units(model):
            fully_shard(unit)
        fully_shard(model)
        rebind_optimizer(optimizer, names, dict(model.named_parameters()))
        return model
    return model


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards one by one (each all-gathers its parameters only while it runs): the
    members of every ModuleList, as torchtitan shards a transformer's layers; the root takes the rest."""
    return [block for m in model.modules() if isinstance(m, torch.nn.ModuleList) for block in m]


def rebind_optimizer(
    optimizer: torch.optim.Optimizer, names: dict[int, str], params: dict[str, torch.nn.Parameter]
) -> None:
    if optimizer.state:
        raise RuntimeError("rebind_optimizer: the optimizer already holds state")
    for group in optimizer.param_groups:
        group["params"] = [params[names[id(p)]] for p in group["params"]]


def rank_env() -> dict[str, str]:
    """torchrun's variables for this rank, for `Ranks.start` (read once at the process edge)."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: os.environ[k] for k in keys if k in os.environ}
