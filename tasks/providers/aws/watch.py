"""Watching one EC2 worker: the instance's state from EC2, the trainer's progress from its heartbeat
object in the job's storage, both polled every `poll_s`, folded into a `WatchResult`.

The heartbeat (`_workers/<worker id>/heartbeat.json`; trainer/telemetry/heartbeat.py holds the contract)
carries the last status record of each kind (trainer/telemetry/status.py); records are fed in as the local
provider feeds status lines, but only the newest of each kind survives between two polls. Staleness is judged
on the watcher's clock (when the object last changed), never by comparing clocks across machines.

A spot reclaim sets notice_kind "spot-interruption" and kill_reason "reclaimed" (kill_detail: EC2's
StateReason code); notice_at is when the trainer heard of it: its
`notice` record (the instance metadata's interruption notice, trainer/preemption/notices.py) or, failing that,
its `stopping` record (the SIGTERM of the shutdown). A reclaim with neither leaves notice_at None.

A multi-node attempt is one worker over several instances (node 0 first). One node's heartbeat speaks
for the attempt: the one whose launcher relays global rank 0's records (and so holds the storage
lease). That is not always node 0: torchrun's c10d rendezvous numbers the nodes by sorted host name and
process id, not by SPOTRUN_NODE_RANK (in 3 of 6 two-node rehearsal attempts global rank 0 was on node
1). So until one heartbeat carries a `started` record, every node's is read; the first that does speaks
from then on (its exit record, its staleness, its process in a rehearsal); before that, node 0's. Every
instance is looked at each poll, and the end of any one ends the attempt: the others cannot train
without it (their collectives would wait for it until gloo's timeout), so the watch returns and
release() terminates them all. `gang_end` says which end explains the attempt: a reclaim of any node
before an instance gone for another reason before a release. The other nodes' exit records only go
into facts["ec2"]["nodes"]: a node whose trainer exits makes the speaking node's ranks fail or stop
soon after, or fall silent (then the heartbeat timeout below applies).

The worker is gone when any of these holds:
  an instance is shutting down, terminated, stopping or stopped (EC2's StateReason says who did it);
  the heartbeat has an `exit` record (the trainer is over; the idle instance is left to release());
  the process that plays the instance in a test has exited (the `exit_status` seam);
  no `started` record within `startup_timeout_s`, or a heartbeat unchanged for `heartbeat_timeout_s`
  after it: the worker is lost and its instance terminated.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from botocore import exceptions as bce

from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.errors import error_code
from spotrun.tasks.providers.aws.launch import TAG_LEASE, lease_value
from spotrun.tasks.providers.aws.policy import Placement
from spotrun.tasks.providers.base import KillReason, NoticeKind, StatusCallback, WatchResult, Worker
from spotrun.trainer.errors import StorageError
from spotrun.trainer.storage import Storage
from spotrun.trainer.telemetry.heartbeat import heartbeat_losses, heartbeat_records, read_heartbeat
from spotrun.trainer.telemetry.records import Durable, Exit, Record, Started, Step

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
    """Worker.handle of an EC2 worker: what provision learned and what watch and release need. A
    multi-node attempt is one worker: node 0 is `instance_id`, the others `peers`, all in one pool."""

    instance_id: str
    placement: Placement  # the pool it landed in (az as EC2 reports it)
    launch_id: str  # ClientToken and `spotrun:worker` tag
    launched_at: float  # epoch seconds it (every node) was seen running
    price_per_h: float | None  # the attempt's: the spot price at launch (or on-demand) x nodes; None: unknown
    on_demand_price_per_h: float | None  # x nodes, too
    storage: Storage  # the job's storage, where the heartbeat lives
    fleet_id: str | None = None
    released_at: float | None = None  # release() was called (the watch reports a kill by release)
    peers: list[str] = field(default_factory=list)  # nodes 1.. of a multi-node attempt, in node order
    master_addr: str | None = None  # node 0's private IP, where the nodes rendezvous
    placement_group: str | None = None  # the attempt's cluster placement group (multi-node, if asked)

    @property
    def instance_ids(self) -> list[str]:
        """Every node's instance, node 0 first."""
        return [self.instance_id, *self.peers]


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


_END_ORDER = {KillReason.RECLAIMED: 0, KillReason.INSTANCE_GONE: 1, KillReason.RELEASE: 2}


