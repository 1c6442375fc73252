"""An S3 endpoint that behaves like one for throughput: each connection capped (20 MB/s by default) and
each request delayed (15 ms), in front of a store that keeps object sizes and discards large bodies.

Why not moto: against moto a parallel multipart upload measured 0.69-1.05x a single PUT, decided by the
VM rather than the client (moto assembles parts in memory, reaches ~180-205 MB/s here, and reads a whole
object for every ranged GET: a parallel download of N parts costs N times the object). Real S3 caps one
connection at roughly 50-100 MB/s and scales with parallel connections, which is what decides whether
`multipart_chunk_mb` x `max_concurrency` pays. The cap defaults to 20 MB/s, not AWS's 50-100: the
endpoint shares this machine's 2 cores with the client, and 8 connections at 20 MB/s (160 MB/s) stay
below what one Python process can serve, so the cap, not this server, sets every figure; the ideal
ratio (`ideal_ratio`) is what the cap alone allows, given the parts and the concurrency.

Objects up to KEEP_BYTES are kept (manifests, markers, metrics: what spotrun reads back); larger ones
keep only their size, and a GET of one returns that many zero bytes. It answers what S3Storage and boto3
transfers ask: PutObject, multipart uploads, GetObject (ranged), HeadObject (with a CRC32 checksum, so a
HEAD confirms an upload as on AWS), ListObjectsV2, DeleteObjects, ListMultipartUploads. One bucket name
is as good as another; nothing is checked (signatures, checksums sent). For correctness use moto.

    .venv/bin/python bench/capped_s3.py [--port 0] [--mb-s 20] [--latency-ms 15]   # prints its URL
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

DEFAULT_MB_S = 20.0
DEFAULT_LATENCY_MS = 15.0
KEEP_BYTES = 1 << 20
CHUNK = 256 * 1024
ZEROS = bytes(CHUNK)
MB = 1024 * 1024


@dataclass
class Obj:
    size: int
    data: bytes | None  # None: discarded (read back as zeros)
    mtime: float = field(default_factory=time.time)

    @property
    def etag(self) -> str:
        return '"' + hashlib.md5(self.data or str(self.size).encode()).hexdigest() + '"'


class Store:
    def __init__(self) -> None:
        self.objects: dict[str, Obj] = {}  # "bucket/key"
        self.uploads: dict[str, dict[int, int]] = {}  # upload id -> part number -> size
        self.lock = threading.Lock()


class Throttle:
    """One connection's cap: at most `bytes_s` bytes a second, in either direction together."""

    def __init__(self, bytes_s: float) -> None:
        self.bytes_s, self.t0, self.sent = bytes_s, time.monotonic(), 0

    def take(self, n: int) -> None:
        self.sent += n
        ahead = self.sent / self.bytes_s - (time.monotonic() - self.t0)
        if ahead > 0:
            time.sleep(ahead)
        elif ahead < -0.05:  # idle since: no credit saved up for a burst
            self.t0, self.sent = time.monotonic() - self.sent / self.bytes_s, self.sent


