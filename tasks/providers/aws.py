"""The `aws` provider: each attempt runs on a fresh EC2 spot instance in one pinned region.

provision ranks the (subnet, instance type) pools with the re-provision policy (aws_policy.py) and
launches into the best one that has capacity, by RunInstances pool after pool or by one instant EC2
Fleet over all of them; the instance boots a user-data script that writes the job file and execs the
trainer. watch polls EC2 and the trainer's heartbeat object (aws_watch.py). release terminates the
instance. Every EC2 error is mapped in aws_errors.py. Instances carry `spotrun:*` tags, so that the
sweeper (aws_sweeper.py) can terminate those whose flow run has died, and IAM can scope permissions.

The EC2 client is given (`make_ec2_client` builds one); the provider never builds one itself.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
from botocore import exceptions as bce
from botocore.config import Config

from tasks.providers import aws_launch as launch
from tasks.providers.aws_config import AwsProviderConfig
from tasks.providers.aws_cost import Cost, attempt_cost, spot_price
from tasks.providers.aws_errors import ErrorKind, LaunchContext, classify_code, classify_error, error_code
from tasks.providers.aws_policy import (
    Market,
    Placement,
    PlacementEvent,
    PlacementOutcome,
    choose_market,
    rank_placements,
)
from tasks.providers.aws_sweeper import sweep_flow_run
from tasks.providers.aws_watch import SPOT_INTERRUPTION, AwsWorkerState, ExitStatus, WorkerWatch
from tasks.providers.base import LogCallback, ProvisionError, StatusCallback, WatchResult, Worker
from trainer.storage import Storage, open_storage

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

    from trainer.spec import JobSpec

log = logging.getLogger(__name__)

Launcher = Callable[[str, str], None]  # (instance id, user-data script): a test plays the instance
BOTO_ERRORS = (bce.ClientError, bce.BotoCoreError)


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


def default_store(job: JobSpec) -> Storage:
    return open_storage(job.storage, job.s3)


class AwsProvider:
    """EC2 spot workers; see the module docstring."""

    name = "aws"

    def __init__(
        self,
        cfg: AwsProviderConfig,
        ec2: EC2Client,
        *,
        flow_run_id: str | None = None,
        launcher: Launcher | None = None,
        exit_status: ExitStatus | None = None,
        history: list[PlacementEvent] | None = None,
        open_store: Callable[[JobSpec], Storage] = default_store,
    ) -> None:
        self.cfg, self.ec2, self.flow_run_id = cfg, ec2, flow_run_id
        self.launcher, self.exit_status, self.open_store = launcher, exit_status, open_store
        self.history: list[PlacementEvent] = list(history or [])  # this provider's launches and ends
        self._azs: dict[str, str] | None = None
        self._root_device: str | None = None

    @classmethod
    def from_config(
        cls, cfg: AwsProviderConfig, session: boto3.session.Session | None = None, **kwargs: Any
    ) -> AwsProvider:
        return cls(cfg, make_ec2_client(cfg, session), **kwargs)

    def provision(self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str]) -> Worker:
        """Launch an instance in the best pool with capacity and wait until it runs."""
        script = self._user_data(job, attempt, spec_path, extra_args)
        azs, root = self._lookups()
        market = choose_market(self.cfg, self.history, time.time())
        pools = rank_placements(self.cfg, self.history, azs, market)
        launch_id = f"{job.name[:40]}-a{attempt}-{uuid.uuid4().hex[:8]}"
        tags = launch.launch_tags(self.cfg, job.name, attempt, launch_id, self.flow_run_id)
        store = self.open_store(job)
        if self.cfg.allocation == "fleet":
            iid, where, fleet = self._launch_fleet(pools, script, tags, launch_id, root, market)
        else:
            (iid, where), fleet = self._launch_first(pools, script, tags, launch_id, root), None
        with _terminate_on_error(self.ec2, iid):  # until the caller holds the worker, it is ours to end
            od = self.cfg.on_demand_price_per_h.get(where.instance_type)
            price = spot_price(self.ec2, where.instance_type, where.az) if where.market == "spot" else od
            state = AwsWorkerState(iid, where, launch_id, time.time(), price, od, store, fleet)
            log.info("attempt %d: %s running (%s, launch %s)", attempt, iid, where.describe(), launch_id)
            if self.launcher is not None:
                self.launcher(iid, script)
        return Worker(iid, self.name, attempt, state.launched_at, state)

    def _user_data(self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str]) -> str:
        """The worker's boot script, checked; warnings for a job that would run poorly on EC2."""
        if not spec_path.is_file():
            raise ProvisionError(f"job file {spec_path} does not exist", retryable=False)
        cfg = self.cfg
        text = spec_path.read_text()
        script = launch.build_user_data(
            text, extra_args, python=cfg.python, workdir=cfg.workdir, job=job.name, attempt=attempt
        )
        if problem := launch.check_user_data(script):
            raise ProvisionError(problem, retryable=False)
        if job.preemption.notice != "aws":
            log.warning("job %s: set preemption.notice: aws to checkpoint on EC2's 2-minute notice", job.name)
        if not job.storage.startswith("s3://") and cfg.endpoint_url is None:
            log.warning("job storage %s is not s3://: an EC2 worker cannot reach it", job.storage)
        return script

    def watch(
        self, worker: Worker, on_status: StatusCallback | None = None, on_log: LogCallback | None = None
    ) -> WatchResult:
        """Poll the instance and the heartbeat until the worker is gone. There is no log stream from an
        instance: `on_log` is not called, and `log_tail` is the console output when no exit record came.
        The attempt's cost lands in `result.facts["cost"]` (a `Cost` as a dict)."""
        state: AwsWorkerState = worker.handle
        result = WorkerWatch(self.ec2, self.cfg, worker, on_status, self.exit_status).run()
        result.facts["cost"] = asdict(attempt_cost(state, result.ended_at))
        reclaimed = result.notice_kind == SPOT_INTERRUPTION or (
            result.trainer_code == "PREEMPTED" and state.released_at is None
        )
        outcome = PlacementOutcome.PREEMPTED if reclaimed else PlacementOutcome.ENDED
        self.history.append(PlacementEvent(state.placement, outcome, result.ended_at))
        return result

    def release(self, worker: Worker) -> None:
        """Terminate the instance. Idempotent: an instance already gone is fine. A failure to terminate
        raises (an instance left running costs money; the sweeper is the backstop)."""
        state: AwsWorkerState = worker.handle
        if state.released_at is None:
            state.released_at = time.time()
        try:
            self.ec2.terminate_instances(InstanceIds=[state.instance_id])
        except BOTO_ERRORS as e:
            if error_code(e) == "InvalidInstanceID.NotFound":
                return
            raise RuntimeError(f"could not terminate {state.instance_id}: {e}; terminate it by hand") from e

    def stop_leftovers(self, flow_run_id: str) -> list[str]:
        """Terminate the instances a dead controller's flow run left (found by its tag, from any host);
        their trainers get the OS's SIGTERM at shutdown. Returns their ids (the newest last)."""
        try:
            return sweep_flow_run(self.ec2, flow_run_id)
        except BOTO_ERRORS as e:  # the sweeper deployment is the backstop; the new trainer's lease waits
            log.warning("could not look for instances of flow run %s: %s", flow_run_id, e)
            return []

    def cost(self, worker: Worker, ended_at: float | None = None) -> Cost:
        """The attempt's cost so far (or up to `ended_at`)."""
        return attempt_cost(worker.handle, ended_at if ended_at is not None else time.time())

    # -- launching ---------------------------------------------------------------------------------

    def _lookups(self) -> tuple[dict[str, str], str | None]:
        """The subnets' zones and the AMI's root device name, looked up once (and checked on the way)."""
        ctx = self._ctx(None)
        try:
            if self._azs is None:
                subnets = (
                    self.ec2.describe_subnets(SubnetIds=self.cfg.subnets)["Subnets"]
                    if self.cfg.subnets
                    else []
                )
                self._azs = {s["SubnetId"]: s["AvailabilityZone"] for s in subnets}
            if self._root_device is None and self.cfg.image_id is not None:
                images = self.ec2.describe_images(ImageIds=[self.cfg.image_id]).get("Images", [])
                if not images:
                    raise classify_code("InvalidAMIID.NotFound", "", ctx).error()
                self._root_device = images[0].get("RootDeviceName") or "/dev/xvda"
        except BOTO_ERRORS as e:
            raise classify_error(e, ctx).error() from e
        return self._azs, self._root_device

    def _ctx(self, pool: Placement | None) -> LaunchContext:
        cfg, lt = self.cfg, self.cfg.launch_template
        image = cfg.image_id or (lt.name or lt.id or "" if lt else "")
        itype = pool.instance_type if pool else ",".join(cfg.instance_types)
        subnet = pool.subnet if pool else None
        return LaunchContext(cfg.region, itype, image, subnet, cfg.instance_profile)

    def _launch_first(
        self,
        pools: list[Placement],
        script: str,
        tags: dict[str, str],
        launch_id: str,
        root: str | None,
    ) -> tuple[str, Placement]:
        """RunInstances into each pool in rank order until one runs; capacity errors move on."""
        for i, pool in enumerate(pools):
            params = launch.run_instances_params(self.cfg, pool, script, tags, f"{launch_id}-{i}", root)
            try:
                iid = self.ec2.run_instances(**params)["Instances"][0]["InstanceId"]
            except BOTO_ERRORS as e:
                found = classify_error(e, self._ctx(pool))
                self._note(pool, found.kind, found.code)
                if found.kind is ErrorKind.CAPACITY:
                    log.info("%s", found.message)
                    continue
                raise found.error() from e
            landed = self._wait_running(iid, pool)
            if landed is not None:
                return iid, landed
        raise self._no_capacity(pools)

    def _launch_fleet(
        self,
        pools: list[Placement],
        script: str,
        tags: dict[str, str],
        launch_id: str,
        root: str | None,
        market: Market,
    ) -> tuple[str, Placement, str]:
        """One instant fleet over every pool, from a per-attempt launch template deleted afterwards."""
        ctx = self._ctx(None)
        try:
            base = self._template_base()
            data = launch.template_data(self.cfg, script, tags, root, base)
            created = self.ec2.create_launch_template(
                LaunchTemplateName=f"spotrun-{launch_id}",
                LaunchTemplateData=data,  # type: ignore[arg-type]
                TagSpecifications=launch.tag_specs(tags, "launch-template"),  # type: ignore[arg-type]
                ClientToken=launch_id,
            )
            template = created["LaunchTemplate"]["LaunchTemplateId"]
        except BOTO_ERRORS as e:
            raise classify_error(e, ctx).error() from e
        try:
            try:
                out = self.ec2.create_fleet(**launch.fleet_params(self.cfg, template, pools, tags, market))
            except BOTO_ERRORS as e:
                found = classify_error(e, ctx)
                raise (self._no_capacity(pools) if found.kind is ErrorKind.CAPACITY else found.error()) from e
            ids = [iid for group in out.get("Instances") or [] for iid in group.get("InstanceIds") or []]
            if not ids:
                raise self._fleet_refused(out.get("Errors") or [], pools)
            pool = pools[0] if len(pools) == 1 else Placement(None, None, "", market)
            landed = self._wait_running(ids[0], pool)
            if landed is None:
                raise self._no_capacity(pools)
            return ids[0], landed, str(out.get("FleetId") or "")
        finally:
            try:
                self.ec2.delete_launch_template(LaunchTemplateId=template)
            except BOTO_ERRORS as e:  # a leftover template costs nothing; say so and go on
                log.warning("could not delete launch template %s: %s", template, e)

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

    def _wait_running(self, iid: str, pool: Placement) -> Placement | None:
        """Wait until the instance runs and return where it landed; None if EC2 ended it for lack of
        capacity while pending (the next pool is tried). Terminates it on a timeout or an interruption."""
        deadline = time.monotonic() + self.cfg.provision_timeout_s
        with _terminate_on_error(self.ec2, iid):
            while True:
                inst = self._look(iid, pool)
                state = str(inst.get("State", {}).get("Name") or "pending")
                if state == "running":
                    landed = _landed(inst, pool)
                    self.history.append(PlacementEvent(landed, PlacementOutcome.LAUNCHED, time.time()))
                    return landed
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
            out = self.ec2.describe_instances(InstanceIds=[iid])
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
        where = f"{', '.join(types)} in {', '.join(zones)} ({self.cfg.region})"
        return ProvisionError(f"no {market} capacity for {where}; will try again", retryable=True)


@contextmanager
def _terminate_on_error(ec2: EC2Client, iid: str) -> Iterator[None]:
    """Terminate a just-launched instance if anything (a timeout, a cancellation) escapes the block."""
    try:
        yield
    except BaseException as e:
        try:
            ec2.terminate_instances(InstanceIds=[iid])
        except BOTO_ERRORS as te:  # the original error propagates; the sweeper catches the leftover
            log.warning("could not terminate %s after %s: %s", iid, type(e).__name__, te)
        raise


def _landed(inst: dict[str, Any], pool: Placement) -> Placement:
    """The pool an instance is in, as EC2 reports it (a fleet chooses among pools)."""
    return replace(
        pool,
        subnet=inst.get("SubnetId") or pool.subnet,
        az=(inst.get("Placement") or {}).get("AvailabilityZone") or pool.az,
        instance_type=inst.get("InstanceType") or pool.instance_type,
        market="spot" if inst.get("InstanceLifecycle") == "spot" else pool.market,
    )
