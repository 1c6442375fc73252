"""Watching one EC2 worker: the instance's state from EC2, the trainer's progress from its heartbeat
object in the job's storage, both polled every `poll_s`, folded into a `WatchResult`.

The heartbeat (`_workers/<worker id>/heartbeat.json`; trainer/heartbeat.py holds the contract) carries
the last status record of each kind (trainer/status.py); records are fed in as the local provider
feeds status lines, but only the newest of each kind survives between two polls. Staleness is judged
on the watcher's clock (when the object last changed), never by comparing clocks across machines.

A spot reclaim sets notice_kind "spot-interruption" and kill_reason "reclaimed" (kill_detail: EC2's
StateReason code); notice_at is when the trainer heard of it: its
`notice` record (the instance metadata's interruption notice, trainer/notices.py) or, failing that,
its `stopping` record (the SIGTERM of the shutdown). A reclaim with neither leaves notice_at None.

The worker is gone when any of these holds:
  the instance is shutting down, terminated, stopping or stopped (EC2's StateReason says who did it);
  the heartbeat has an `exit` record (the trainer is over; the idle instance is left to release());
  the process that plays the instance in a test has exited (the `exit_status` seam);
  no `started` record within `startup_timeout_s`, or a heartbeat unchanged for `heartbeat_timeout_s`
  after it: the worker is lost and its instance terminated.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from botocore import exceptions as bce

from tasks.providers.aws_config import AwsProviderConfig
from tasks.providers.aws_errors import error_code
from tasks.providers.aws_launch import TAG_LEASE, lease_value
from tasks.providers.aws_policy import Placement
from tasks.providers.base import KillReason, NoticeKind, StatusCallback, WatchResult, Worker
from trainer.errors import StorageError
from trainer.heartbeat import heartbeat_records, read_heartbeat
from trainer.records import Durable, Record, Started, Step
from trainer.storage import Storage

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

log = logging.getLogger(__name__)

GONE_STATES = frozenset({"shutting-down", "terminated", "stopping", "stopped"})
SPOT_RECLAIMS = frozenset(
    {"Server.SpotInstanceTermination", "Server.SpotInstanceShutdown", "Server.InsufficientInstanceCapacity"}
)
USER_SHUTDOWN = "Client.UserInitiatedShutdown"
SPOT_INTERRUPTION = NoticeKind.SPOT_INTERRUPTION  # WatchResult.notice_kind of a reclaim by the spot market
# Spot request status codes that announce the end (EC2 sets them with the 2-minute notice).
SPOT_MARKED = frozenset({"marked-for-termination", "marked-for-stop", "marked-for-hibernation"})
STEP_SAMPLES, TAIL_LINES, TAIL_BYTES = 4096, 60, 8192
ExitStatus = Callable[[str], int | None]  # instance id -> exit status of the process playing it, or None


@dataclass
class AwsWorkerState:
    """Worker.handle of an EC2 worker: what provision learned and what watch and release need."""

    instance_id: str
    placement: Placement  # the pool it landed in (az as EC2 reports it)
    launch_id: str  # ClientToken and `spotrun:worker` tag
    launched_at: float  # epoch seconds it was seen running
    price_per_h: float | None  # the spot price at launch, or the on-demand price; None: unknown
    on_demand_price_per_h: float | None
    storage: Storage  # the job's storage, where the heartbeat lives
    fleet_id: str | None = None
    released_at: float | None = None  # release() was called (the watch reports a kill by release)


def spot_request_marked(request: Mapping[str, Any]) -> str | None:
    """The status code of a spot request that EC2 has marked for interruption, or None."""
    code = str(request.get("Status", {}).get("Code") or "")
    return code if code in SPOT_MARKED else None


def end_of_instance(
    state: str, reason_code: str, released: bool
) -> tuple[NoticeKind | None, KillReason, str]:
    """(notice_kind, kill_reason, kill_detail) for an instance EC2 reports in `state` with StateReason
    `reason_code`."""
    if reason_code in SPOT_RECLAIMS:
        return SPOT_INTERRUPTION, KillReason.RECLAIMED, reason_code
    if reason_code == USER_SHUTDOWN and released:
        return None, KillReason.RELEASE, reason_code
    return None, KillReason.INSTANCE_GONE, reason_code or f"instance {state}"


class WorkerWatch:
    """One watch of one worker; everything runs in the calling thread."""

    def __init__(
        self,
        ec2: EC2Client,
        cfg: AwsProviderConfig,
        worker: Worker,
        on_status: StatusCallback | None,
        exit_status: ExitStatus | None,
    ) -> None:
        self.ec2, self.cfg, self.worker, self.state = ec2, cfg, worker, worker.handle
        self.on_status, self.exit_status = on_status, exit_status
        self.result = WatchResult(started_at=worker.started_at)
        self.seen: dict[str, Record] = {}
        self.beat_t: Any = None  # the heartbeat's own `t`, to see it change
        now = time.monotonic()
        self.alive_mono = now - max(0.0, time.time() - self.state.launched_at)  # launch, then each beat
        self.steps: deque[tuple[float, int]] = deque(maxlen=STEP_SAMPLES)
        self.instance: dict[str, Any] = {}
        self.lease_renewed = now  # launch set the first lease

    def run(self) -> WatchResult:
        while True:
            self._renew_lease()
            self._read_heartbeat()
            if self._instance_gone() or self._process_exited():
                self._read_heartbeat()  # the last records, written while it shut down
                break
            if self.result.exit is not None or self._lost():
                break
            time.sleep(self.cfg.poll_s)
        return self._finish()

    def _renew_lease(self) -> None:
        """Push the instance's lease tag forward every third of the lease: while this flow watches, the
        sweeper leaves the instance alone; once it stops (even SIGKILLed), the lease runs out."""
        if time.monotonic() - self.lease_renewed < self.cfg.lease_s / 3:
            return
        try:
            self.ec2.create_tags(
                Resources=[self.state.instance_id],
                Tags=[{"Key": TAG_LEASE, "Value": lease_value(self.cfg.lease_s)}],
            )
            self.lease_renewed = time.monotonic()
        except (bce.ClientError, bce.BotoCoreError) as e:  # retried next poll; the lease still has time
            log.warning("could not renew the lease of %s: %s", self.state.instance_id, e)

    def _read_heartbeat(self) -> None:
        try:
            hb = read_heartbeat(self.state.storage, self.state.instance_id)
        except (StorageError, OSError) as e:  # storage hiccup: no news this tick; staleness keeps counting
            log.warning("%s: cannot read heartbeat: %s", self.worker.id, e)
            return
        if hb is None:
            return
        if hb.get("t") != self.beat_t:
            self.beat_t, self.alive_mono = hb.get("t"), time.monotonic()
        for rec in heartbeat_records(hb):
            if rec == self.seen.get(rec.kind):
                continue
            self.seen[rec.kind] = rec
            self._record(rec)
            if self.on_status is not None:
                self.on_status(rec)
        self._sample(hb)

    def _record(self, rec: Record) -> None:
        r = self.result
        r.fold(rec)
        if isinstance(rec, Started):
            r.started_training_at = rec.t
            self.steps.append((rec.t, rec.step))
        elif isinstance(rec, Step):
            self.steps.append((rec.t, rec.step))
        elif isinstance(rec, Durable):
            r.durable_times.append((rec.t, rec.step))

    def _sample(self, hb: dict[str, Any]) -> None:
        """The heartbeat's own step counters: newer than the last step record between two of them."""
        r, step, durable = self.result, hb.get("last_step"), hb.get("durable_step")
        if isinstance(durable, int):
            r.last_durable_step = max(r.last_durable_step or 0, durable)
        if isinstance(step, int) and step > r.last_step and r.started_training_at is not None:
            r.last_step = step
            self.steps.append((float(hb.get("t") or time.time()), step))

    def _instance_gone(self) -> bool:
        try:
            out = self.ec2.describe_instances(InstanceIds=[self.state.instance_id])
        except bce.ClientError as e:
            if error_code(e) == "InvalidInstanceID.NotFound":
                self.instance = {"State": {"Name": "terminated"}, "StateReason": {"Code": "not-found"}}
                return True
            log.warning("%s: describe_instances failed: %s", self.worker.id, e)
            return False
        except bce.BotoCoreError as e:  # connection trouble: the heartbeat still bounds the watch
            log.warning("%s: describe_instances failed: %s", self.worker.id, e)
            return False
        found = [i for res in out.get("Reservations", []) for i in res.get("Instances", [])]
        if not found:
            return False
        self.instance = dict(found[0])
        self._check_spot_request()
        return str(self.instance.get("State", {}).get("Name")) in GONE_STATES

    def _check_spot_request(self) -> None:
        """The controller's own notice: the spot request marked for interruption (the trainer's IMDS
        watcher may be off or slower). Recorded in facts["spot-request"]; notice_at if none better."""
        rid = self.instance.get("SpotInstanceRequestId")
        if not rid or "spot-request" in self.result.facts:
            return
        try:
            out = self.ec2.describe_spot_instance_requests(SpotInstanceRequestIds=[str(rid)])
        except (bce.ClientError, bce.BotoCoreError) as e:  # the instance state still ends the watch
            log.warning("%s: describe_spot_instance_requests failed: %s", self.worker.id, e)
            return
        code = next((spot_request_marked(r) for r in out.get("SpotInstanceRequests", [])), None)
        if code is not None:
            self.result.facts["spot-request"] = {"code": code, "t": time.time()}
            log.warning("%s: spot request %s is %s", self.worker.id, rid, code)

    def _process_exited(self) -> bool:
        if self.exit_status is None:
            return False
        code = self.exit_status(self.state.instance_id)
        if code is None:
            return False
        self.result.exit_code, self.result.signal = (code, None) if code >= 0 else (None, -code)
        return True

    def _lost(self) -> bool:
        r = self.result
        silent = time.monotonic() - self.alive_mono
        limit = (
            self.cfg.heartbeat_timeout_s if r.started_training_at is not None else self.cfg.startup_timeout_s
        )
        if silent < limit:
            return False
        r.lost, r.silent_s = True, round(silent, 1)
        r.killed_at, r.kill_reason = time.time(), KillReason.LOST
        log.warning("%s: no heartbeat for %.1f s; terminating it", self.worker.id, silent)
        try:
            self.ec2.terminate_instances(InstanceIds=[self.state.instance_id])
        except (bce.ClientError, bce.BotoCoreError) as e:  # release() tries again
            log.warning("%s: terminate failed: %s", self.worker.id, e)
        return True

    def _finish(self) -> WatchResult:
        r = self.result
        r.ended_at = time.time()
        if r.exit is not None and r.exit_code is None and r.signal is None:  # the process's own wins
            r.exit_code, r.signal = r.exit.code, None
        state = str(self.instance.get("State", {}).get("Name") or "")
        if state in GONE_STATES and not r.lost:
            reason = str(self.instance.get("StateReason", {}).get("Code") or "")
            released = self.state.released_at is not None
            r.notice_kind, r.kill_reason, r.kill_detail = end_of_instance(state, reason, released)
            if r.kill_reason == KillReason.RELEASE:
                r.killed_at = self.state.released_at
        self._notice()
        r.facts["ec2"] = {
            "instance_id": self.state.instance_id,
            "state": state,
            "reason_code": self.instance.get("StateReason", {}).get("Code"),
            "reason": self.instance.get("StateReason", {}).get("Message"),
        }
        r.step_times = list(self.steps)
        if r.exit is None:
            r.log_tail = self._console_tail()
        return r

    def _notice(self) -> None:
        """A stop notice the trainer reported makes the end a spot interruption, whatever EC2 says by
        now (the trainer may exit before the instance goes); notice_at is when the trainer heard."""
        r = self.result
        if r.notice is not None and r.notice.stop:
            r.notice_kind, r.notice_at = SPOT_INTERRUPTION, r.notice.t
        elif r.notice_kind == SPOT_INTERRUPTION and r.stopping is not None:
            r.notice_at = r.stopping.t
        elif r.notice_kind == SPOT_INTERRUPTION and "spot-request" in r.facts:
            r.notice_at = float(r.facts["spot-request"]["t"])  # noticed here, though not by the trainer

    def _console_tail(self) -> str:
        """The end of the instance's console output (cloud-init and the trainer's stderr), best effort."""
        try:
            out = self.ec2.get_console_output(InstanceId=self.state.instance_id)
        except (bce.ClientError, bce.BotoCoreError):
            return ""
        text = str(out.get("Output") or "")
        return "\n".join(text.splitlines()[-TAIL_LINES:])[-TAIL_BYTES:]
