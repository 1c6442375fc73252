"""What the controller accepts before it starts anything: trust from where (what a deployment run's
parameters may name on this worker host) and whether a job's entry point imports.

Modules: `trust`, `entrypoint_check`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.tasks.admission.entrypoint_check import entrypoint_refusal as entrypoint_refusal
    from spotrun.tasks.admission.trust import Allowed as Allowed
    from spotrun.tasks.admission.trust import named as named
    from spotrun.tasks.admission.trust import refuse_untrusted_parameters as refuse_untrusted_parameters
    from spotrun.tasks.admission.trust import signing_refusal as signing_refusal
    from spotrun.tasks.admission.trust import write_allowed as write_allowed

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "Allowed": "trust",
    "entrypoint_refusal": "entrypoint_check",
    "named": "trust",
    "refuse_untrusted_parameters": "trust",
    "signing_refusal": "trust",
    "write_allowed": "trust",
}
__getattr__ = lazy_exports(__name__, _WHERE)