def serve(
    port: int = 0, mb_s: float = DEFAULT_MB_S, latency_ms: float = DEFAULT_LATENCY_MS
) -> ThreadingHTTPServer:
    """The endpoint on 127.0.0.1 (`port` 0: a free one), not yet serving: call serve_forever."""
    store = Store()
    handler = type(
        "Handler", (_Handler,), {"store": store, "bytes_s": mb_s * MB, "latency_s": latency_ms / 1000}
    )
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    return server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: Store
    bytes_s: float
    latency_s: float

    def setup(self) -> None:
        super().setup()
        self.throttle = Throttle(self.bytes_s)  # one per connection: BaseHTTPRequestHandler serves one

    def log_message(self, format: str, *args: object) -> None:
        pass

    # -- plumbing ---------------------------------------------------------------------------------

    def _target(self) -> tuple[str, dict[str, list[str]]]:
        u = urlsplit(self.path)
        return unquote(u.path.lstrip("/")), parse_qs(u.query, keep_blank_values=True)

    def _body(self, keep: bool) -> tuple[int, bytes]:
        """Read the request body at the capped rate: (decoded size, the bytes when `keep`)."""
        chunked = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
        raw = (
            self._read_chunked()
            if chunked
            else self._read_n(int(self.headers.get("Content-Length", 0)), keep)
        )
        if "aws-chunked" in self.headers.get("Content-Encoding", ""):
            decoded = int(self.headers.get("x-amz-decoded-content-length", "0"))
            return decoded, _aws_unchunk(raw) if keep else b""
        return (len(raw) if keep or chunked else int(self.headers.get("Content-Length", 0))), raw

    def _read_n(self, n: int, keep: bool) -> bytes:
        parts, left = [], n
        while left:
            got = self.rfile.read(min(CHUNK, left))
            if not got:
                break
            self.throttle.take(len(got))
            left -= len(got)
            if keep:
                parts.append(got)
        return b"".join(parts)

    def _read_chunked(self) -> bytes:
        parts = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
            parts.append(self._read_n(size, True))
            self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        return b"".join(parts)

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Date", formatdate(usegmt=True))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.throttle.take(len(body))
            self.wfile.write(body)

    def _xml(self, body: str) -> None:
        self._send(
            200,
            ('<?xml version="1.0" encoding="UTF-8"?>' + body).encode(),
            {"Content-Type": "application/xml"},
        )

    def _missing(self) -> None:
        self._send(404, b"<Error><Code>NoSuchKey</Code><Message>no such key</Message></Error>")

    # -- S3 ---------------------------------------------------------------------------------------

    def do_PUT(self) -> None:
        time.sleep(self.latency_s)
        path, q = self._target()
        if "/" not in path:  # CreateBucket
            self._body(False)
            self._send(200)
            return
        if "uploadId" in q:
            size, _ = self._body(False)
            with self.store.lock:
                self.store.uploads.setdefault(q["uploadId"][0], {})[int(q["partNumber"][0])] = size
            self._send(200, headers={"ETag": f'"{uuid.uuid4().hex}"'})
            return
        declared = int(
            self.headers.get("x-amz-decoded-content-length") or self.headers.get("Content-Length") or 0
        )
        size, data = self._body(declared <= KEEP_BYTES)
        obj = Obj(size, data if declared <= KEEP_BYTES else None)
        with self.store.lock:
            self.store.objects[path] = obj
        self._send(200, headers={"ETag": obj.etag})

    def do_POST(self) -> None:
        time.sleep(self.latency_s)
        path, q = self._target()
        if "uploads" in q:
            upload = uuid.uuid4().hex
            with self.store.lock:
                self.store.uploads[upload] = {}
            bucket, _, key = path.partition("/")
            self._xml(
                f"<InitiateMultipartUploadResult><Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key>"
                f"<UploadId>{upload}</UploadId></InitiateMultipartUploadResult>"
            )
            return
        if "uploadId" in q:
            self._body(False)
            with self.store.lock:
                parts = self.store.uploads.pop(q["uploadId"][0], {})
                obj = self.store.objects[path] = Obj(sum(parts.values()), None)
            self._xml(
                f"<CompleteMultipartUploadResult><ETag>{escape(obj.etag)}</ETag></CompleteMultipartUploadResult>"
            )
            return
        if "delete" in q:
            _, body = self._body(True)
            bucket = path.strip("/")
            keys = [unquote(k) for k in re.findall(r"<Key>(.*?)</Key>", body.decode())]
            with self.store.lock:
                for k in keys:
                    self.store.objects.pop(f"{bucket}/{_unescape(k)}", None)
            self._xml("<DeleteResult></DeleteResult>")
            return
        self._send(400)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        time.sleep(self.latency_s)
        path, q = self._target()
        if "/" not in path.strip("/"):
            self._list(path.strip("/"), q)
            return
        with self.store.lock:
            obj = self.store.objects.get(path)
        if obj is None:
            self._missing()
            return
        first, last = 0, obj.size - 1
        if m := re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")):
            first, last = int(m[1]), min(int(m[2]) if m[2] else obj.size - 1, obj.size - 1)
        n = max(0, last - first + 1)
        headers = {
            "ETag": obj.etag,
            "Last-Modified": formatdate(obj.mtime, usegmt=True),
            "Accept-Ranges": "bytes",
            "Content-Type": "binary/octet-stream",
        }
        if self.command == "HEAD":  # a checksum, as S3 keeps one for every upload a client sent one with
            crc = base64.b64encode(hashlib.md5(str(obj.size).encode()).digest()[:4]).decode()
            headers["x-amz-checksum-crc32"] = crc
        status = 206 if "Range" in self.headers else 200
        if status == 206:
            headers["Content-Range"] = f"bytes {first}-{last}/{obj.size}"
        self.send_response(status)
        self.send_header("Date", formatdate(usegmt=True))
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(n if self.command != "HEAD" else obj.size))
        self.end_headers()
        if self.command == "HEAD":
            return
        if obj.data is not None:
            self.throttle.take(n)
            self.wfile.write(obj.data[first : last + 1])
            return
        while n:
            k = min(n, CHUNK)
            self.throttle.take(k)
            self.wfile.write(ZEROS[:k])
            n -= k

    def _list(self, bucket: str, q: dict[str, list[str]]) -> None:
        if "uploads" in q:
            self._xml(
                f"<ListMultipartUploadsResult><Bucket>{escape(bucket)}</Bucket></ListMultipartUploadsResult>"
            )
            return
        prefix = q.get("prefix", [""])[0]
        after = q.get("continuation-token", q.get("start-after", [""]))[0]
        limit = int(q.get("max-keys", ["1000"])[0])
        with self.store.lock:
            keys = sorted(
                (k.partition("/")[2], o)
                for k, o in self.store.objects.items()
                if k.startswith(f"{bucket}/{prefix}")
            )
        keys = [(k, o) for k, o in keys if k > after]
        page, more = keys[:limit], len(keys) > limit
        items = "".join(
            f"<Contents><Key>{escape(k)}</Key><Size>{o.size}</Size><ETag>{escape(o.etag)}</ETag>"
            f"<LastModified>{time.strftime('%Y-%m-%dT%H:%M:%S.000Z', time.gmtime(o.mtime))}</LastModified>"
            "<StorageClass>STANDARD</StorageClass></Contents>"
            for k, o in page
        )
        token = f"<NextContinuationToken>{escape(page[-1][0])}</NextContinuationToken>" if more else ""
        self._xml(
            f"<ListBucketResult><Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
            f"<KeyCount>{len(page)}</KeyCount><MaxKeys>{limit}</MaxKeys>"
            f"<IsTruncated>{'true' if more else 'false'}</IsTruncated>{token}{items}</ListBucketResult>"
        )


