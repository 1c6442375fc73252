"""Launching one attempt's instances (a gang: one per node) in the best pool with capacity, and waiting
until every one runs: by RunInstances pool after pool in rank order (`first`), or by one instant EC2
Fleet over all of them (`fleet`). A capacity error, or an instance EC2 ends for lack of capacity while
pending, is noted in the placement history and moves on to the next pool.

Several nodes: node 0 is launched as above; once it runs, its private IP (where torchrun meets) goes
into the other nodes' user data and they are launched into node 0's pool, its subnet (one zone: no
cross-zone traffic, and a placement group's zone) and its instance type (the same GPUs per node).
Launching node 0 first costs one launch-to-running wait before the others start; their rendezvous
waits for the slowest boot anyway. If the others find no capacity there, every node of the try is
terminated and the whole gang tries the next pool. With `placement_group: true` each try gets a
cluster placement group of its own (groups.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spotrun.tasks.providers.aws import launch
from spotrun.tasks.providers.aws.errors import (
    BOTO_ERRORS,
    ErrorKind,
    classify_code,
    classify_error,
    error_code,
)
from spotrun.tasks.providers.aws.groups import PlacementGroups
from spotrun.tasks.providers.aws.instances import landed, terminate, terminate_on_error
from spotrun.tasks.providers.aws.policy import Market, Placement, PlacementEvent, PlacementOutcome
from spotrun.tasks.providers.aws.sites import Sites
from spotrun.tasks.providers.base import ProvisionError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """What every launch try of one attempt shares."""

    script: Callable[[launch.NodeRole | None], str]  # a node's user data (None: a single-node job)
    nnodes: int
    tags: dict[str, str]
    launch_id: str
    roots: dict[str | None, str | None]  # region (None: `region`) -> its AMI's root device name
    placement_groups: bool

    def role(self, rank: int, master_addr: str | None) -> launch.NodeRole | None:
        return launch.NodeRole(rank, self.nnodes, master_addr) if self.nnodes > 1 else None


@dataclass
class Gang:
    """The instances of one launch try, node 0 first, all running."""

    ids: list[str]
    scripts: list[str]
    landed: Placement  # node 0's pool, as EC2 reports it: the others go there too
    master_addr: str | None  # node 0's private IP
    fleet: str | None = None
    group: str | None = None  # the try's placement group


class Launches:
    """One provider's launch tries. Every launch, capacity error and failed start goes into `history`,
    the provider's own list (the re-provision policy reads it)."""

    def __init__(self, sites: Sites, groups: PlacementGroups, history: list[PlacementEvent]) -> None:
        self.sites, self.cfg, self.groups, self.history = sites, sites.cfg, groups, history

    def first(self, pools: list[Placement], plan: Plan) -> Gang:
        """Each pool in rank order until every node runs in one; capacity errors move on."""
        for i, pool in enumerate(pools):
            group = self._new_group(plan, i)
            token = f"{plan.launch_id}-{i}"
            launched = self._run_one(pool, plan, 0, master_addr=None, token=token, group=group)
            if launched is None:
                continue
            iid, script = launched
            ran = self._wait_running(iid, pool)
            if ran is None:
                continue
            where, inst = ran
            node0 = Gang([iid], [script], where, inst.get("PrivateIpAddress"), group=group)
            gang = self._with_peers(node0, plan, token)
            if gang is not None:
                return gang
        raise self._no_capacity(pools)

    def fleet(self, pools: list[Placement], plan: Plan, market: Market) -> Gang:
        """Node 0 by one instant fleet over every pool, from a per-attempt launch template deleted
        afterwards; the other nodes by RunInstances into the pool the fleet chose."""
        ec2 = self.sites.client(None)  # a fleet is refused with several regions (config.py)
        group = self._new_group(plan, 0)
        script = plan.script(plan.role(0, None))
        template = self._template(plan, script, group)
        try:
            try:
                out = ec2.create_fleet(
                    **launch.fleet_params(self.cfg, template, pools, tags=plan.tags, market=market)
                )
            except BOTO_ERRORS as e:
                found = classify_error(e, self.sites.ctx(None))
                raise (self._no_capacity(pools) if found.kind is ErrorKind.CAPACITY else found.error()) from e
            ids = [iid for made in out.get("Instances") or [] for iid in made.get("InstanceIds") or []]
            if not ids:
                raise self._fleet_refused(out.get("Errors") or [], pools)
            if group is not None:
                self.groups.add(group, ids[0])
            pool = pools[0] if len(pools) == 1 else Placement(None, None, "", market)
            ran = self._wait_running(ids[0], pool)
            if ran is None:
                raise self._no_capacity(pools)
        finally:
            try:
                ec2.delete_launch_template(LaunchTemplateId=template)
            except BOTO_ERRORS as e:  # a leftover template costs nothing; say so and go on
                log.warning("could not delete launch template %s: %s", template, e)
        where, inst = ran
        fleet = str(out.get("FleetId") or "")
        node0 = Gang(
            [ids[0]], [script], where, master_addr=inst.get("PrivateIpAddress"), fleet=fleet, group=group
        )
        gang = self._with_peers(node0, plan, f"{plan.launch_id}-0")
        if gang is None:
            raise self._no_capacity([where])
        return gang

    def _template(self, plan: Plan, script: str, group: str | None) -> str:
        """The fleet's per-attempt launch template, for node 0: its id."""
        try:
            tags0 = launch.node_tags(plan.tags, plan.role(0, None))
            data = launch.template_data(
                self.cfg,
                script,
                tags0,
                root_device=plan.roots[None],
                base=self._template_base(),
                placement_group=group,
            )
            created = self.sites.client(None).create_launch_template(
                LaunchTemplateName=f"spotrun-{plan.launch_id}",
                LaunchTemplateData=data,  # type: ignore[arg-type]
                TagSpecifications=launch.tag_specs(plan.tags, "launch-template"),  # type: ignore[arg-type]
                ClientToken=plan.launch_id,
            )
        except BOTO_ERRORS as e:
            raise classify_error(e, self.sites.ctx(None)).error() from e
        return created["LaunchTemplate"]["LaunchTemplateId"]

    def _template_base(self) -> dict[str, Any] | None:
        """The configured launch template's data, which a fleet's per-attempt template starts from."""
        lt = self.cfg.launch_template
        if lt is None:
            return None
        key = {"LaunchTemplateName": lt.name} if lt.name else {"LaunchTemplateId": lt.id or ""}
        versions = self.sites.client(None).describe_launch_template_versions(**key, Versions=[lt.version])  # type: ignore[arg-type]
        found = versions.get("LaunchTemplateVersions") or [{}]
        return dict(found[0].get("LaunchTemplateData") or {})

    def _new_group(self, plan: Plan, try_index: int) -> str | None:
        """A cluster placement group for one launch try, when the plan asks for one."""
        return self.groups.new(plan.launch_id, try_index, plan.tags) if plan.placement_groups else None

    def _run_one(
        self,
        pool: Placement,
        plan: Plan,
        rank: int,
        *,
        master_addr: str | None,
        token: str,
        group: str | None,
    ) -> tuple[str, str] | None:
        """RunInstances for one node in `pool`: (instance id, its user data), or None for lack of capacity
        (noted in the history)."""
        node = plan.role(rank, master_addr)
        script = plan.script(node)
        params = launch.run_instances_params(
            self.cfg.site(pool.region),
            pool,
            script,
            tags=launch.node_tags(plan.tags, node),
            launch_id=token,
            root_device=plan.roots[pool.region],
            placement_group=group,
        )
        try:
            iid = self.sites.client(pool.region).run_instances(**params)["Instances"][0]["InstanceId"]
        except BOTO_ERRORS as e:
            found = classify_error(e, self.sites.ctx(pool))
            self._note(pool, found.kind, found.code)
            if found.kind is ErrorKind.CAPACITY:
                log.info("%s", found.message)
                return None
            raise found.error() from e
        if group is not None:
            self.groups.add(group, iid)
        return iid, script

    def _with_peers(self, gang: Gang, plan: Plan, token: str) -> Gang | None:
        """Nodes 1.. in node 0's pool, told node 0's private IP; None (every node of the try terminated)
        when they find no capacity there."""
        if plan.nnodes == 1:
            return gang
        pool = gang.landed
        with terminate_on_error(self.sites.client(pool.region), gang.ids):
            if not gang.master_addr:
                raise ProvisionError(
                    f"instance {gang.ids[0]} has no private IP address for the other nodes to reach; "
                    "terminated it",
                    retryable=True,
                )
            for rank in range(1, plan.nnodes):
                launched = self._run_one(
                    pool, plan, rank, master_addr=gang.master_addr, token=f"{token}-n{rank}", group=gang.group
                )
                if launched is None:
                    break
                gang.ids.append(launched[0])
                gang.scripts.append(launched[1])
            else:
                if all(self._wait_running(iid, pool) is not None for iid in gang.ids[1:]):
                    return gang
        log.info(
            "no room for %d nodes in %s: terminating %s", plan.nnodes, pool.describe(), ", ".join(gang.ids)
        )
        try:
            terminate(self.sites.client(pool.region), gang.ids)
        except RuntimeError as e:  # the sweeper catches the leftover; the next pool is tried
            log.warning("%s", e)
        return None

    def _wait_running(self, iid: str, pool: Placement) -> tuple[Placement, dict[str, Any]] | None:
        """Wait until the instance runs and return where it landed and the instance as EC2 lists it; None
        if EC2 ended it for lack of capacity while pending (the next pool is tried). Terminates it on a
        timeout or an interruption."""
        deadline = time.monotonic() + self.cfg.provision_timeout_s
        with terminate_on_error(self.sites.client(pool.region), [iid]):
            while True:
                inst = self._look(iid, pool)
                state = str(inst.get("State", {}).get("Name") or "pending")
                if state == "running":
                    where = landed(inst, pool)
                    self.history.append(PlacementEvent(where, PlacementOutcome.LAUNCHED, time.time()))
                    return where, inst
                if state in ("shutting-down", "terminated", "stopping", "stopped"):
                    reason = str(inst.get("StateReason", {}).get("Code") or state)
                    found = classify_code(reason, "", self.sites.ctx(pool))
                    self._note(landed(inst, pool), found.kind, reason)
                    if found.kind is ErrorKind.CAPACITY:
                        return None
                    raise ProvisionError(f"instance {iid} ended while starting ({reason})", retryable=True)
                if time.monotonic() > deadline:
                    limit = f"{self.cfg.provision_timeout_s:g} s"
                    raise ProvisionError(
                        f"instance {iid} not running after {limit}; terminated it", retryable=True
                    )
                time.sleep(min(self.cfg.poll_s, 2.0))

    def _look(self, iid: str, pool: Placement) -> dict[str, Any]:
        """The instance as EC2 lists it; {} while it does not yet (eventual consistency after a launch)
        or while EC2 throttles. Errors that will not pass are raised as a ProvisionError."""
        try:
            out = self.sites.client(pool.region).describe_instances(InstanceIds=[iid])
        except BOTO_ERRORS as e:
            if error_code(e) == "InvalidInstanceID.NotFound":
                return {}
            found = classify_error(e, self.sites.ctx(pool))
            if not found.retryable:
                raise found.error() from e
            log.warning("%s: %s", iid, found.message)
            return {}
        listed = [i for r in out.get("Reservations", []) for i in r.get("Instances", [])]
        return dict(listed[0]) if listed else {}

    def _note(self, pool: Placement, kind: ErrorKind, code: str) -> None:
        outcome = PlacementOutcome.CAPACITY if kind is ErrorKind.CAPACITY else PlacementOutcome.FAILED
        self.history.append(PlacementEvent(pool, outcome, time.time(), code))

    def _fleet_refused(self, errors: list[Any], pools: list[Placement]) -> ProvisionError:
        """The error for a fleet that launched nothing: the first non-capacity error, else no capacity."""
        for err in errors:
            o = (err.get("LaunchTemplateAndOverrides") or {}).get("Overrides") or {}
            pool = Placement(
                o.get("SubnetId"), o.get("AvailabilityZone"), o.get("InstanceType", ""), pools[0].market
            )
            found = classify_code(
                str(err.get("ErrorCode") or ""), str(err.get("ErrorMessage") or ""), self.sites.ctx(pool)
            )
            self._note(pool, found.kind, found.code)
            if found.kind is not ErrorKind.CAPACITY:
                return found.error()
        return self._no_capacity(pools)

    def _no_capacity(self, pools: list[Placement]) -> ProvisionError:
        types = sorted({p.instance_type for p in pools})
        zones = sorted({p.az or p.subnet or "any zone" for p in pools})
        market = pools[0].market if pools else "spot"
        regions = sorted({p.region or self.cfg.region for p in pools} or {self.cfg.region})
        where = f"{', '.join(types)} in {', '.join(zones)} ({', '.join(regions)})"
        return ProvisionError(f"no {market} capacity for {where}; will try again", retryable=True)
