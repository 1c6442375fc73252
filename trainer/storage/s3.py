"""S3 backend. It is given a boto3 client; every vendor error is translated in `map_s3_error`.

botocore already retries throttling, 5xx and connection errors on each call (standard mode), so
a `TransientStorageError` from here means those retries ran out. `with_retries` adds a slower
outer loop on top, and is the only retry for a body that breaks mid-stream: botocore returns
once the headers arrive, so an error while reading the body is never retried by it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore import exceptions as bce
from botocore.config import Config

from spotrun.trainer.errors import ConfigError, PreconditionFailed, StorageError, TransientStorageError
from spotrun.trainer.redact import redact
from spotrun.trainer.storage.base import CHUNK, ObjectInfo, Stamped, Storage
from spotrun.trainer.storage.local import TMP_MARK
from spotrun.trainer.storage.options import S3Options

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import GetObjectOutputTypeDef

log = logging.getLogger(__name__)

T = TypeVar("T")

DELETE_BATCH = 1000  # the most keys one DeleteObjects request may carry
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded"})
TRANSIENT_CODES = THROTTLE_CODES | {"RequestTimeout", "InternalError", "ServiceUnavailable"}
# 412: an If-Match/If-None-Match did not hold. 409 ConditionalRequestConflict: another conditional
# write to the key raced this one (AWS); either way the caller re-reads and decides again.
PRECONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
EXPIRED_FIX = "the session token has expired; refresh the credentials (aws sso login, renew the role)"
CREDENTIAL_FIXES = {
    "InvalidAccessKeyId": "the access key id is unknown to S3; check AWS_ACCESS_KEY_ID or the AWS profile",
    "SignatureDoesNotMatch": "the secret key does not match the access key id; check AWS_SECRET_ACCESS_KEY",
    "ExpiredToken": EXPIRED_FIX,
    "TokenRefreshRequired": EXPIRED_FIX,
    "InvalidToken": "the session token is malformed; check AWS_SESSION_TOKEN",
    "RequestTimeTooSkewed": "this machine's clock is too far off for request signing; sync it (chrony/NTP)",
    "AccessDenied": "access denied; grant this identity s3:GetObject/PutObject/ListBucket/DeleteObject/"
    "AbortMultipartUpload on the bucket (and kms:GenerateDataKey/Decrypt when sse is aws:kms)",
}
# Errors of the connection itself (reset, timeout, refused, body cut short), not of the request.
TRANSIENT_EXCEPTIONS = (
    bce.ConnectionError,
    bce.HTTPClientError,
    bce.IncompleteReadError,
    ConnectionError,
    TimeoutError,
)
# (endpoint, bucket) -> None when the store honours If-None-Match/If-Match on PutObject, else why not
_PROBED: dict[tuple[str | None, str], str | None] = {}
_PROBE_LOCK = threading.Lock()
NO_CREDENTIALS_FIX = (
    "no AWS credentials found; set AWS_PROFILE or AWS_SHARED_CREDENTIALS_FILE (a local trainer never "
    "gets the controller's AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), or run on an instance with an "
    "instance profile"
)


def make_s3_client(
    opts: S3Options, *, session: boto3.session.Session | None = None, total_attempts: int = 5
) -> S3Client:
    """Build an S3 client from the options; credentials come from `session` or boto3's usual chain."""
    config = Config(
        region_name=opts.region,
        # total_max_attempts counts the first try; botocore's "max_attempts" key would count retries only.
        retries={"mode": "standard", "total_max_attempts": total_attempts},
        connect_timeout=10,
        read_timeout=60,
        # Upload threads plus a reader or lister running beside them.
        max_pool_connections=max(10, opts.max_concurrency + 4),
        tcp_keepalive=True,
    )
    # A fresh session rather than boto3's module-level default, whose cached credentials would be
    # shared by every client in the process.
    session = session or boto3.session.Session()
    return session.client("s3", endpoint_url=opts.endpoint_url, config=config)


def open_store(uri: str, options: object = None, create: bool = True) -> S3Storage:
    """The factory of `s3://bucket/prefix` (trainer/storage/registry.py), with `options` an S3Options
    (None: the defaults); `create` is moot, a prefix exists once something is written under it."""
    if options is not None and not isinstance(options, S3Options):
        raise TypeError(f"s3:// storage takes S3Options, not {type(options).__name__}")
    opts = options or S3Options()
    bucket, _, prefix = uri.partition("://")[2].partition("/")
    return S3Storage(make_s3_client(opts), bucket, prefix, opts)


