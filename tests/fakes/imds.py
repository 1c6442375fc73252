"""Stand-ins for the clouds' metadata services on 127.0.0.1 (stdlib only): EC2 IMDSv2 with its token
flow and spot/rebalance notices, GCP's `instance/preempted`, Azure's scheduled events.

A stand-in checked against the documented metadata APIs. Each answers 404/FALSE/no events until
the test triggers a notice.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import secrets
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from spotrun.trainer.preemption.notices import AWS_TOKEN_HEADER, AWS_TTL_HEADER

Answer = tuple[int, str]


def iso_utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def unused_endpoint() -> str:
    """A loopback URL nothing listens on: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class FakeServer:
    """Serves `answer(method, path, headers)` on an ephemeral port; records every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.statuses: list[int] = []  # every answer's HTTP status, in order
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.requests.append((self.command, self.path))
                code, body = outer.answer(self.command, self.path, self.headers)
                outer.statuses.append(code)
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json" if body.startswith("{") else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = _serve

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def answer(self, method: str, path: str, headers: Any) -> Answer:
        raise NotImplementedError

    def count(self, method: str, path: str) -> int:
        return sum(1 for r in list(self.requests) if r == (method, path))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeIMDS(FakeServer):
    """IMDSv2: PUT a token (TTL 1..21600 s, else 400), send it on every GET (else 401)."""

    def __init__(self) -> None:
        self.tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.meta: dict[str, str] = {"instance-id": "i-0123456789abcdef0", "instance-life-cycle": "spot"}
        super().__init__()

    def answer(self, method: str, path: str, headers: Any) -> Answer:
        if method == "PUT":
            if path != "/latest/api/token":
                return 404, "Not Found"
            ttl = headers.get(AWS_TTL_HEADER, "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return 400, "Bad Request"
            token = secrets.token_urlsafe(24)
            with self.lock:
                self.tokens[token] = time.monotonic() + int(ttl)
            return 200, token
        with self.lock:
            expiry = self.tokens.get(headers.get(AWS_TOKEN_HEADER) or "")
            if expiry is None or expiry < time.monotonic():
                return 401, "Unauthorized"
            value = self.meta.get(path.removeprefix("/latest/meta-data/"))
        return (200, value) if value is not None else (404, "Not Found")

    def interrupt(self, in_seconds: float = 120, action: str = "terminate") -> float:
        """Schedule a spot action; returns its time (epoch seconds, whole as IMDS gives it)."""
        when = iso_utc(time.time() + in_seconds)
        with self.lock:
            self.meta["spot/instance-action"] = json.dumps({"action": action, "time": when})
        return dt.datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()

    def clear_notice(self) -> None:
        """The notice is gone, as on the next instance."""
        with self.lock:
            self.meta.pop("spot/instance-action", None)

    def rebalance(self) -> None:
        with self.lock:
            self.meta["events/recommendations/rebalance"] = json.dumps({"noticeTime": iso_utc(time.time())})

    def revoke_tokens(self) -> None:
        """As after an IMDS restart: every token issued so far answers 401."""
        with self.lock:
            self.tokens.clear()


class FakeGCPMetadata(FakeServer):
    """`instance/preempted` answers FALSE until `preempt()`; needs `Metadata-Flavor: Google`."""

    preempted = False

    def answer(self, method: str, path: str, headers: Any) -> Answer:
        if headers.get("Metadata-Flavor") != "Google":
            return 403, "Missing Metadata-Flavor:Google header."
        if method != "GET" or path != "/computeMetadata/v1/instance/preempted":
            return 404, "Not Found"
        return 200, "TRUE" if self.preempted else "FALSE"

    def preempt(self) -> None:
        self.preempted = True


class FakeAzureEvents(FakeServer):
    """Scheduled events: `{"Events": []}` until an event is added; needs `Metadata: true`."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        super().__init__()

    def answer(self, method: str, path: str, headers: Any) -> Answer:
        if headers.get("Metadata") != "true":
            return 400, '{"error": "Bad request. Required metadata header not specified"}'
        if method != "GET" or not path.startswith("/metadata/scheduledevents?api-version="):
            return 404, "Not Found"
        with self.lock:
            return 200, json.dumps({"DocumentIncarnation": len(self.events), "Events": self.events})

    def add_event(self, kind: str = "Preempt", in_seconds: float | None = 30) -> None:
        not_before = (
            "" if in_seconds is None else email.utils.formatdate(time.time() + in_seconds, usegmt=True)
        )
        event = {
            "EventId": f"event-{len(self.events)}",
            "EventType": kind,
            "ResourceType": "VirtualMachine",
            "Resources": ["vm-0"],
            "EventStatus": "Scheduled",
            "NotBefore": not_before,
        }
        with self.lock:
            self.events.append(event)
