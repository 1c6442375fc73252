"""The workers one provider has running, for the warm standby (`warm: 1`, tasks/control/warm.py): the
controller provisions the next attempt's worker when this one starts training.

Any instance provisioned while another of this provider runs goes to another zone first (`zones`, fed
to policy.apart_from): one zone's reclaim would otherwise take both. With one zone configured (or every
other zone out of capacity) it lands beside the running worker, with one warning per provider
(`warn_if_shared`), and still serves a reclaim of that instance alone. The standby is not watched until
it takes over, so the running worker's watch renews its `spotrun:lease-until` tag too
(`renew_others`): the sweeper leaves it alone while the flow lives.
"""

from __future__ import annotations

import logging

from spotrun.tasks.providers.aws.errors import BOTO_ERRORS
from spotrun.tasks.providers.aws.launch import TAG_LEASE, lease_value
from spotrun.tasks.providers.aws.sites import Sites
from spotrun.tasks.providers.aws.watch import AwsWorkerState

log = logging.getLogger(__name__)


class LiveWorkers:
    """Provisioned and not yet released, by worker id (a prewarm thread adds while the main thread
    releases: every walk is over a copy)."""

    def __init__(self, sites: Sites) -> None:
        self.sites = sites
        self._live: dict[str, AwsWorkerState] = {}
        self._shared_zone_warned = False

    def add(self, worker_id: str, state: AwsWorkerState) -> None:
        self._live[worker_id] = state

    def drop(self, worker_id: str) -> None:
        self._live.pop(worker_id, None)

    def zones(self) -> set[str]:
        """The zones the live workers run in: a new one goes elsewhere first."""
        return {z for st in list(self._live.values()) if (z := st.placement.az) is not None}

    def warn_if_shared(self, instance_id: str, az: str | None, busy: set[str]) -> None:
        """Once per provider: a standby landed in a zone a running worker is in."""
        if az in busy and not self._shared_zone_warned:
            self._shared_zone_warned = True
            log.warning(
                "%s shares %s with a running worker (no other zone configured or with capacity): "
                "a reclaim of that zone takes both; add subnets in other zones",
                instance_id,
                az,
            )

    def renew_others(self, watched: str) -> None:
        """Push the lease of every live instance but the watched worker's forward: a standby is not
        watched until it takes over, and the sweeper would end it once its launch lease ran out."""
        for wid, st in list(self._live.items()):
            if wid == watched:
                continue
            try:
                self.sites.client(st.placement.region).create_tags(
                    Resources=st.instance_ids,
                    Tags=[{"Key": TAG_LEASE, "Value": lease_value(self.sites.cfg.lease_s)}],
                )
            except BOTO_ERRORS as e:  # retried at the next renewal; the lease still has time
                log.warning("could not renew the lease of standby %s: %s", wid, e)