def map_s3_error(e: BaseException, bucket: str, key: str = "") -> BaseException:
    """Translate a boto3/botocore error into FileNotFoundError, PreconditionFailed, StorageError or
    TransientStorageError."""
    where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    if isinstance(e, S3UploadFailedError) and e.__context__ is not None:
        # boto3 wraps the ClientError of an upload without chaining it as __cause__.
        return map_s3_error(e.__context__, bucket, key)
    if isinstance(e, bce.ClientError):
        err = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return _map_code(
            str(err.get("Code", "")), status, str(err.get("Message", "")), bucket=bucket, where=where
        )
    if isinstance(e, bce.NoCredentialsError | bce.PartialCredentialsError | bce.CredentialRetrievalError):
        return StorageError(f"cannot access {where}: {NO_CREDENTIALS_FIX} ({e})")
    if isinstance(e, TRANSIENT_EXCEPTIONS):
        return TransientStorageError(f"{where}: {_one_line(str(e))}")
    return StorageError(f"{where}: {type(e).__name__}: {_one_line(str(e))}")


def _map_code(code: str, status: int, message: str, *, bucket: str, where: str) -> BaseException:
    if code == "NoSuchBucket":
        return StorageError(f"bucket {bucket!r} does not exist: create it or fix storage: in the job file")
    if code in ("NoSuchKey", "NotFound") or (status == 404 and code == "404"):
        return FileNotFoundError(where)
    if code in PRECONDITION_CODES or status == 412:
        return PreconditionFailed(f"{where}: {code or status}: it changed since it was read")
    if code in CREDENTIAL_FIXES or status == 403:
        fix = CREDENTIAL_FIXES.get(code, CREDENTIAL_FIXES["AccessDenied"])
        return StorageError(f"cannot access {where} ({code or status}): {fix}")
    if code in TRANSIENT_CODES or status >= 500:
        return TransientStorageError(f"{where}: {code or status}, still failing after botocore's retries")
    return StorageError(f"{where}: {code or status}: {_one_line(message)}")


def _one_line(s: str) -> str:
    return " ".join(redact(s).split())  # botocore names the endpoint URL, credentials and all


@contextmanager
def s3_errors(bucket: str, key: str = "") -> Iterator[None]:
    """Re-raise boto3/botocore errors inside the block as spotrun's storage errors."""
    try:
        yield
    except (bce.BotoCoreError, bce.ClientError, S3UploadFailedError, ConnectionError, TimeoutError) as e:
        raise map_s3_error(e, bucket, key) from e


