"""Local servers for tests: a reverse proxy that injects S3 faults in front of moto; a Slack webhook."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import urlsplit

Fault = Literal["503", "reset", "cut"]

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}
SLOW_DOWN = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    "<Message>Please reduce your request rate.</Message><RequestId>{rid}</RequestId></Error>"
)


CONDITIONS = frozenset({"if-match", "if-none-match"})


class FaultProxy:
    """HTTP reverse proxy on 127.0.0.1 that answers the next N requests with a fault, then forwards.

    Faults: "503" answers 503 SlowDown with S3's XML body; "reset" reads the request and resets the
    connection (RST); "cut" forwards, then sends the headers and half the body and closes.
    """

    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.injected = 0
        self.requests = 0
        self.put_delay_s = 0.0  # every PUT waits this long before it is forwarded: a slow upload
        self.drop_conditions = False  # forward without If-Match/If-None-Match: a store that ignores them
        self._pending: list[Fault] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host!s}:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fault-proxy", daemon=True
        )

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def fail_next(self, n: int, kind: Fault = "503") -> None:
        """Answer the next n requests with the fault `kind` (replacing any faults still pending)."""
        with self._lock:
            self._pending = [kind] * n

    def _take(self) -> Fault | None:
        with self._lock:
            self.requests += 1
            if not self._pending:
                return None
            self.injected += 1
            return self._pending.pop()


def _handler_for(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as botocore's connection pool expects

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._proxy()

        do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

        def _proxy(self) -> None:
            body = self._read_body()
            if self.command == "PUT" and proxy.put_delay_s:
                time.sleep(proxy.put_delay_s)
            fault = proxy._take()
            if fault == "503":
                self._send_slow_down()
                return
            if fault == "reset":
                self._reset()
                return
            status, headers, data = self._forward(body)
            self.send_response(status)
            for k, v in headers:
                if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            if self.command == "HEAD":  # keeps the object's length; there is no body
                self.send_header(
                    "Content-Length", dict((k.lower(), v) for k, v in headers).get("content-length", "0")
                )
            else:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if fault == "cut":
                # Half the promised body, then a clean close: the client sees the stream end early.
                self.wfile.write(data[: len(data) // 2])
                self.close_connection = True
                return
            self.wfile.write(data)

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                parts = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(parts)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                if proxy.drop_conditions:
                    headers = {k: v for k, v in headers.items() if k.lower() not in CONDITIONS}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                return resp.status, resp.getheaders(), resp.read()
            finally:
                conn.close()

        def _send_slow_down(self) -> None:
            payload = b"" if self.command == "HEAD" else SLOW_DOWN.format(rid=uuid.uuid4().hex).encode()
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _reset(self) -> None:
            # SO_LINGER with a zero timeout makes close() send RST instead of FIN.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True

    return Handler


class SlackFake:
    """A Slack incoming webhook on 127.0.0.1: records every POST and answers from a script of
    (status, headers, body) replies, then 200 "ok". Stands in for hooks.slack.com in tests."""

    def __init__(self) -> None:
        self.requests: list[dict[str, object]] = []
        self._script: list[tuple[int, dict[str, str], str]] = []
        self._lock = threading.Condition()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with fake._lock:
                    status, headers, text = fake._script.pop(0) if fake._script else (200, {}, "ok")
                    fake.requests.append({"path": self.path, "status": status, "body": body.decode()})
                    fake._lock.notify_all()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text.encode())

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self.url = f"http://{host!s}:{port}/services/T000/B000/XXXX"

    def script(self, *replies: tuple[int, dict[str, str], str]) -> None:
        with self._lock:
            self._script.extend(replies)

    def delivered(self) -> list[dict[str, object]]:
        """The JSON bodies of the requests answered 200."""
        with self._lock:
            return [json.loads(str(r["body"])) for r in self.requests if r["status"] == 200]

    def wait_delivered(self, n: int, timeout_s: float) -> list[dict[str, object]]:
        """Wait until at least n messages were answered 200; returns them all (fewer on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while sum(r["status"] == 200 for r in self.requests) < n and time.monotonic() < deadline:
                self._lock.wait(0.5)
        return self.delivered()

    def start(self) -> SlackFake:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
