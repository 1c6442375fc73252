"""Cloud interruption notices: a daemon thread polls the machine's metadata service and turns a
notice into a stop request that carries the moment the machine goes away.

  aws    IMDSv2: PUT /latest/api/token, then GETs with the token
         /latest/meta-data/spot/instance-action         404 until {"action", "time"}: stop by `time` (~2 min)
         /latest/meta-data/events/recommendations/rebalance   {"noticeTime"}: reported, not a stop
  gcp    GET /computeMetadata/v1/instance/preempted (Metadata-Flavor: Google)
                                                        TRUE: stop within 30 s
  azure  GET /metadata/scheduledevents?api-version=2020-07-01 (Metadata: true)
                                                        Preempt/Terminate event: stop by NotBefore (else 30 s)

Every new notice is reported once (`on_notice`, which the trainer turns into a `notice` status
record); only the stopping kinds reach the StopRequest. A watcher never raises into training:
transport errors and odd answers are logged (the first loudly, naming the endpoint: without the
metadata service notices are missed; then at most once a minute) and polling goes on. Requests
bypass any HTTP proxy from the environment: the metadata service is link-local. Azure's first
scheduled-events request can take minutes to answer while the service starts; polls time out
meanwhile and are retried.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spotrun.trainer.preemption.requests import StopRequest
from spotrun.trainer.spec.job import PreemptionOptions

log = logging.getLogger(__name__)

DEFAULT_ENDPOINTS = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
SHORT_NOTICE_S = 30.0  # GCP's notice, and Azure's when NotBefore is missing
ERROR_LOG_EVERY_S = 60.0
MAX_BODY = 64 * 1024

AWS_TOKEN = "/latest/api/token"
AWS_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"
AWS_INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
GCP_PREEMPTED = "/computeMetadata/v1/instance/preempted"
AZURE_EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
AZURE_STOP_EVENTS = ("Preempt", "Terminate")


class MetadataError(Exception):
    """The metadata service answered, but not as documented."""


@dataclass(frozen=True)
class Notice:
    cloud: str
    action: str  # terminate | stop | hibernate | rebalance | preempted | Preempt | Terminate | Reboot ...
    stop: bool  # the machine goes away: checkpoint and stop
    deadline: float | None  # epoch seconds; None when the notice does not say
    key: str  # identity, so a notice polled again is reported once

    @property
    def reason(self) -> str:
        return f"{self.cloud} {self.action} notice"

    def record(self) -> dict[str, Any]:
        """Fields of the `notice` status record."""
        return {"cloud": self.cloud, "action": self.action, "stop": self.stop, "deadline": self.deadline}


# ---------------------------------------------------------------- payloads (pure)


def parse_iso_utc(text: str) -> float | None:
    """`2026-11-30T15:33:13Z` -> epoch seconds; None when it is not such a time."""
    try:
        t = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return None
    return (t if t.tzinfo else t.replace(tzinfo=dt.UTC)).timestamp()


def parse_aws_instance_action(body: str) -> Notice:
    """A 200 from spot/instance-action means an action is scheduled, so even an unreadable body
    stops (without a deadline, like a SIGTERM)."""
    try:
        doc = json.loads(body)
    except json.JSONDecodeError:
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    action = doc.get("action") if isinstance(doc.get("action"), str) else "unknown"
    deadline = parse_iso_utc(doc["time"]) if isinstance(doc.get("time"), str) else None
    return Notice("aws", f"spot {action}", True, deadline=deadline, key=body.strip())


def parse_aws_rebalance(body: str) -> Notice:
    """A rebalance recommendation: elevated risk of interruption, not a stop."""
    return Notice("aws", "rebalance recommendation", False, deadline=None, key=body.strip())


def parse_gcp_preempted(body: str, now: float) -> Notice | None:
    answer = body.strip().upper()
    if answer == "FALSE":
        return None
    if answer != "TRUE":
        raise MetadataError(f"instance/preempted answered {body.strip()[:80]!r}, expected TRUE or FALSE")
    return Notice("gcp", "preemption", True, deadline=now + SHORT_NOTICE_S, key="TRUE")


def parse_azure_events(body: str, now: float) -> list[Notice]:
    """Preempt and Terminate stop (deadline NotBefore, RFC 1123); other events are only reported."""
    try:
        events = json.loads(body).get("Events", [])
    except (json.JSONDecodeError, AttributeError):
        raise MetadataError(f"scheduledevents answered {body.strip()[:80]!r}, expected JSON") from None
    out = []
    for ev in events if isinstance(events, list) else []:
        if not isinstance(ev, dict):
            continue
        kind = str(ev.get("EventType", "unknown"))
        stop = kind in AZURE_STOP_EVENTS
        deadline = _rfc1123(ev.get("NotBefore")) if stop else None
        if stop and deadline is None:
            deadline = now + SHORT_NOTICE_S
        out.append(Notice("azure", kind, stop, deadline=deadline, key=str(ev.get("EventId", json.dumps(ev)))))
    return out


def _rfc1123(text: Any) -> float | None:
    try:
        return email.utils.parsedate_to_datetime(text).timestamp() if text else None
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------- watchers


class NoticeWatcher:
    """Polls one metadata service in a daemon thread; `poll()` does one round and may raise."""

    cloud = ""

    def __init__(
        self,
        base_url: str,
        stop: StopRequest,
        poll_s: float = 5.0,
        *,
        on_notice: Callable[[Notice], None] | None = None,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.base_url, self.stop, self.poll_s = base_url.rstrip("/"), stop, poll_s
        self.on_notice, self.timeout_s, self.clock = on_notice, timeout_s, clock
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: set[str] = set()
        self._failures, self._last_error_log, self._polls = 0, -ERROR_LOG_EVERY_S, 0

    def poll(self) -> list[Notice]:
        raise NotImplementedError

    def start(self) -> NoticeWatcher:
        log.info("watching %s interruption notices at %s every %gs", self.cloud, self.base_url, self.poll_s)
        self._thread = threading.Thread(target=self._run, name=f"spotrun-{self.cloud}-notices", daemon=True)
        self._thread.start()
        return self

    def close(self, wait_s: float = 0.0) -> None:
        """Stop polling; wait up to `wait_s` for a request in progress."""
        self._halt.set()
        if self._thread is not None and wait_s > 0:
            self._thread.join(wait_s)

    def _run(self) -> None:
        while not self._halt.is_set():
            try:
                notices = self.poll()
                self._answered()
                for n in notices:
                    self._deliver(n)
            except Exception as e:  # boundary of the watcher thread: logged, and the next poll retries
                self._failed(e)
            self._polls += 1
            if self.stop.requested and self.stop.deadline is not None:
                return  # a notice stopped training: nothing left to learn
            self._halt.wait(self.poll_s)

    def _deliver(self, n: Notice) -> None:
        if n.key in self._seen or self._halt.is_set():
            return
        self._seen.add(n.key)
        left = f" in {n.deadline - self.clock():.0f} s" if n.deadline is not None else ""
        if n.stop:
            log.warning("%s: the machine goes away%s; stopping at the next step boundary", n.reason, left)
        else:
            log.warning("%s: higher risk of interruption; training goes on", n.reason)
        if self.on_notice is not None:
            self.on_notice(n)
        if n.stop:
            self.stop.notice(n.reason, n.deadline)

    def _answered(self) -> None:
        if self._failures:
            log.info("%s metadata service at %s answers again", self.cloud, self.base_url)
        self._failures = 0

    def _failed(self, e: Exception) -> None:
        self._failures += 1
        what = f"{type(e).__name__}: {e}"
        now = time.monotonic()
        if self._polls == 0:
            log.warning(
                "%s metadata service at %s did not answer (%s): interruption notices will be missed until "
                "it does. Set preemption.endpoint in the job spec or SPOTRUN_IMDS_ENDPOINT on the worker, "
                "or preemption.notice: none where this is not %s",
                self.cloud,
                self.base_url,
                what,
                self.cloud,
            )
        elif now - self._last_error_log >= ERROR_LOG_EVERY_S:
            log.warning("%s notice poll failed (%d in a row): %s", self.cloud, self._failures, what)
        else:
            return
        self._last_error_log = now

    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
        """(status, body) for any HTTP answer; transport failures (refused, timeout) raise OSError."""
        req = urllib.request.Request(
            self.base_url + path, method=method, headers=headers, data=b"" if method == "PUT" else None
        )
        try:
            with self._opener.open(req, timeout=self.timeout_s) as r:
                return r.status, r.read(MAX_BODY).decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.read(MAX_BODY).decode("utf-8", "replace")


class AwsWatcher(NoticeWatcher):
    """EC2 IMDSv2: a session token (renewed before it expires, and at once after a 401) on every GET."""

    cloud = "aws"

    def __init__(self, *args: Any, token_ttl_s: int = 21600, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not 1 <= token_ttl_s <= 21600:
            raise ValueError("token_ttl_s must be in 1..21600 (IMDSv2's limits)")
        self.token_ttl_s = token_ttl_s
        self._token: str | None = None
        self._renew_at = 0.0

    def poll(self) -> list[Notice]:
        found = []
        status, body = self._get(AWS_INSTANCE_ACTION)
        if status == 200:
            found.append(parse_aws_instance_action(body))
        status, body = self._get(AWS_REBALANCE)
        if status == 200:
            found.append(parse_aws_rebalance(body))
        return found

    def _get(self, path: str) -> tuple[int, str]:
        status, body = self._request("GET", path, {AWS_TOKEN_HEADER: self._valid_token()})
        if status == 401:  # revoked or expired early (IMDS restarted, clock skew): one new token, one retry
            self._token = None
            status, body = self._request("GET", path, {AWS_TOKEN_HEADER: self._valid_token()})
        if status not in (200, 404):
            raise MetadataError(f"GET {path} answered HTTP {status}")
        return status, body

    def _valid_token(self) -> str:
        if self._token is None or time.monotonic() >= self._renew_at:
            status, body = self._request("PUT", AWS_TOKEN, {AWS_TTL_HEADER: str(self.token_ttl_s)})
            if status != 200 or not body.strip():
                raise MetadataError(f"PUT {AWS_TOKEN} answered HTTP {status}")
            # renew a quarter of the TTL (at most a minute) early: never send a token about to lapse
            self._token = body.strip()
            self._renew_at = time.monotonic() + self.token_ttl_s - min(60.0, self.token_ttl_s / 4)
        return self._token


class GcpWatcher(NoticeWatcher):
    cloud = "gcp"

    def poll(self) -> list[Notice]:
        status, body = self._request("GET", GCP_PREEMPTED, {"Metadata-Flavor": "Google"})
        if status != 200:
            raise MetadataError(f"GET {GCP_PREEMPTED} answered HTTP {status}")
        n = parse_gcp_preempted(body, self.clock())
        return [n] if n is not None else []


class AzureWatcher(NoticeWatcher):
    cloud = "azure"

    def poll(self) -> list[Notice]:
        status, body = self._request("GET", AZURE_EVENTS, {"Metadata": "true"})
        if status != 200:
            raise MetadataError(f"GET {AZURE_EVENTS} answered HTTP {status}")
        return parse_azure_events(body, self.clock())


WATCHERS: dict[str, type[NoticeWatcher]] = {"aws": AwsWatcher, "gcp": GcpWatcher, "azure": AzureWatcher}


def make_watcher(
    opts: PreemptionOptions,
    stop: StopRequest,
    on_notice: Callable[[Notice], None] | None = None,
    endpoint_override: str | None = None,
) -> NoticeWatcher | None:
    """The watcher the spec selects (not started), or None for `notice: none`. The endpoint is
    `endpoint_override` (the worker's SPOTRUN_IMDS_ENDPOINT), else the spec's, else the cloud's."""
    if opts.notice == "none":
        return None
    base = endpoint_override or opts.endpoint or DEFAULT_ENDPOINTS[opts.notice]
    return WATCHERS[opts.notice](base, stop, poll_s=opts.poll_s, on_notice=on_notice)
