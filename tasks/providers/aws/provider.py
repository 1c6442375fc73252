"""The `aws` provider: each attempt runs on a fresh EC2 spot instance in one pinned region, or for a
multi-node job (`distributed.nnodes` = K) on K instances launched and released together.

provision ranks the (subnet, instance type) pools with the re-provision policy (policy.py), which
reads the job's placement history and EC2's spot placement scores (asked once per provisioning at
most, cached for `placement_scores_ttl_s`; a refusal is one warning and the configured order), and
launches into the best one that has capacity, by RunInstances pool after pool or by one instant EC2
Fleet over all of them; the instance boots a user-data script that writes the job file and execs the
trainer. watch polls EC2 and the trainer's heartbeat object (watch.py). release terminates the
instance. Every EC2 error is mapped in errors.py. Instances carry `spotrun:*` tags, so that the
sweeper (sweeper.py) can terminate those of this installation whose flow run has died, and IAM can
scope permissions (iam.py).

Several nodes: node 0 is launched as above; once it runs, its private IP (where torchrun meets) goes
into the other nodes' user data and they are launched into node 0's pool, its subnet (one zone: no
cross-zone traffic, and a placement group's zone) and its instance type (the same GPUs per node).
Launching node 0 first costs one launch-to-running wait before the others start; their rendezvous
waits for the slowest boot anyway. If the others find no capacity there, every node of the try is
terminated and the whole gang tries the next pool. One Worker holds every instance: the end of any one
ends the attempt (watch.py), and release terminates them all. With `placement_group: true` each
try gets a cluster placement group of its own, deleted once its instances are terminated.

Several regions (`regions`, an opt-in): the pools of every region are ranked together (policy.py: the
job's history marks regions as it marks zones), one placement-score call names them all, and each
launch, watch, release and sweep goes through its region's client. Checkpoints stay in the one bucket,
which a worker in another region reads across regions (docs/aws.md: the cost, and data residency).

Warm standby (`warm: 1`, tasks/control/warm.py): the controller provisions the next attempt's worker
when this one starts training. Any instance provisioned while another of this provider runs goes to
another zone first (`apart_from`): one zone's reclaim would otherwise take both. With one zone
configured (or every other zone out of capacity) it lands beside the running worker, with one warning
per provider, and still serves a reclaim of that instance alone. The standby is not watched until it
takes over, so the running worker's watch renews its `spotrun:lease-until` tag too: the sweeper leaves
it alone while the flow lives. Multi-node jobs are refused: a standby gang is not built.

The EC2 clients are given (`make_ec2_client` and `make_ec2_clients` build them, one per region); the
provider never builds one itself.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
from botocore import exceptions as bce
from botocore.config import Config

from tasks.market.prices import Prices
from tasks.providers.aws import launch
from tasks.providers.aws.config import AwsProviderConfig
from tasks.providers.aws.cost import Cost, attempt_cost, spot_price
from tasks.providers.aws.errors import (
    SCORES_ERRORS,
    ErrorKind,
    LaunchContext,
    classify_code,
    classify_error,
    error_code,
    scores_refusal,
)
from tasks.providers.aws.launch import TAG_LEASE, lease_value
from tasks.providers.aws.policy import (
    Market,
    Placement,
    PlacementEvent,
    PlacementOutcome,
    apart_from,
    choose_market,
    rank_placements,
    zone_scores,
)
from tasks.providers.aws.prices import quote
from tasks.providers.aws.sweeper import sweep_flow_run
from tasks.providers.aws.watch import SPOT_INTERRUPTION, AwsWorkerState, ExitStatus, WorkerWatch
from tasks.providers.base import (
    LogCallback,
    ProvisionError,
    StatusCallback,
    StopCause,
    WarmSettings,
    WatchResult,
    Worker,
)
from trainer.storage import Storage
from trainer.storage.registry import is_local
from trainer.telemetry.heartbeat import HEARTBEAT_EVERY_S
from trainer.telemetry.records import Notice, Record

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

    from trainer.spec.job import JobSpec

log = logging.getLogger(__name__)

Launcher = Callable[[str, str], None]  # (instance id, user-data script): a test plays the instance
BOTO_ERRORS = (bce.ClientError, bce.BotoCoreError)
# How long release() waits for an attempt's instances to be terminated so that their placement group
# can be deleted (EC2 refuses while any is shutting down). A group still in use then is deleted at the
# next provision; an empty group costs nothing but counts toward the region's quota of groups.
GROUP_WAIT_S = 180.0


class _Unasked:
    """`AwsProvider.prices` before EC2 was asked."""


_UNASKED = _Unasked()


@dataclass(frozen=True)
class _Plan:
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
class _Gang:
    """The instances of one launch try, node 0 first, all running."""

    ids: list[str]
    scripts: list[str]
    landed: Placement  # node 0's pool, as EC2 reports it: the others go there too
    master_addr: str | None  # node 0's private IP
    fleet: str | None = None
    group: str | None = None  # the try's placement group


def ec2_client(
    region: str, endpoint_url: str | None = None, session: boto3.session.Session | None = None
) -> EC2Client:
    """The one place an EC2 client is built: standard retries, bounded timeouts, and boto3's credential
    chain (or `session`'s)."""
    config = Config(
        retries={"mode": "standard", "total_max_attempts": 5}, connect_timeout=10, read_timeout=60
    )
    client: EC2Client = (session or boto3.session.Session()).client(
        "ec2", region_name=region, endpoint_url=endpoint_url, config=config
    )
    return client


def make_ec2_client(cfg: AwsProviderConfig, session: boto3.session.Session | None = None) -> EC2Client:
    """The provider's client: the config's region and endpoint."""
    return ec2_client(cfg.region, cfg.endpoint_url, session)


def make_ec2_clients(
    cfg: AwsProviderConfig, session: boto3.session.Session | None = None
) -> dict[str, EC2Client]:
    """One client for each of the config's further `regions` (the same endpoint)."""
    return {r.region: ec2_client(r.region, cfg.endpoint_url, session) for r in cfg.regions}


def default_store(job: JobSpec) -> Storage:
    return job.open_storage()


# A noticed instance trains on for up to this long while its replacement boots; the trainer keeps what
# the emergency checkpoint needs before the notice's deadline (save_margin_s included) on top of it.
HANDOVER_S = 100.0


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
        self._clients: dict[str, EC2Client] = {cfg.region: ec2, **(regions_ec2 or {})}  # one per region
        if missing := [r for r in cfg.region_names() if r not in self._clients]:
            raise ValueError(f"no EC2 client for region(s) {', '.join(missing)}: pass regions_ec2")
        self.installation = installation  # None: untagged, so no sweeper or adopting controller ends them
        self.launcher, self.exit_status, self.open_store = launcher, exit_status, open_store
        self.history: list[PlacementEvent] = list(history or [])  # this provider's launches and ends
        self._azs: dict[str, str] | None = None
        self._zone_names: dict[str, str] = {}  # the subnets' zone ids (use1-az4) -> names (us-east-1a)
        self._scores: dict[int, tuple[float, dict[str, int]]] = {}  # nodes -> (asked at, zone -> score)
        self._scores_warned = False
        self._roots: dict[str | None, str | None] = {}  # region (None: `region`) -> the AMI's root device
        self._groups: dict[str, list[str]] = {}  # placement group -> instances launched in it, to delete
        self._released_peers: list[str] = []  # the other nodes of the worker released last
        # provisioned and not yet released, by worker id: a standby's zone avoids theirs, and their
        # watches renew its lease (a prewarm thread adds while the main thread releases)
        self._live: dict[str, AwsWorkerState] = {}
        self._shared_zone_warned = False

    @property
    def prices(self) -> Prices | None:
        """An hour on each market for the budget check at submission: the cheapest spot price of the
        configured types in the subnets' zones, and the on-demand price (prices.py); asked of EC2 once,
        at the first read. None when EC2 or the config will not say (the check then waits)."""
        if isinstance(self._prices, _Unasked):
            try:
                azs, _ = self._lookups()
                zones: set[str] | None = set(azs.values()) or None
            except ProvisionError:  # a setup error: the first provision stops with its line
                zones = None
            self._prices = quote(self.cfg, self._clients, zones)
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
        # The controller names the worker it released (node 0) for the storage lease; torchrun may have
        # put global rank 0, the lease holder, on another node (watch.py), released as surely.
        extra_args = [*extra_args, *(a for p in self._released_peers for a in ("--lease-takeover", p))]
        if self.prewarm and nnodes == 1:  # train through the 2-minute notice while the replacement boots
            # the controller sees the notice at its next look at the heartbeat (written at once)
            announce = self.cfg.poll_s + HEARTBEAT_EVERY_S
            extra_args += ["--handover-s", f"{HANDOVER_S:g}", "--announce-s", f"{announce:g}"]

        def script(node: launch.NodeRole | None) -> str:
            s = launch.build_user_data(
                text,
                extra_args,
                python=self.cfg.python,
                workdir=self.cfg.workdir,
                job=job.name,
                attempt=attempt,
                node=node,
                env=job.env.set_,
                manifest_key_file=self.cfg.manifest_key_file,
            )
            if problem := launch.check_user_data(s):
                raise ProvisionError(problem, retryable=False)
            return s

        script(launch.NodeRole(0, nnodes, None) if nnodes > 1 else None)  # refused before anything launches
        azs, roots = self._lookups()
        self._reap_groups(0.0)  # those earlier attempts left in use
        if market == "spot":  # the controller's policy left it to the fallback rules
            market = choose_market(self.cfg, self.history, time.time())
        ranked = rank_placements(
            self.cfg, self.history, azs, market, scores=self._placement_scores(nnodes, market)
        )
        busy = {z for st in list(self._live.values()) if (z := st.placement.az) is not None}
        pools = apart_from(ranked, busy)
        launch_id = f"{job.name[:40]}-a{attempt}-{uuid.uuid4().hex[:8]}"
        tags = launch.launch_tags(
            self.cfg,
            job.name,
            attempt,
            launch_id=launch_id,
            flow_run_id=self.flow_run_id,
            installation=self.installation,
        )
        plan = _Plan(
            script,
            nnodes,
            tags,
            launch_id=launch_id,
            roots=roots,
            placement_groups=self.cfg.placement_group and nnodes > 1,
        )
        store = self.open_store(job)
        if self.cfg.allocation == "fleet":  # a fleet picks among the pools it is given: only those apart
            gang = self._launch_fleet([p for p in pools if p.az not in busy] or pools, plan, market)
        else:
            gang = self._launch_first(pools, plan)
        where = gang.landed
        ec2 = self._client(where.region)
        with _terminate_on_error(ec2, gang.ids):  # until the caller holds the worker, it is ours to end
            od = self.cfg.on_demand_price_per_h.get(where.instance_type)
            price = spot_price(ec2, where.instance_type, where.az) if where.market == "spot" else od
            state = AwsWorkerState(
                instance_id=gang.ids[0],
                placement=where,
                launch_id=launch_id,
                launched_at=time.time(),
                price_per_h=_times(price, nnodes),
                on_demand_price_per_h=_times(od, nnodes),
                storage=store,
                fleet_id=gang.fleet,
                peers=gang.ids[1:],
                master_addr=gang.master_addr,
                placement_group=gang.group,
            )
            nodes = (
                f"{nnodes} nodes {', '.join(gang.ids)} at {gang.master_addr}" if nnodes > 1 else gang.ids[0]
            )
            log.info("attempt %d: %s running (%s, launch %s)", attempt, nodes, where.describe(), launch_id)
            if self.warm.size and where.az in busy and not self._shared_zone_warned:
                self._shared_zone_warned = True
                log.warning(
                    "%s shares %s with a running worker (no other zone configured or with capacity): "
                    "a reclaim of that zone takes both; add subnets in other zones",
                    gang.ids[0],
                    where.az,
                )
            if self.launcher is not None:
                for iid, s in zip(gang.ids, gang.scripts, strict=True):
                    self.launcher(iid, s)
        self._live[gang.ids[0]] = state
        return Worker(gang.ids[0], self.name, attempt, started_at=state.launched_at, handle=state)

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

        ec2 = self._client(state.placement.region)
        result = WorkerWatch(
            ec2,
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
        self._live.pop(worker.id, None)
        self._terminate(state.instance_ids, state.placement.region)
        self._released_peers = list(state.peers)
        if state.placement_group is not None and state.placement_group in self._groups:
            self._reap_groups(GROUP_WAIT_S)

    def _renew_standbys(self, watched: str) -> None:
        """Push the lease of every live instance but the watched worker's forward: a standby is not
        watched until it takes over, and the sweeper would end it once its launch lease ran out."""
        for wid, st in list(self._live.items()):
            if wid == watched:
                continue
            try:
                self._client(st.placement.region).create_tags(
                    Resources=st.instance_ids,
                    Tags=[{"Key": TAG_LEASE, "Value": lease_value(self.cfg.lease_s)}],
                )
            except BOTO_ERRORS as e:  # retried at the next renewal; the lease still has time
                log.warning("could not renew the lease of standby %s: %s", wid, e)

    def _terminate(self, ids: list[str], region: str | None = None) -> None:
        """TerminateInstances in `region` (None: `region` of the config); an unknown id fails the whole
        call, so then each is ended alone."""
        try:
            self._client(region).terminate_instances(InstanceIds=ids)
        except BOTO_ERRORS as e:
            if error_code(e) == "InvalidInstanceID.NotFound":
                if len(ids) > 1:
                    for iid in ids:
                        self._terminate([iid], region)
                return
            raise RuntimeError(f"could not terminate {', '.join(ids)}: {e}; terminate it by hand") from e

    def stop_leftovers(self, flow_run_id: str) -> list[str]:
        """Terminate the instances a dead controller's flow run left (found by its tags, from any host);
        their trainers get the OS's SIGTERM at shutdown. Returns their ids (the newest last)."""
        if self.installation is None:
            return []  # launched untagged: nothing to find them by
        found: list[str] = []
        for region, ec2 in self._clients.items():
            try:
                found += sweep_flow_run(ec2, flow_run_id, self.installation)
            except BOTO_ERRORS as e:  # the sweeper deployment is the backstop; the new trainer's lease waits
                log.warning("could not look for instances of flow run %s in %s: %s", flow_run_id, region, e)
        return found

    def cost(self, worker: Worker, ended_at: float | None = None) -> Cost:
        """The attempt's cost so far (or up to `ended_at`)."""
        return attempt_cost(worker.handle, ended_at if ended_at is not None else time.time())

    # -- launching ---------------------------------------------------------------------------------

    def _lookups(self) -> tuple[dict[str, str], dict[str | None, str | None]]:
        """The subnets' zones and each region's AMI root device name (None: `region`'s), looked up once
        (and checked on the way)."""
        regions: list[str | None] = [None, *(r.region for r in self.cfg.regions)]
        if self._azs is None:
            subnets = [s for region in regions for s in self._subnets(region)]
            self._azs = {s["SubnetId"]: s["AvailabilityZone"] for s in subnets}
            self._zone_names = {
                s["AvailabilityZoneId"]: s["AvailabilityZone"] for s in subnets if s.get("AvailabilityZoneId")
            }
        for region in regions:
            if region not in self._roots:
                self._roots[region] = self._root_device(region)
        return self._azs, self._roots

    def _subnets(self, region: str | None) -> list[Any]:
        """The region's configured subnets as EC2 lists them ([] for none: the default VPC)."""
        site = self.cfg.site(region)
        if not site.subnets:
            return []
        try:
            return list(self._client(region).describe_subnets(SubnetIds=site.subnets)["Subnets"])
        except BOTO_ERRORS as e:
            raise classify_error(e, self._ctx(None, region)).error() from e

    def _root_device(self, region: str | None) -> str | None:
        """The root device name of the region's AMI (None: a launch template names its own)."""
        site = self.cfg.site(region)
        if site.image_id is None:
            return None
        ctx = self._ctx(None, region)
        try:
            images = self._client(region).describe_images(ImageIds=[site.image_id]).get("Images", [])
        except BOTO_ERRORS as e:
            raise classify_error(e, ctx).error() from e
        if not images:
            raise classify_code("InvalidAMIID.NotFound", "", ctx).error()
        return images[0].get("RootDeviceName") or "/dev/xvda"

    def _client(self, region: str | None) -> EC2Client:
        """The EC2 client of `region` (None: the config's `region`)."""
        return self._clients[region or self.cfg.region]

    def _placement_scores(self, nnodes: int, market: Market) -> dict[str, int]:
        """Zone name -> EC2's spot placement score for `nnodes` instances of the configured types, asked
        at most once per `placement_scores_ttl_s`; {} when turned off, on-demand, one zone, or refused."""
        if not self.cfg.placement_scores or market != "spot" or len(set(self._zone_names.values())) < 2:
            return {}
        now = time.monotonic()
        cached = self._scores.get(nnodes)
        if cached is not None and now - cached[0] < self.cfg.placement_scores_ttl_s:
            return cached[1]
        try:
            out = self.ec2.get_spot_placement_scores(
                InstanceTypes=list(self.cfg.instance_types),
                TargetCapacity=nnodes,
                TargetCapacityUnitType="units",
                SingleAvailabilityZone=True,
                RegionNames=self.cfg.region_names(),  # one call scores the zones of every region
            )
            scores = zone_scores(out, self._zone_names)  # type: ignore[arg-type]
            log.info(
                "spot placement scores for %d x %s: %s", nnodes, ",".join(self.cfg.instance_types), scores
            )
        except SCORES_ERRORS as e:  # advice only: the configured order serves
            scores = {}
            (log.debug if self._scores_warned else log.warning)("%s", scores_refusal(e, self.cfg.region))
            self._scores_warned = True
        self._scores[nnodes] = (now, scores)
        return scores

    def _ctx(self, pool: Placement | None, region: str | None = None) -> LaunchContext:
        cfg = self.cfg.site(pool.region if pool else region)
        lt = cfg.launch_template
        image = cfg.image_id or (lt.name or lt.id or "" if lt else "")
        itype = pool.instance_type if pool else ",".join(cfg.instance_types)
        subnet = pool.subnet if pool else None
        return LaunchContext(cfg.region, itype, image, subnet=subnet, instance_profile=cfg.instance_profile)

    def _launch_first(self, pools: list[Placement], plan: _Plan) -> _Gang:
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
            landed, inst = ran
            first = _Gang([iid], [script], landed, inst.get("PrivateIpAddress"), group=group)
            gang = self._with_peers(first, plan, token)
            if gang is not None:
                return gang
        raise self._no_capacity(pools)

    def _run_one(
        self,
        pool: Placement,
        plan: _Plan,
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
        tags = launch.node_tags(plan.tags, node)
        params = launch.run_instances_params(
            self.cfg.site(pool.region),
            pool,
            script,
            tags=tags,
            launch_id=token,
            root_device=plan.roots[pool.region],
            placement_group=group,
        )
        try:
            iid = self._client(pool.region).run_instances(**params)["Instances"][0]["InstanceId"]
        except BOTO_ERRORS as e:
            found = classify_error(e, self._ctx(pool))
            self._note(pool, found.kind, found.code)
            if found.kind is ErrorKind.CAPACITY:
                log.info("%s", found.message)
                return None
            raise found.error() from e
        if group is not None:
            self._groups[group].append(iid)
        return iid, script

    def _with_peers(self, gang: _Gang, plan: _Plan, token: str) -> _Gang | None:
        """Nodes 1.. in node 0's pool, told node 0's private IP; None (every node of the try terminated)
        when they find no capacity there."""
        if plan.nnodes == 1:
            return gang
        pool = gang.landed
        with _terminate_on_error(self._client(pool.region), gang.ids):
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
            self._terminate(gang.ids, pool.region)
        except RuntimeError as e:  # the sweeper catches the leftover; the next pool is tried
            log.warning("%s", e)
        return None

    def _launch_fleet(self, pools: list[Placement], plan: _Plan, market: Market) -> _Gang:
        """Node 0 by one instant fleet over every pool, from a per-attempt launch template deleted
        afterwards; the other nodes by RunInstances into the pool the fleet chose."""
        ctx = self._ctx(None)
        group = self._new_group(plan, 0)
        script = plan.script(plan.role(0, None))
        try:
            base = self._template_base()
            tags0 = launch.node_tags(plan.tags, plan.role(0, None))
            data = launch.template_data(
                self.cfg, script, tags0, root_device=plan.roots[None], base=base, placement_group=group
            )
            created = self.ec2.create_launch_template(
                LaunchTemplateName=f"spotrun-{plan.launch_id}",
                LaunchTemplateData=data,  # type: ignore[arg-type]
                TagSpecifications=launch.tag_specs(plan.tags, "launch-template"),  # type: ignore[arg-type]
                ClientToken=plan.launch_id,
            )
            template = created["LaunchTemplate"]["LaunchTemplateId"]
        except BOTO_ERRORS as e:
            raise classify_error(e, ctx).error() from e
        try:
            try:
                out = self.ec2.create_fleet(
                    **launch.fleet_params(self.cfg, template, pools, tags=plan.tags, market=market)
                )
            except BOTO_ERRORS as e:
                found = classify_error(e, ctx)
                raise (self._no_capacity(pools) if found.kind is ErrorKind.CAPACITY else found.error()) from e
            ids = [iid for made in out.get("Instances") or [] for iid in made.get("InstanceIds") or []]
            if not ids:
                raise self._fleet_refused(out.get("Errors") or [], pools)
            if group is not None:
                self._groups[group].append(ids[0])
            pool = pools[0] if len(pools) == 1 else Placement(None, None, "", market)
            ran = self._wait_running(ids[0], pool)
            if ran is None:
                raise self._no_capacity(pools)
        finally:
            try:
                self.ec2.delete_launch_template(LaunchTemplateId=template)
            except BOTO_ERRORS as e:  # a leftover template costs nothing; say so and go on
                log.warning("could not delete launch template %s: %s", template, e)
        landed, inst = ran
        fleet = str(out.get("FleetId") or "")
        first = _Gang(
            [ids[0]], [script], landed, master_addr=inst.get("PrivateIpAddress"), fleet=fleet, group=group
        )
        gang = self._with_peers(first, plan, f"{plan.launch_id}-0")
        if gang is None:
            raise self._no_capacity([landed])
        return gang

    def _new_group(self, plan: _Plan, try_index: int) -> str | None:
        """A cluster placement group for one launch try, when the plan asks for one."""
        if not plan.placement_groups:
            return None
        name = launch.placement_group_name(plan.launch_id, try_index)
        try:
            self.ec2.create_placement_group(
                GroupName=name,
                Strategy="cluster",
                TagSpecifications=launch.tag_specs(plan.tags, "placement-group"),  # type: ignore[arg-type]
            )
        except BOTO_ERRORS as e:
            raise classify_error(e, self._ctx(None)).error() from e
        self._groups[name] = []
        return name

    def _reap_groups(self, wait_s: float) -> None:
        """Delete the placement groups whose instances are all terminated, waiting up to `wait_s` for
        them; one still in use stays for the next call."""
        deadline = time.monotonic() + wait_s
        while self._groups:
            for name, ids in list(self._groups.items()):
                if self._all_terminated(ids):
                    self._delete_group(name)
            if not self._groups or time.monotonic() >= deadline:
                break
            time.sleep(min(self.cfg.poll_s, 5.0))
        if self._groups and wait_s > 0:
            log.warning(
                "placement group(s) %s still in use; deleted at the next provision", ", ".join(self._groups)
            )

    def _all_terminated(self, ids: list[str]) -> bool:
        if not ids:
            return True
        try:
            out = self.ec2.describe_instances(InstanceIds=ids)
        except BOTO_ERRORS as e:
            if error_code(e) == "InvalidInstanceID.NotFound" and len(ids) == 1:
                return True
            return len(ids) > 1 and all(self._all_terminated([i]) for i in ids)
        found = [i for r in out.get("Reservations", []) for i in r.get("Instances", [])]
        return all(str(i.get("State", {}).get("Name")) == "terminated" for i in found)

    def _delete_group(self, name: str) -> None:
        try:
            self.ec2.delete_placement_group(GroupName=name)
        except BOTO_ERRORS as e:
            if error_code(e) == "InvalidPlacementGroup.InUse":
                return  # an instance is still shutting down: the next call tries again
            if error_code(e) != "InvalidPlacementGroup.Unknown":
                log.warning("could not delete placement group %s: %s; delete it by hand", name, e)
        self._groups.pop(name, None)

    def _template_base(self) -> dict[str, Any] | None:
        """The configured launch template's data, which a fleet's per-attempt template starts from."""
        lt = self.cfg.launch_template
        if lt is None:
            return None
        key = {"LaunchTemplateName": lt.name} if lt.name else {"LaunchTemplateId": lt.id or ""}
        versions = self.ec2.describe_launch_template_versions(**key, Versions=[lt.version])  # type: ignore[arg-type]
        found = versions.get("LaunchTemplateVersions") or [{}]
        return dict(found[0].get("LaunchTemplateData") or {})

    def _fleet_refused(self, errors: list[Any], pools: list[Placement]) -> ProvisionError:
        """The error for a fleet that launched nothing: the first non-capacity error, else no capacity."""
        for err in errors:
            o = (err.get("LaunchTemplateAndOverrides") or {}).get("Overrides") or {}
            pool = Placement(
                o.get("SubnetId"), o.get("AvailabilityZone"), o.get("InstanceType", ""), pools[0].market
            )
            found = classify_code(
                str(err.get("ErrorCode") or ""), str(err.get("ErrorMessage") or ""), self._ctx(pool)
            )
            self._note(pool, found.kind, found.code)
            if found.kind is not ErrorKind.CAPACITY:
                return found.error()
        return self._no_capacity(pools)

    def _wait_running(self, iid: str, pool: Placement) -> tuple[Placement, dict[str, Any]] | None:
        """Wait until the instance runs and return where it landed and the instance as EC2 lists it; None
        if EC2 ended it for lack of capacity while pending (the next pool is tried). Terminates it on a
        timeout or an interruption."""
        deadline = time.monotonic() + self.cfg.provision_timeout_s
        with _terminate_on_error(self._client(pool.region), [iid]):
            while True:
                inst = self._look(iid, pool)
                state = str(inst.get("State", {}).get("Name") or "pending")
                if state == "running":
                    landed = _landed(inst, pool)
                    self.history.append(PlacementEvent(landed, PlacementOutcome.LAUNCHED, time.time()))
                    return landed, inst
                if state in ("shutting-down", "terminated", "stopping", "stopped"):
                    reason = str(inst.get("StateReason", {}).get("Code") or state)
                    found = classify_code(reason, "", self._ctx(pool))
                    self._note(_landed(inst, pool), found.kind, reason)
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
            out = self._client(pool.region).describe_instances(InstanceIds=[iid])
        except BOTO_ERRORS as e:
            if error_code(e) == "InvalidInstanceID.NotFound":
                return {}
            found = classify_error(e, self._ctx(pool))
            if not found.retryable:
                raise found.error() from e
            log.warning("%s: %s", iid, found.message)
            return {}
        listed = [i for r in out.get("Reservations", []) for i in r.get("Instances", [])]
        return dict(listed[0]) if listed else {}

    def _note(self, pool: Placement, kind: ErrorKind, code: str) -> None:
        outcome = PlacementOutcome.CAPACITY if kind is ErrorKind.CAPACITY else PlacementOutcome.FAILED
        self.history.append(PlacementEvent(pool, outcome, time.time(), code))

    def _no_capacity(self, pools: list[Placement]) -> ProvisionError:
        types = sorted({p.instance_type for p in pools})
        zones = sorted({p.az or p.subnet or "any zone" for p in pools})
        market = pools[0].market if pools else "spot"
        regions = sorted({p.region or self.cfg.region for p in pools} or {self.cfg.region})
        where = f"{', '.join(types)} in {', '.join(zones)} ({', '.join(regions)})"
        return ProvisionError(f"no {market} capacity for {where}; will try again", retryable=True)


@contextmanager
def _terminate_on_error(ec2: EC2Client, ids: list[str]) -> Iterator[None]:
    """Terminate just-launched instances (those in `ids` when it happens: the list may grow in the
    block) if anything (a timeout, a cancellation) escapes the block."""
    try:
        yield
    except BaseException as e:
        try:
            if ids:
                ec2.terminate_instances(InstanceIds=list(ids))
        except BOTO_ERRORS as te:  # the original error propagates; the sweeper catches the leftover
            log.warning("could not terminate %s after %s: %s", ", ".join(ids), type(e).__name__, te)
        raise


def _times(price: float | None, nodes: int) -> float | None:
    """An instance's price per hour for the whole attempt."""
    return None if price is None else price * nodes


def _landed(inst: dict[str, Any], pool: Placement) -> Placement:
    """The pool an instance is in, as EC2 reports it (a fleet chooses among pools)."""
    return replace(
        pool,
        subnet=inst.get("SubnetId") or pool.subnet,
        az=(inst.get("Placement") or {}).get("AvailabilityZone") or pool.az,
        instance_type=inst.get("InstanceType") or pool.instance_type,
        market="spot" if inst.get("InstanceLifecycle") == "spot" else pool.market,
    )
