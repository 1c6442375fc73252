"""Cluster placement groups (`placement_group: true`, multi-node jobs): one per launch try, so that a
try that fails leaves its instances shutting down in a group of its own, and the next try may go to
another zone. A group is deleted once its instances are terminated: EC2 refuses while any is shutting
down, so release() waits up to GROUP_WAIT_S, and a group still in use then is deleted at the next
provision. An empty group costs nothing but counts toward the region's quota of groups."""

from __future__ import annotations

import logging
import time

from spotrun.tasks.providers.aws import launch
from spotrun.tasks.providers.aws.errors import BOTO_ERRORS, classify_error, error_code
from spotrun.tasks.providers.aws.instances import all_terminated
from spotrun.tasks.providers.aws.sites import Sites

log = logging.getLogger(__name__)

GROUP_WAIT_S = 180.0  # how long release() waits for a group's instances to be terminated


class PlacementGroups:
    """The groups one provider made and has not deleted yet, each with the instances launched in it."""

    def __init__(self, sites: Sites) -> None:
        self.sites = sites
        self.ec2 = sites.client(None)  # placement groups are refused with several regions (config.py)
        self._groups: dict[str, list[str]] = {}  # placement group -> instances launched in it, to delete

    def __contains__(self, name: object) -> bool:
        return name in self._groups

    def new(self, launch_id: str, try_index: int, tags: dict[str, str]) -> str:
        """A cluster placement group for one launch try."""
        name = launch.placement_group_name(launch_id, try_index)
        try:
            self.ec2.create_placement_group(
                GroupName=name,
                Strategy="cluster",
                TagSpecifications=launch.tag_specs(tags, "placement-group"),  # type: ignore[arg-type]
            )
        except BOTO_ERRORS as e:
            raise classify_error(e, self.sites.ctx(None)).error() from e
        self._groups[name] = []
        return name

    def add(self, name: str, instance_id: str) -> None:
        """An instance was launched in the group: it is deleted once that one is terminated."""
        self._groups[name].append(instance_id)

    def reap(self, wait_s: float) -> None:
        """Delete the placement groups whose instances are all terminated, waiting up to `wait_s` for
        them; one still in use stays for the next call."""
        deadline = time.monotonic() + wait_s
        while self._groups:
            for name, ids in list(self._groups.items()):
                if all_terminated(self.ec2, ids):
                    self._delete(name)
            if not self._groups or time.monotonic() >= deadline:
                break
            time.sleep(min(self.sites.cfg.poll_s, 5.0))
        if self._groups and wait_s > 0:
            log.warning(
                "placement group(s) %s still in use; deleted at the next provision", ", ".join(self._groups)
            )

    def _delete(self, name: str) -> None:
        try:
            self.ec2.delete_placement_group(GroupName=name)
        except BOTO_ERRORS as e:
            if error_code(e) == "InvalidPlacementGroup.InUse":
                return  # an instance is still shutting down: the next call tries again
            if error_code(e) != "InvalidPlacementGroup.Unknown":
                log.warning("could not delete placement group %s: %s; delete it by hand", name, e)
        self._groups.pop(name, None)
