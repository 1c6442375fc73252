"""How trainer processes start: `python -m spotrun.trainer` for a distributed job (this machine's ranks under
torchrun, forked from a process that imported torch once), a forked rank's entry, and the fork server that
the local provider asks for trainers.

Modules: `start`, `rank`, `zygote`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.trainer.launch.start import LAUNCHER_ID as LAUNCHER_ID
    from spotrun.trainer.launch.start import RANK_EXITS as RANK_EXITS
    from spotrun.trainer.launch.start import RankExit as RankExit
    from spotrun.trainer.launch.start import die_with_agent as die_with_agent
    from spotrun.trainer.launch.start import relay as relay
    from spotrun.trainer.launch.start import start_ranks as start_ranks
    from spotrun.trainer.launch.start import under_torchrun as under_torchrun
    from spotrun.trainer.launch.start import write_rank_exit as write_rank_exit
    from spotrun.trainer.launch.zygote import MAX_PACKET as MAX_PACKET
    from spotrun.trainer.launch.zygote import send as send

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "LAUNCHER_ID": "start",
    "MAX_PACKET": "zygote",
    "RANK_EXITS": "start",
    "RankExit": "start",
    "die_with_agent": "start",
    "relay": "start",
    "send": "zygote",
    "start_ranks": "start",
    "under_torchrun": "start",
    "write_rank_exit": "start",
}
__getattr__ = lazy_exports(__name__, _WHERE)