def _unescape(s: str) -> str:
    return (
        s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", '"')
        .replace("&apos;", "'")
        .replace("&amp;", "&")
    )


def _aws_unchunk(raw: bytes) -> bytes:
    """The payload of an `aws-chunked` body: `hex-size[;ext]\\r\\n data \\r\\n ... 0\\r\\n trailers`."""
    out: list[bytes] = []
    i = 0
    while True:
        j = raw.index(b"\r\n", i)
        size = int(raw[i:j].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(raw[j + 2 : j + 2 + size])
        i = j + 2 + size + 2


def ideal_ratio(size: int, part: int, concurrency: int) -> float:
    """What the per-connection cap alone allows parallel parts to gain over one stream: the object's
    bytes over those of the waves of parts (each wave `concurrency` parts at once, the last maybe short)."""
    parts = -(-size // part)
    waves = -(-parts // concurrency)
    last_wave = parts - (waves - 1) * concurrency
    # every wave but the last takes one part's time; the last takes its largest part's
    last_part = size - (parts - 1) * part
    slowest_last = part if last_wave > 1 else last_part
    return size / ((waves - 1) * part + slowest_last)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--mb-s", type=float, default=DEFAULT_MB_S, help="per-connection cap, MB/s")
    ap.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_MS, help="added to every request")
    args = ap.parse_args()
    server = serve(args.port, args.mb_s, args.latency_ms)
    host, port = server.server_address[:2]
    print(f"http://{host!s}:{port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever(0.1)
    sys.exit(0)


if __name__ == "__main__":
    main()
