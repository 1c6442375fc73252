"""The `aws` provider: each attempt runs on a fresh EC2 spot instance in one pinned region, or for a
multi-node job (`distributed.nnodes` = K) on K instances launched and released together.

`AwsProvider` is the seam (tasks/providers/base.py `Provider`) that composes the package's rooms:

- provision: the user data (launch.py) writes the job file and execs the trainer; the (subnet,
  instance type) pools are ranked by the re-provision policy (policy.py) over the job's placement
  history and EC2's spot placement scores (sites.py: the regions, their zones, AMIs and clients); the
  instances are launched into the best pool with capacity, by RunInstances pool after pool or by one
  instant EC2 Fleet over all of them, node 0 first and the other nodes into its pool (gang.py), each
  try of a multi-node job in a cluster placement group of its own if asked (groups.py); the attempt
  is priced at its launch (cost.py).
- watch: EC2 and the trainer's heartbeat object (watch.py); a notice marks the pool in the history at
  once, and the attempt's end marks it again.
- release: terminate every node's instance (instances.py) and delete the try's placement group.

Every EC2 error is mapped in errors.py. Instances carry `spotrun:*` tags, so that the sweeper
(sweeper.py) can terminate those of this installation whose flow run has died, and IAM can scope
permissions (iam.py). One Worker holds every instance of an attempt: the end of any one ends the
attempt (watch.py), and release terminates them all.

Warm standby (`warm: 1`, standby.py): an instance provisioned while another of this provider runs goes
to another zone first, and the running worker's watch renews the unwatched standby's lease.
Multi-node jobs are refused: a standby gang is not built.

The EC2 clients are given (clients.py: `make_ec2_client` and `make_ec2_clients` build them, one per
region); the provider never builds one itself.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3

from spotrun.tasks.market.prices import Prices
from spotrun.tasks.providers.aws import launch
from spotrun.tasks.providers.aws.clients import ec2_client as ec2_client
from spotrun.tasks.providers.aws.clients import make_ec2_client, make_ec2_clients
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.cost import Cost, attempt_cost, launch_prices
from spotrun.tasks.providers.aws.errors import BOTO_ERRORS
from spotrun.tasks.providers.aws.gang import Gang, Launches, Plan
from spotrun.tasks.providers.aws.groups import GROUP_WAIT_S, PlacementGroups
from spotrun.tasks.providers.aws.instances import terminate, terminate_on_error
from spotrun.tasks.providers.aws.policy import (
    Market,
    PlacementEvent,
    PlacementOutcome,
    apart_from,
    choose_market,
)
from spotrun.tasks.providers.aws.prices import quote
from spotrun.tasks.providers.aws.sites import Sites
from spotrun.tasks.providers.aws.standby import LiveWorkers
from spotrun.tasks.providers.aws.sweeper import sweep_flow_run
from spotrun.tasks.providers.aws.watch import SPOT_INTERRUPTION, AwsWorkerState, ExitStatus, WorkerWatch
from spotrun.tasks.providers.base import (
    LogCallback,
    ProvisionError,
    StatusCallback,
    StopCause,
    WarmSettings,
    WatchResult,
    Worker,
)
from spotrun.trainer.storage import Storage
from spotrun.trainer.storage.registry import is_local
from spotrun.trainer.telemetry.heartbeat import HEARTBEAT_EVERY_S
from spotrun.trainer.telemetry.records import Notice, Record

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

    from spotrun.trainer.spec.job import JobSpec


log = logging.getLogger(__name__)

Launcher = Callable[[str, str], None]  # (instance id, user-data script): a test plays the instance
# A noticed instance trains on for up to this long while its replacement boots; the trainer keeps what
# the emergency checkpoint needs before the notice's deadline (save_margin_s included) on top of it.
HANDOVER_S = 100.0


class _Unasked:
    """`AwsProvider.prices` before EC2 was asked."""


_UNASKED = _Unasked()


def default_store(job: JobSpec) -> Storage:
    return job.open_storage()


class AwsProvider:
    """EC2 spot workers; see the module docstring."""

    name = "aws"

    def __init__(
        self,
        cfg: AwsProviderConfig,
        ec2: EC2Client,
        *,
        flow_run_id: str | None = None,
        installation: str | None = None,
        launcher: Launcher | None = None,
        exit_status: ExitStatus | None = None,
        history: list[PlacementEvent] | None = None,
        open_store: Callable[[JobSpec], Storage] = default_store,
        regions_ec2: Mapping[str, EC2Client] | None = None,
    ) -> None:
        self.prewarm = cfg.prewarm
        self.warm = WarmSettings(cfg.warm, cfg.warm_idle_s)  # a standby instance (control/warm.py)
        self.heartbeat_timeout_s = cfg.heartbeat_timeout_s
        # a rebalance recommendation starts the replacement too; it stands by this long for the notice
        self.rebalance_wait_s = cfg.rebalance_prewarm_s if cfg.prewarm else None
        self.capacity_poll_s = 30.0  # a spot pool without capacity: asked again this often
        self._prices: Prices | _Unasked | None = _UNASKED  # asked of EC2 at the first read (prices.py)
        self.cfg, self.ec2, self.flow_run_id = cfg, ec2, flow_run_id
        self.sites = Sites(cfg, {cfg.region: ec2, **(regions_ec2 or {})})  # one client per region
        self.installation = installation  # None: untagged, so no sweeper or adopting controller ends them
        self.launcher, self.exit_status, self.open_store = launcher, exit_status, open_store
        self.history: list[PlacementEvent] = list(history or [])  # this provider's launches and ends
        self.groups = PlacementGroups(self.sites)
        self.launches = Launches(self.sites, self.groups, self.history)  # appends to the same history
        self.live = LiveWorkers(self.sites)  # a standby's zone avoids theirs; their leases are renewed
        self._released_peers: list[str] = []  # the other nodes of the worker released last

    @property
    def prices(self) -> Prices | None:
        """An hour on each market for the budget check at submission: the cheapest spot price of the
        configured types in the subnets' zones, and the on-demand price (prices.py); asked of EC2 once,
        at the first read. None when EC2 or the config will not say (the check then waits)."""
        if isinstance(self._prices, _Unasked):
            try:
                azs, _ = self.sites.lookups()
                zones: set[str] | None = set(azs.values()) or None
            except ProvisionError:  # a setup error: the first provision stops with its line
                zones = None
            self._prices = quote(self.cfg, self.sites.clients, zones)
        return self._prices

    @prices.setter
    def prices(self, value: Prices | None) -> None:
        self._prices = value

    @classmethod
    def from_config(
        cls, cfg: AwsProviderConfig, session: boto3.session.Session | None = None, **kwargs: Any
    ) -> AwsProvider:
        return cls(cfg, make_ec2_client(cfg, session), regions_ec2=make_ec2_clients(cfg, session), **kwargs)

    def provision(
        self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str], *, market: Market = "spot"
    ) -> Worker:
        """Launch the attempt's instance (one per node) in the best pool with capacity and wait until
        every one runs."""
        text = self._job_text(job, spec_path)
        nnodes = job.distributed.nnodes if job.distributed is not None else 1
        if self.warm.size and nnodes > 1:
            raise ProvisionError(
                f"provider.warm: a standby of {nnodes} nodes is not built on EC2; set warm: 0, or run "
                "the job on one node",
                retryable=False,
            )
        args = self._trainer_args(extra_args, nnodes)
        script = launch.user_data_for(self.cfg, job, attempt, text=text, extra_args=args)
        script(launch.NodeRole(0, nnodes, None) if nnodes > 1 else None)  # refused before anything launches
        azs, roots = self.sites.lookups()
        self.groups.reap(0.0)  # those earlier attempts left in use
        if market == "spot":  # the controller's policy left it to the fallback rules
            market = choose_market(self.cfg, self.history, time.time())
        ranked = self.sites.rank(self.history, azs, market, nnodes)
        busy = self.live.zones()
        pools = apart_from(ranked, busy)
        plan = self._plan(job, attempt, script=script, nnodes=nnodes, roots=roots)
        store = self.open_store(job)
        if self.cfg.allocation == "fleet":  # a fleet picks among the pools it is given: only those apart
            gang = self.launches.fleet([p for p in pools if p.az not in busy] or pools, plan, market)
        else:
            gang = self.launches.first(pools, plan)
        ec2 = self.sites.client(gang.landed.region)
        with terminate_on_error(ec2, gang.ids):  # until the caller holds the worker, it is ours to end
            state = self._worker_state(gang, plan, store)
            self._announce(attempt, gang, plan)
            if self.warm.size:
                self.live.warn_if_shared(gang.ids[0], gang.landed.az, busy)
            if self.launcher is not None:
                for iid, s in zip(gang.ids, gang.scripts, strict=True):
                    self.launcher(iid, s)
        self.live.add(gang.ids[0], state)
        return Worker(gang.ids[0], self.name, attempt, started_at=state.launched_at, handle=state)

    def _trainer_args(self, extra_args: list[str], nnodes: int) -> list[str]:
        """The trainer's command-line words on the instance: the caller's, and the storage lease's and
        the handover's."""
        # The controller names the worker it released (node 0) for the storage lease; torchrun may have
        # put global rank 0, the lease holder, on another node (watch.py), released as surely.
        args = [*extra_args, *(a for p in self._released_peers for a in ("--lease-takeover", p))]
        if self.prewarm and nnodes == 1:  # train through the 2-minute notice while the replacement boots
            # the controller sees the notice at its next look at the heartbeat (written at once)
            announce = self.cfg.poll_s + HEARTBEAT_EVERY_S
            args += ["--handover-s", f"{HANDOVER_S:g}", "--announce-s", f"{announce:g}"]
        return args

    def _plan(
        self,
        job: JobSpec,
        attempt: int,
        *,
        script: Callable[[launch.NodeRole | None], str],
        nnodes: int,
        roots: dict[str | None, str | None],
    ) -> Plan:
        """What every launch try of the attempt shares: its launch id (the idempotency token) and tags."""
        launch_id = f"{job.name[:40]}-a{attempt}-{uuid.uuid4().hex[:8]}"
        tags = launch.launch_tags(
            self.cfg,
            job.name,
            attempt,
            launch_id=launch_id,
            flow_run_id=self.flow_run_id,
            installation=self.installation,
        )
        groups = self.cfg.placement_group and nnodes > 1
        return Plan(script, nnodes, tags, launch_id=launch_id, roots=roots, placement_groups=groups)

    def _worker_state(self, gang: Gang, plan: Plan, store: Storage) -> AwsWorkerState:
        """Worker.handle of the gang just launched, priced at the launch."""
        where = gang.landed
        price, od = launch_prices(self.sites.client(where.region), self.cfg, where, plan.nnodes)
        return AwsWorkerState(
            instance_id=gang.ids[0],
            placement=where,
            launch_id=plan.launch_id,
            launched_at=time.time(),
            price_per_h=price,
            on_demand_price_per_h=od,
            storage=store,
            fleet_id=gang.fleet,
            peers=gang.ids[1:],
            master_addr=gang.master_addr,
            placement_group=gang.group,
        )

    def _announce(self, attempt: int, gang: Gang, plan: Plan) -> None:
        n = plan.nnodes
        nodes = f"{n} nodes {', '.join(gang.ids)} at {gang.master_addr}" if n > 1 else gang.ids[0]
        log.info(
            "attempt %d: %s running (%s, launch %s)", attempt, nodes, gang.landed.describe(), plan.launch_id
        )

    def _job_text(self, job: JobSpec, spec_path: Path) -> str:
        """The job file for the user data; warnings for a job that would run poorly on EC2."""
        if not spec_path.is_file():
            raise ProvisionError(f"job file {spec_path} does not exist", retryable=False)
        if job.preemption.notice != "aws":
            log.warning("job %s: set preemption.notice: aws to checkpoint on EC2's 2-minute notice", job.name)
        if is_local(job.storage) and self.cfg.endpoint_url is None:
            log.warning("job storage %s is a local directory: an EC2 worker cannot reach it", job.storage)
        return spec_path.read_text()

    def watch(
        self, worker: Worker, on_status: StatusCallback | None = None, on_log: LogCallback | None = None
    ) -> WatchResult:
        """Poll the instance and the heartbeat until the worker is gone. There is no log stream from an
        instance: `on_log` is not called, and `log_tail` is the console output when no exit record came.
        The attempt's cost lands in `result.facts["cost"]` (a `Cost` as a dict)."""
        state: AwsWorkerState = worker.handle
        noticed = False

        def status(rec: Record) -> None:
            # A spot notice (or a rebalance recommendation) marks the pool at once, before the controller
            # hears of it: the replacement it provisions then (tasks/control/prewarm.py) must land
            # elsewhere, as a retry would.
            nonlocal noticed
            if isinstance(rec, Notice) and rec.stop and not noticed:
                noticed = True
                self.history.append(PlacementEvent(state.placement, PlacementOutcome.PREEMPTED, time.time()))
            elif isinstance(rec, Notice) and not rec.stop:
                self.history.append(PlacementEvent(state.placement, PlacementOutcome.REBALANCE, time.time()))
            if on_status is not None:
                on_status(rec)

        result = WorkerWatch(
            self.sites.client(state.placement.region),
            self.cfg,
            worker,
            on_status=status,
            exit_status=self.exit_status,
            renew_others=lambda: self._renew_standbys(worker.id),
        ).run()
        result.facts["cost"] = asdict(attempt_cost(state, result.ended_at))
        reclaimed = result.notice_kind == SPOT_INTERRUPTION or (
            result.trainer_code == "PREEMPTED" and state.released_at is None
        )
        if not (noticed and reclaimed):
            outcome = PlacementOutcome.PREEMPTED if reclaimed else PlacementOutcome.ENDED
            self.history.append(PlacementEvent(state.placement, outcome, result.ended_at))
        return result

    def stop(self, worker: Worker, cause: StopCause) -> WatchResult:
        """Nothing to wait for: an interrupted watch does not wait either. The release that follows
        terminates the instance, and its shutdown is the trainer's SIGTERM (its emergency checkpoint)."""
        result = worker.result = worker.result or WatchResult(started_at=worker.started_at)
        result.stopped_by, result.ended_at = cause, time.time()
        return result

    def release(self, worker: Worker) -> None:
        """Terminate the instance (every node's). Idempotent: an instance already gone is fine. A failure
        to terminate raises (an instance left running costs money; the sweeper is the backstop). With a
        placement group, wait (up to GROUP_WAIT_S) for the instances to be gone and delete it."""
        state: AwsWorkerState = worker.handle
        if state.released_at is None:
            state.released_at = time.time()
        self.live.drop(worker.id)
        terminate(self.sites.client(state.placement.region), state.instance_ids)
        self._released_peers = list(state.peers)
        if state.placement_group is not None and state.placement_group in self.groups:
            self.groups.reap(GROUP_WAIT_S)

    def _renew_standbys(self, watched: str) -> None:
        """The leases of the live workers but the watched one (standby.py)."""
        self.live.renew_others(watched)

    def stop_leftovers(self, flow_run_id: str) -> list[str]:
        """Terminate the instances a dead controller's flow run left (found by its tags, from any host);
        their trainers get the OS's SIGTERM at shutdown. Returns their ids (the newest last)."""
        if self.installation is None:
            return []  # launched untagged: nothing to find them by
        found: list[str] = []
        for region, ec2 in self.sites.clients.items():
            try:
                found += sweep_flow_run(ec2, flow_run_id, self.installation)
            except BOTO_ERRORS as e:  # the sweeper deployment is the backstop; the new trainer's lease waits
                log.warning("could not look for instances of flow run %s in %s: %s", flow_run_id, region, e)
        return found

    def cost(self, worker: Worker, ended_at: float | None = None) -> Cost:
        """The attempt's cost so far (or up to `ended_at`)."""
        return attempt_cost(worker.handle, ended_at if ended_at is not None else time.time())
