"""The whole notice story: a stop request (SIGTERM or a cloud notice), training through the notice until
the replacement stands by, the emergency save that fits before the deadline, and the lease that passes
the job's storage from the old trainer to the new one.

A change here changes how a trainer gives way. Modules, in the order a reclaim meets them:
- `requests`: stop requests: signals and notices end in one flag read at the step boundary.
- `notices`: the metadata-service watcher that turns a cloud notice into a stop request.
- `handover`: the standby object a replacement writes; how long the old trainer trains on.
- `stopping`: the handover gate (when to stop) and the emergency-save plan (whether a save fits).
- `lease`: one writer per job; the controller's handoff of a dead worker's lease.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.trainer.preemption.handover import ANNOUNCE_S as ANNOUNCE_S
    from spotrun.trainer.preemption.handover import write_standby as write_standby
    from spotrun.trainer.preemption.lease import DEFAULT_TTL_S as DEFAULT_TTL_S
    from spotrun.trainer.preemption.lease import FencedStorage as FencedStorage
    from spotrun.trainer.preemption.lease import Holder as Holder
    from spotrun.trainer.preemption.lease import Lease as Lease
    from spotrun.trainer.preemption.lease import LeaseView as LeaseView
    from spotrun.trainer.preemption.lease import held as held
    from spotrun.trainer.preemption.lease import needs_lease as needs_lease
    from spotrun.trainer.preemption.lease import write_handoff as write_handoff
    from spotrun.trainer.preemption.notices import Notice as Notice
    from spotrun.trainer.preemption.notices import make_watcher as make_watcher
    from spotrun.trainer.preemption.requests import SavePlan as SavePlan
    from spotrun.trainer.preemption.requests import StopRequest as StopRequest
    from spotrun.trainer.preemption.requests import install_signal_handlers as install_signal_handlers
    from spotrun.trainer.preemption.stopping import HandoverGate as HandoverGate
    from spotrun.trainer.preemption.stopping import HandoverOptions as HandoverOptions
    from spotrun.trainer.preemption.stopping import SaveCost as SaveCost
    from spotrun.trainer.preemption.stopping import agreed_plan as agreed_plan
    from spotrun.trainer.preemption.stopping import emergency_plan as emergency_plan

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "ANNOUNCE_S": "handover",
    "DEFAULT_TTL_S": "lease",
    "FencedStorage": "lease",
    "HandoverGate": "stopping",
    "HandoverOptions": "stopping",
    "Holder": "lease",
    "Lease": "lease",
    "LeaseView": "lease",
    "Notice": "notices",
    "SaveCost": "stopping",
    "SavePlan": "requests",
    "StopRequest": "requests",
    "agreed_plan": "stopping",
    "emergency_plan": "stopping",
    "held": "lease",
    "install_signal_handlers": "requests",
    "make_watcher": "notices",
    "needs_lease": "lease",
    "write_handoff": "lease",
    "write_standby": "handover",
}
__getattr__ = lazy_exports(__name__, _WHERE)
