"""Several processes, one job: the ranks of an attempt (process group, model wrapping, what ranks agree
on), where a one-node job's ranks meet, and torchrun without its traceback.

Modules: `ranks`, `rendezvous`, `agent`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.trainer.distributed.agent import run_forked as run_forked
    from spotrun.trainer.distributed.ranks import Ranks as Ranks
    from spotrun.trainer.distributed.ranks import rank_env as rank_env
    from spotrun.trainer.distributed.ranks import wrap as wrap
    from spotrun.trainer.distributed.rendezvous import LOOPBACK as LOOPBACK
    from spotrun.trainer.distributed.rendezvous import STORE_FD as STORE_FD

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "LOOPBACK": "rendezvous",
    "Ranks": "ranks",
    "STORE_FD": "rendezvous",
    "rank_env": "ranks",
    "run_forked": "agent",
    "wrap": "ranks",
}
__getattr__ = lazy_exports(__name__, _WHERE)