def with_retries(
    fn: Callable[[], T],
    attempts: int = 3,
    base_delay: float = 0.5,
    *,
    max_delay: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call fn, retrying only TransientStorageError with full-jitter exponential backoff."""
    failures = 0
    while True:
        try:
            return fn()
        except TransientStorageError as e:
            failures += 1
            if failures >= attempts:
                raise
            delay = random.uniform(0, min(max_delay, base_delay * 2 ** (failures - 1)))
            log.warning("storage: %s; retry %d/%d in %.2fs", e, failures, attempts - 1, delay)
            sleep(delay)


class S3Storage:
    """Objects under s3://bucket/prefix/. Puts are atomic: a multipart upload shows only once complete."""

    def __init__(
        self,
        client: S3Client,
        bucket: str,
        prefix: str,
        opts: S3Options,
        *,
        attempts: int = 3,
        retry_base_delay: float = 0.5,
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.opts = opts  # what another process opens this storage again with (trainer/saving/writer_proc.py)
        self.root = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.uri = f"s3://{bucket}/{self.root}".rstrip("/")
        self.attempts = attempts
        self.retry_base_delay = retry_base_delay
        chunk = opts.multipart_chunk_mb * 1024 * 1024
        self.transfer = TransferConfig(
            multipart_threshold=chunk, multipart_chunksize=chunk, max_concurrency=opts.max_concurrency
        )
        self.extra_args: dict[str, str] = {}
        if opts.sse:
            self.extra_args["ServerSideEncryption"] = opts.sse
        if opts.kms_key_id:
            self.extra_args["SSEKMSKeyId"] = opts.kms_key_id

    def _key(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise ValueError(f"bad storage key {key!r}: must be non-empty and relative")
        return self.root + key

    def _retry(self, fn: Callable[[], T]) -> T:
        return with_retries(fn, self.attempts, self.retry_base_delay)

    def reopener(self) -> Callable[[], Storage] | None:
        """Its URI and options opened again (a boto3 client cannot cross a process); None for a subclass."""
        from spotrun.trainer.storage import open_storage

        return functools.partial(open_storage, self.uri, self.opts) if type(self) is S3Storage else None

    def put(self, key: str, src: Path) -> None:
        full = self._key(key)

        def upload() -> None:
            with s3_errors(self.bucket, full):
                self.client.upload_file(
                    str(src), self.bucket, full, ExtraArgs=self.extra_args, Config=self.transfer
                )

        self._retry(upload)

    def get(self, key: str, dst: Path) -> None:
        """Ranged GETs of `multipart_chunk_mb`, `max_concurrency` at once, for an object larger than a
        part (boto3's download_file): S3 caps each connection (~50-100 MB/s on AWS), so one stream
        downloads a 1 GB checkpoint file at a fraction of what parallel ranges do (bench/checkpoint.py,
        `download_ratio_capped`). A smaller object is one GET, as `read`."""
        full = self._key(key)
        dst = Path(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{TMP_MARK}{dst.name}.{uuid.uuid4().hex[:8]}")

        def download() -> None:
            try:
                with s3_errors(self.bucket, full):
                    self.client.download_file(self.bucket, full, str(tmp), Config=self.transfer)
            except FileNotFoundError:  # a HEAD's bare 404: a GET says whether the key or bucket is missing
                self._get_object(full)["Body"].close()
                raise

        try:
            self._retry(download)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dst)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def read(self, key: str) -> Iterator[bytes]:
        full = self._key(key)
        first = self._retry(lambda: self._get_object(full))
        return self._iter_body(full, first)

    def _get_object(self, full: str, offset: int = 0, etag: str | None = None) -> GetObjectOutputTypeDef:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full}
        if etag is not None:
            # Resume where the broken stream stopped, and only if the object is still the same one.
            kwargs.update(Range=f"bytes={offset}-", IfMatch=etag)
        with s3_errors(self.bucket, full):
            return self.client.get_object(**kwargs)

    def _iter_body(self, full: str, resp: GetObjectOutputTypeDef) -> Iterator[bytes]:
        etag, offset, failures = resp["ETag"], 0, 0
        while True:
            body = resp["Body"]
            try:
                with s3_errors(self.bucket, full):
                    for chunk in body.iter_chunks(CHUNK):
                        offset += len(chunk)
                        yield chunk
                return
            except TransientStorageError as e:
                failures += 1
                if failures >= self.attempts:
                    raise
                log.warning("storage: read of %s broke at byte %d (%s); resuming", full, offset, e)
                resp = self._retry(functools.partial(self._get_object, full, offset, etag))
            finally:
                body.close()

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        def list_all() -> list[ObjectInfo]:
            out = []
            with s3_errors(self.bucket, self.root + prefix):
                pages = self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=self.root + prefix
                )
                for page in pages:
                    for obj in page.get("Contents", []):
                        key = obj["Key"][len(self.root) :]
                        if key:  # a console "folder" marker for the prefix itself
                            out.append(ObjectInfo(key, obj["Size"], obj["LastModified"].timestamp()))
            return sorted(out, key=lambda o: o.key)

        return self._retry(list_all)

    def delete(self, keys: Sequence[str]) -> None:
        full = [self._key(k) for k in keys]
        for i in range(0, len(full), DELETE_BATCH):
            batch = full[i : i + DELETE_BATCH]
            self._retry(functools.partial(self._delete_batch, batch))

    def _delete_batch(self, batch: Sequence[str]) -> None:
        with s3_errors(self.bucket, batch[0]):
            resp = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
            )
        errors = resp.get("Errors", [])
        if errors:
            # DeleteObjects answers 200 and reports failures per key; surface the first one.
            e = errors[0]
            where = f"s3://{self.bucket}/{e.get('Key', '')}"
            raise _map_code(e.get("Code", ""), 200, e.get("Message", ""), bucket=self.bucket, where=where)

    def local_path(self, key: str) -> None:
        return None

    def staging(self) -> None:
        return None  # an object store: files are written locally and uploaded

    def adopt(self, files: Sequence[tuple[str, Path]]) -> None:
        raise NotImplementedError("S3 has no staging directory: put() the file")

    def checked_size(self, key: str) -> int | None:
        """botocore (>= 1.36) sends a CRC32 of each upload's bytes, computed as it reads the file, and S3
        rejects an upload whose bytes do not match; a HEAD with ChecksumMode shows the object kept one.
        So the size and a checksum are enough: no need to download every byte to compare them again.
        An object without a checksum (an older client wrote it): None, read it back."""
        full = self._key(key)

        def head() -> Any:
            with s3_errors(self.bucket, full):
                return self.client.head_object(Bucket=self.bucket, Key=full, ChecksumMode="ENABLED")

        resp = self._retry(head)
        if not any(k.startswith("Checksum") and k != "ChecksumType" and resp[k] for k in resp):
            return None
        return int(resp["ContentLength"])

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        full = self._key(key)

        def get() -> tuple[bytes, str]:
            resp = self._get_object(full)
            with s3_errors(self.bucket, full), contextlib.closing(resp["Body"]) as body:
                return body.read(), resp["ETag"]

        return self._retry(get)

    def read_stamped(self, key: str) -> Stamped:
        """One GET: the body, its ETag, and its age as S3 tells it (`Date` minus `Last-Modified`, both
        whole seconds by S3's clock)."""
        full = self._key(key)

        def get() -> Stamped:
            resp = self._get_object(full)
            with s3_errors(self.bucket, full), contextlib.closing(resp["Body"]) as body:
                data = body.read()
            date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
            if not date:
                raise StorageError(f"s3://{self.bucket}/{full}: the store sent no Date header")
            age = parsedate_to_datetime(date).timestamp() - resp["LastModified"].timestamp()
            return Stamped(data, resp["ETag"], age)

        return self._retry(get)

    def put_if(self, key: str, data: bytes, *, if_version: str | None) -> str:
        """A conditional PutObject (If-None-Match: * or If-Match: ETag). A retried request whose first
        try did land answers 412: callers re-read and recognise their own write. The first in this
        process on a bucket probes that the store honours the conditions (`require_conditional_puts`)."""
        self.require_conditional_puts()
        return self._put_if(self._key(key), data, if_version)

    def require_conditional_puts(self) -> None:
        """ConfigError unless the store refuses a PutObject whose If-None-Match or If-Match does not
        hold: one that ignores them (some S3-compatible stores do) would let two trainers each win
        the storage lease. Probed once per process and bucket, on a scratch key beside the lease."""
        where = (self.opts.endpoint_url, self.bucket)
        with _PROBE_LOCK:
            if where not in _PROBED:
                _PROBED[where] = self._probe_conditional_puts()
        if (refusal := _PROBED[where]) is not None:
            raise ConfigError(refusal)

    def _probe_conditional_puts(self) -> str | None:
        """Why the store cannot serve as a lease's store; None when it honours both conditions."""
        full = self._key(f"_lease.json.probe-{uuid.uuid4().hex[:12]}")
        endpoint = redact(self.opts.endpoint_url) if self.opts.endpoint_url else "AWS S3"
        fix = "point storage: at a store that supports conditional writes (AWS S3 does)"
        try:
            with contextlib.suppress(PreconditionFailed):  # a retry of a create that had landed
                self._put_if(full, b"1", None)
            for header, if_version in (("If-None-Match: *", None), ("If-Match", f'"{"0" * 32}"')):
                try:
                    self._put_if(full, b"2", if_version)
                except PreconditionFailed:
                    continue
                return (
                    f"storage {self.uri}: the store at {endpoint} ignored {header} on PutObject, so "
                    f"two trainers could both take the storage lease; {fix}"
                )
        finally:  # an error (access denied, the store down) is no answer: raised, probed again next time
            with contextlib.suppress(StorageError, FileNotFoundError):
                self._retry(functools.partial(self._delete_batch, [full]))
        return None

    def _put_if(self, full: str, data: bytes, if_version: str | None) -> str:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full, "Body": data, **self.extra_args}
        kwargs.update({"IfNoneMatch": "*"} if if_version is None else {"IfMatch": if_version})

        def put() -> str:
            try:
                with s3_errors(self.bucket, full):
                    resp = self.client.put_object(**kwargs)
            except FileNotFoundError:  # If-Match on a key that is gone: S3 answers 404 NoSuchKey
                raise PreconditionFailed(f"s3://{self.bucket}/{full}: expected it to exist") from None
            return resp["ETag"]

        return self._retry(put)

    def cleanup_incomplete(self, older_than_s: float) -> int:
        cutoff = time.time() - older_than_s

        def abort_old() -> int:
            n = 0
            with s3_errors(self.bucket, self.root):
                pages = self.client.get_paginator("list_multipart_uploads").paginate(
                    Bucket=self.bucket, Prefix=self.root
                )
                for page in pages:
                    for up in page.get("Uploads", []):
                        if up["Initiated"].timestamp() < cutoff and self._abort(up["Key"], up["UploadId"]):
                            n += 1
            return n

        return self._retry(abort_old)

    def _abort(self, full: str, upload_id: str) -> bool:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except bce.ClientError as e:
            if e.response.get("Error", {}).get("Code") == "NoSuchUpload":  # finished or aborted meanwhile
                return False
            raise
        log.info("storage: aborted incomplete upload s3://%s/%s", self.bucket, full)
        return True