def gang_end(
    nodes: Sequence[tuple[str, str]], released: bool
) -> tuple[NoticeKind | None, KillReason, str] | None:
    """(notice_kind, kill_reason, kill_detail) for the attempt from each node's (EC2 state, StateReason
    code), node 0 first; None while no instance is gone. A reclaim of any node explains the end best
    (what followed it, a release or a failure, does not), then an instance gone for another reason, then
    a release; the lowest node within each. The detail names the node, except node 0's (one instance)."""
    ends = [
        (i, end_of_instance(state, code, released))
        for i, (state, code) in enumerate(nodes)
        if state in GONE_STATES
    ]
    if not ends:
        return None
    i, (kind, reason, detail) = min(ends, key=lambda e: (_END_ORDER[e[1][1]], e[0]))
    return kind, reason, detail if i == 0 else f"node {i}: {detail}"


class WorkerWatch:
    """One watch of one worker (every node's instance); everything runs in the calling thread."""

    def __init__(
        self,
        ec2: EC2Client,
        cfg: AwsProviderConfig,
        worker: Worker,
        *,
        on_status: StatusCallback | None,
        exit_status: ExitStatus | None,
        renew_others: Callable[[], None] | None = None,
    ) -> None:
        self.ec2, self.cfg, self.worker, self.state = ec2, cfg, worker, worker.handle
        self.renew_others = renew_others  # the provider's standby instances, renewed with this one
        self.on_status, self.exit_status = on_status, exit_status
        self.result = worker.result = WatchResult(started_at=worker.started_at)  # also read on interrupt
        self.seen: dict[str, Record] = {}
        self.beat_t: Any = None  # the heartbeat's own `t`, to see it change
        now = time.monotonic()
        self.alive_mono = now - max(0.0, time.time() - self.state.launched_at)  # launch, then each beat
        self.steps: deque[tuple[float, int]] = deque(maxlen=STEP_SAMPLES)
        self.instances: dict[str, dict[str, Any]] = {}  # instance id -> as EC2 last listed it
        self.speaker: str | None = None if self.state.peers else self.state.instance_id  # see the docstring
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
        """Push the instances' lease tag forward every third of the lease: while this flow watches, the
        sweeper leaves them alone; once it stops (even SIGKILLed), the lease runs out."""
        if time.monotonic() - self.lease_renewed < self.cfg.lease_s / 3:
            return
        try:
            self.ec2.create_tags(
                Resources=self.state.instance_ids,
                Tags=[{"Key": TAG_LEASE, "Value": lease_value(self.cfg.lease_s)}],
            )
            self.lease_renewed = time.monotonic()
        except (bce.ClientError, bce.BotoCoreError) as e:  # retried next poll; the lease still has time
            log.warning("could not renew the lease of %s: %s", self.worker.id, e)
        if self.renew_others is not None:
            self.renew_others()

    @property
    def voice(self) -> str:
        """The instance whose heartbeat speaks for the attempt (node 0 until another is known to)."""
        return self.speaker or self.state.instance_id

    def _read_heartbeat(self) -> None:
        if self.speaker is None:
            self._find_speaker()
        try:
            hb = read_heartbeat(self.state.storage, self.voice)
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
        self.result.add_losses(heartbeat_losses(hb))  # the steps between two polls' step records
        self._sample(hb)

    def _find_speaker(self) -> None:
        """The first node whose heartbeat has a `started` record: global rank 0 is there."""
        for iid in self.state.instance_ids:
            try:
                hb = read_heartbeat(self.state.storage, iid)
            except (StorageError, OSError):  # no news this tick; node 0's read below says so
                return
            if "started" in ((hb or {}).get("records") or {}):
                self.speaker = iid
                if iid != self.state.instance_id:
                    node = self.state.instance_ids.index(iid)
                    log.info(
                        "%s: global rank 0 is on node %d (%s): its heartbeat speaks",
                        self.worker.id,
                        node,
                        iid,
                    )
                return

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
        """Look at every node's instance (one call); True once any of them is gone."""
        listed = self._describe(self.state.instance_ids)
        self.instances.update(listed)
        self._check_spot_requests(listed)
        return any(self._state(iid) in GONE_STATES for iid in self.state.instance_ids)

    def _describe(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """The instances EC2 lists now ({} when it cannot say); one it does not know counts as terminated.
        One unknown id fails the whole call, so then each is asked alone."""
        try:
            out = self.ec2.describe_instances(InstanceIds=ids)
        except bce.ClientError as e:
            if error_code(e) == "InvalidInstanceID.NotFound":
                if len(ids) == 1:
                    return {ids[0]: {"State": {"Name": "terminated"}, "StateReason": {"Code": "not-found"}}}
                return {iid: inst for one in ids for iid, inst in self._describe([one]).items()}
            log.warning("%s: describe_instances failed: %s", self.worker.id, e)
            return {}
        except bce.BotoCoreError as e:  # connection trouble: the heartbeat still bounds the watch
            log.warning("%s: describe_instances failed: %s", self.worker.id, e)
            return {}
        found = [i for res in out.get("Reservations", []) for i in res.get("Instances", [])]
        return {str(i["InstanceId"]): dict(i) for i in found if i.get("InstanceId") in ids}

    def _state(self, iid: str) -> str:
        return str(self.instances.get(iid, {}).get("State", {}).get("Name") or "")

    def _reason(self, iid: str) -> str:
        return str(self.instances.get(iid, {}).get("StateReason", {}).get("Code") or "")

    def _check_spot_requests(self, listed: dict[str, dict[str, Any]]) -> None:
        """The controller's own notice: a node's spot request marked for interruption (the trainer's IMDS
        watcher may be off or slower). Recorded in facts["spot-request"]; notice_at if none better."""
        rids = {
            str(i["SpotInstanceRequestId"]): iid
            for iid, i in listed.items()
            if i.get("SpotInstanceRequestId")
        }
        if not rids or "spot-request" in self.result.facts:
            return
        try:
            out = self.ec2.describe_spot_instance_requests(SpotInstanceRequestIds=list(rids))
        except (bce.ClientError, bce.BotoCoreError) as e:  # the instance state still ends the watch
            log.warning("%s: describe_spot_instance_requests failed: %s", self.worker.id, e)
            return
        for req in out.get("SpotInstanceRequests", []):
            code = spot_request_marked(req)
            if code is None:
                continue
            rid = str(req.get("SpotInstanceRequestId") or "")
            iid = rids.get(rid, self.state.instance_id)
            self.result.facts["spot-request"] = {"code": code, "t": time.time(), "instance_id": iid}
            log.warning("%s: spot request %s of %s is %s", self.worker.id, rid, iid, code)
            return

    def _process_exited(self) -> bool:
        if self.exit_status is None:
            return False
        code = self.exit_status(self.voice)
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
            self.ec2.terminate_instances(InstanceIds=self.state.instance_ids)
        except (bce.ClientError, bce.BotoCoreError) as e:  # release() tries again
            log.warning("%s: terminate failed: %s", self.worker.id, e)
        return True

    def _finish(self) -> WatchResult:
        r = self.result
        r.ended_at = time.time()
        if r.exit is not None and r.exit_code is None and r.signal is None:  # the process's own wins
            r.exit_code, r.signal = r.exit.code, None
        ids = self.state.instance_ids
        end = gang_end([(self._state(i), self._reason(i)) for i in ids], self.state.released_at is not None)
        if end is not None and not r.lost:
            r.notice_kind, r.kill_reason, r.kill_detail = end
            if r.kill_reason == KillReason.RELEASE:
                r.killed_at = self.state.released_at
        self._notice()
        node0 = self.instances.get(self.state.instance_id, {})
        r.facts["ec2"] = {
            "instance_id": self.state.instance_id,
            "state": self._state(self.state.instance_id),
            "reason_code": node0.get("StateReason", {}).get("Code"),
            "reason": node0.get("StateReason", {}).get("Message"),
        }
        if self.state.peers:
            r.facts["ec2"]["nodes"] = [self._node_fact(iid) for iid in ids]
        r.step_times = list(self.steps)
        if r.exit is None:
            r.log_tail = self._console_tail()
        return r

    def _node_fact(self, iid: str) -> dict[str, Any]:
        """One node's end, for the attempt's record: its instance and how its own trainer exited."""
        exit_rec = self.result.exit
        if iid != self.voice:
            try:
                hb = read_heartbeat(self.state.storage, iid)
            except (StorageError, OSError):  # best effort: the speaking node's records decide
                hb = None
            exit_rec = next((rec for rec in heartbeat_records(hb or {}) if isinstance(rec, Exit)), None)
        return {
            "instance_id": iid,
            "state": self._state(iid),
            "reason_code": self._reason(iid) or None,
            "exit": exit_rec.name if exit_rec is not None else None,
            "speaks": iid == self.voice,  # its launcher relayed global rank 0's records
        }

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
        """The end of the speaking node's console output (cloud-init and the trainer's stderr), best
        effort."""
        try:
            out = self.ec2.get_console_output(InstanceId=self.voice)
        except (bce.ClientError, bce.BotoCoreError):
            return ""
        text = str(out.get("Output") or "")
        return "\n".join(text.splitlines()[-TAIL_LINES:])[-TAIL_BYTES:]
