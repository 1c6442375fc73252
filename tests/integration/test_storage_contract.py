"""One contract for every storage backend (a local directory, S3 on moto, and an in-memory store the
tests add through the registry: one module and one line), then the registry, then S3's failure modes."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, ReadTimeoutError

from spotrun.trainer.errors import ConfigError, PreconditionFailed, StorageError, TransientStorageError
from spotrun.trainer.storage import (
    Backend,
    LocalStorage,
    Storage,
    check_uri,
    get_bytes,
    open_storage,
    put_bytes,
    register_backend,
    sha256_of,
    unregister_backend,
)
from spotrun.trainer.storage.local import TMP_MARK
from spotrun.trainer.storage.options import S3Options
from spotrun.trainer.storage.s3 import S3Storage, make_s3_client, map_s3_error, with_retries
from tests.fakes.memory_store import MemoryStorage
from tests.servers import Fault, FaultProxy

MB = 1024 * 1024
PREFIX = "runs/job-1"


@dataclass
class Contract:
    storage: Storage
    make_partial: Callable[[str], None]  # leave an unfinished write behind under this key
    partials: Callable[[], int]  # how many unfinished writes exist
    partial_ages_real: bool  # moto reports every multipart upload as initiated on 2010-11-10
    vouches: bool = False  # checks the bytes on receipt (S3's checksums): `checked_size` answers


@pytest.fixture
def memory_scheme() -> Iterator[None]:
    """`memory://NAME` opens an in-memory store (tests/fakes/memory_store.py) while a test runs."""
    register_backend(Backend("memory", "tests.fakes.memory_store", "memory://name"))
    yield
    unregister_backend("memory")


def s3_storage(
    endpoint: str,
    bucket: str,
    session: boto3.session.Session | None,
    total_attempts: int = 5,
    **opts: object,
) -> S3Storage:
    o = S3Options(endpoint_url=endpoint, multipart_chunk_mb=5, max_concurrency=4, **opts)  # type: ignore[arg-type]
    client = make_s3_client(o, session=session, total_attempts=total_attempts)
    return S3Storage(client, bucket, PREFIX, o, retry_base_delay=0.01)


@pytest.fixture(params=["local", "s3", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Contract:
    if request.param == "memory":
        request.getfixturevalue("memory_scheme")
        memory = open_storage(f"memory://{tmp_path.name}")
        assert isinstance(memory, MemoryStorage)
        return Contract(memory, memory.begin_write, lambda: len(memory.bucket.pending), True)
    if request.param == "local":
        root = tmp_path / "store"
        local = LocalStorage(root)

        def make_local_partial(key: str) -> None:
            p = root / key
            p.parent.mkdir(parents=True, exist_ok=True)
            (p.parent / f"{TMP_MARK}{p.name}.0123abcd").write_bytes(b"half a checkpoint")

        return Contract(local, make_local_partial, lambda: len(list(root.rglob(f"{TMP_MARK}*"))), True)

    endpoint, bucket = request.getfixturevalue("s3_bucket")
    session = request.getfixturevalue("boto_session")
    client = session.client("s3", endpoint_url=endpoint)

    def make_s3_partial(key: str) -> None:
        up = client.create_multipart_upload(Bucket=bucket, Key=f"{PREFIX}/{key}")
        client.upload_part(
            Bucket=bucket, Key=f"{PREFIX}/{key}", UploadId=up["UploadId"], PartNumber=1, Body=b"x"
        )

    def s3_partials() -> int:
        return len(client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))

    return Contract(s3_storage(endpoint, bucket, session), make_s3_partial, s3_partials, False, vouches=True)


def write_random(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the contract ---------------------------------------------------------------------------------


def test_satisfies_protocol(backend: Contract) -> None:
    assert isinstance(backend.storage, Storage)


def test_put_get_round_trip(backend: Contract, tmp_path: Path) -> None:
    src = write_random(tmp_path / "src.bin", 300_000)
    backend.storage.put("step-10/model.safetensors", src)
    dst = tmp_path / "out" / "model.safetensors"
    backend.storage.get("step-10/model.safetensors", dst)
    assert sha(dst) == sha(src)
    assert sha256_of(backend.storage, "step-10/model.safetensors") == (sha(src), 300_000)
    assert os.listdir(dst.parent) == ["model.safetensors"]  # no temp file left beside it


def test_put_replaces_whole_object(backend: Contract, tmp_path: Path) -> None:
    a, b = write_random(tmp_path / "a", 200_000), write_random(tmp_path / "b", 1000)
    backend.storage.put("latest", a)
    backend.storage.put("latest", b)
    assert get_bytes(backend.storage, "latest") == b.read_bytes()
    assert [(o.key, o.size) for o in backend.storage.list()] == [("latest", 1000)]
    dst = tmp_path / "dst"
    dst.write_bytes(b"stale")
    backend.storage.get("latest", dst)
    assert dst.read_bytes() == b.read_bytes()


def test_read_streams_in_chunks(backend: Contract, tmp_path: Path) -> None:
    src = write_random(tmp_path / "src", 5 * MB + 17)
    backend.storage.put("big", src)
    stream = backend.storage.read("big")
    assert isinstance(stream, Iterator)
    chunks = list(stream)
    assert len(chunks) > 1
    assert b"".join(chunks) == src.read_bytes()


def test_list_prefix_sizes_and_times(backend: Contract) -> None:
    t0 = time.time()
    for key, n in [("a/1", 1), ("a/2", 2), ("b/1", 3), ("ab", 4)]:
        put_bytes(backend.storage, key, b"x" * n)
    everything = backend.storage.list()
    assert [(o.key, o.size) for o in everything] == [("a/1", 1), ("a/2", 2), ("ab", 4), ("b/1", 3)]
    assert [o.key for o in backend.storage.list("a/")] == ["a/1", "a/2"]
    assert [o.key for o in backend.storage.list("a")] == ["a/1", "a/2", "ab"]
    assert backend.storage.list("zzz") == []
    # S3 keeps LastModified to the second.
    assert all(t0 - 2 <= o.mtime <= time.time() + 2 for o in everything)


def test_delete_ignores_missing_keys(backend: Contract) -> None:
    for key in ("s1/a", "s1/b", "s2/a"):
        put_bytes(backend.storage, key, b"data")
    backend.storage.delete(["s1/a", "s1/b", "never/existed"])
    backend.storage.delete([])
    assert [o.key for o in backend.storage.list()] == ["s2/a"]


def test_missing_key_is_file_not_found(backend: Contract, tmp_path: Path) -> None:
    dst = tmp_path / "dl" / "x"
    with pytest.raises(FileNotFoundError):
        backend.storage.get("nope", dst)
    with pytest.raises(FileNotFoundError):
        backend.storage.read("nope")
    with pytest.raises(FileNotFoundError):
        sha256_of(backend.storage, "nope")
    assert not dst.exists()
    assert not (dst.parent.exists() and os.listdir(dst.parent))


def test_large_file_round_trip(backend: Contract, tmp_path: Path) -> None:
    src = write_random(tmp_path / "big", 12 * MB + 123)  # three 5 MB parts on S3
    backend.storage.put("ckpt/big.bin", src)
    dst = tmp_path / "big.out"
    backend.storage.get("ckpt/big.bin", dst)
    assert sha(dst) == sha(src)


def test_cleanup_incomplete_removes_old_partials(backend: Contract) -> None:
    put_bytes(backend.storage, "step-1/done", b"ok")
    backend.make_partial("step-2/model.bin")
    assert backend.partials() == 1
    if backend.partial_ages_real:
        assert backend.storage.cleanup_incomplete(older_than_s=3600) == 0  # too young
        time.sleep(0.05)
    assert backend.storage.cleanup_incomplete(older_than_s=0) == 1
    assert backend.partials() == 0
    assert backend.storage.cleanup_incomplete(older_than_s=0) == 0
    assert [o.key for o in backend.storage.list()] == ["step-1/done"]


def test_bytes_helpers(backend: Contract) -> None:
    put_bytes(backend.storage, "meta/manifest.json", b'{"step": 3}')
    assert get_bytes(backend.storage, "meta/manifest.json") == b'{"step": 3}'
    assert sha256_of(backend.storage, "meta/manifest.json") == (
        hashlib.sha256(b'{"step": 3}').hexdigest(),
        11,
    )
    put_bytes(backend.storage, "empty", b"")
    assert get_bytes(backend.storage, "empty") == b""


# -- conditional writes (the storage lease) --------------------------------------------------------


def test_put_if_absent_creates_once(backend: Contract) -> None:
    store = backend.storage
    v1 = store.put_if("_lease.json", b"first", if_version=None)
    with pytest.raises(PreconditionFailed):
        store.put_if("_lease.json", b"second", if_version=None)
    assert store.read_versioned("_lease.json") == (b"first", v1)
    assert [o.key for o in store.list()] == ["_lease.json"]  # no lock or temp file shows


def test_put_if_version_is_compare_and_swap(backend: Contract) -> None:
    store = backend.storage
    v1 = store.put_if("_lease.json", b"one", if_version=None)
    v2 = store.put_if("_lease.json", b"two", if_version=v1)
    assert v2 != v1
    with pytest.raises(PreconditionFailed):
        store.put_if("_lease.json", b"stale", if_version=v1)
    assert store.read_versioned("_lease.json") == (b"two", v2)
    put_bytes(store, "_lease.json", b"overwritten")  # an unconditional put changes the version too
    with pytest.raises(PreconditionFailed):
        store.put_if("_lease.json", b"three", if_version=v2)


def test_put_if_version_on_a_missing_key_fails(backend: Contract) -> None:
    with pytest.raises(PreconditionFailed):
        backend.storage.put_if("nothing-here", b"x", if_version="0123abcd")
    with pytest.raises(FileNotFoundError):
        backend.storage.read_versioned("nothing-here")
    assert backend.storage.list() == []


def test_read_stamped_gives_the_age_by_the_stores_clock(backend: Contract) -> None:
    store = backend.storage
    v1 = store.put_if("_lease.json", b"one", if_version=None)
    stamped = store.read_stamped("_lease.json")
    assert (stamped.data, stamped.version) == (b"one", v1)
    assert -1.0 <= stamped.age_s <= 2.0  # just written; S3's dates are whole seconds
    with pytest.raises(FileNotFoundError):
        store.read_stamped("nothing-here")
    assert [o.key for o in store.list()] == ["_lease.json"]  # reading the clock left nothing to list


def test_put_if_one_of_racing_writers_wins(backend: Contract) -> None:
    if isinstance(backend.storage, S3Storage):
        pytest.skip("moto checks If-Match and then writes without a lock (AWS S3 is atomic): it races")
    store = backend.storage
    v0 = store.put_if("_lease.json", b"0", if_version=None)

    def swap(i: int) -> bool:
        try:
            store.put_if("_lease.json", str(i).encode(), if_version=v0)
        except PreconditionFailed:
            return False
        return True

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(swap, range(1, 9)))
    assert won.count(True) == 1
    assert store.read_versioned("_lease.json")[0] == str(won.index(True) + 1).encode()


# -- the registry --------------------------------------------------------------------------------


def test_a_backend_is_one_module_and_one_registry_line(memory_scheme: None, tmp_path: Path) -> None:
    """Through the registry: a name opened again sees the same objects, a reader's missing store is one
    line, messages list the new form; another process cannot open it, so its checkpoints stay in a
    thread (the store says so: `reopener`)."""
    from spotrun.trainer.saving.writer_proc import opener_of

    store = open_storage("memory://registry")
    put_bytes(store, "k", b"v")
    assert get_bytes(open_storage("memory://registry", create=False), "k") == b"v"
    with pytest.raises(ConfigError, match="no in-memory store"):
        open_storage("memory://never", create=False)
    with pytest.raises(ValueError, match=r"use a path, file:///dir, s3://bucket/prefix or memory://name$"):
        check_uri("gs://b/p")
    assert opener_of(store) is None and opener_of(LocalStorage(tmp_path)) is not None


def test_a_scheme_without_its_line_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        open_storage("memory://x")
    assert str(refused.value) == (
        "unsupported scheme in 'memory://x': use a path, file:///dir or s3://bucket/prefix"
    )


def test_a_local_store_loads_no_other_backend(tmp_path: Path) -> None:
    """Backends are imported on their scheme's first open: a directory never loads boto3."""
    code = (
        "import sys; from spotrun.trainer.storage import open_storage; open_storage(sys.argv[1]); "
        "print(sorted(m for m in sys.modules if m.startswith(('boto', 'spotrun.trainer.storage.s3'))))"
    )
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "store")], capture_output=True, text=True, cwd=repo
    )
    assert (run.returncode, run.stdout.strip()) == (0, "[]"), run.stderr


# -- S3 only --------------------------------------------------------------------------------------

Session = boto3.session.Session


def test_s3_large_put_is_multipart(s3_bucket: tuple[str, str], boto_session: Session, tmp_path: Path) -> None:
    endpoint, bucket = s3_bucket
    storage = s3_storage(endpoint, bucket, boto_session)
    storage.put("big", write_random(tmp_path / "big", 12 * MB))
    head = boto_session.client("s3", endpoint_url=endpoint).head_object(Bucket=bucket, Key=f"{PREFIX}/big")
    assert head["ETag"].strip('"').endswith("-3")


def test_s3_keys_stay_under_prefix(s3_bucket: tuple[str, str], boto_session: Session) -> None:
    endpoint, bucket = s3_bucket
    client = boto_session.client("s3", endpoint_url=endpoint)
    client.put_object(Bucket=bucket, Key="runs/job-10/x", Body=b"other job")
    client.create_multipart_upload(Bucket=bucket, Key="elsewhere/partial")
    storage = s3_storage(endpoint, bucket, boto_session)
    put_bytes(storage, "x", b"mine")
    assert storage.uri == f"s3://{bucket}/{PREFIX}"
    assert [o.key for o in storage.list()] == ["x"]
    assert client.get_object(Bucket=bucket, Key=f"{PREFIX}/x")["Body"].read() == b"mine"
    assert storage.cleanup_incomplete(older_than_s=0) == 0  # not ours to abort


@pytest.mark.parametrize("kind", ["503", "reset"])
@pytest.mark.parametrize("total_attempts", [5, 1], ids=["botocore-retries", "spotrun-retries"])
def test_s3_recovers_from_injected_faults(
    s3_bucket: tuple[str, str],
    boto_session: Session,
    fault_proxy: FaultProxy,
    tmp_path: Path,
    kind: Fault,
    total_attempts: int,
) -> None:
    storage = s3_storage(fault_proxy.endpoint, s3_bucket[1], boto_session, total_attempts)
    src = write_random(tmp_path / "src", 100_000)
    fault_proxy.fail_next(2, kind)
    storage.put("k", src)
    assert fault_proxy.injected == 2
    fault_proxy.fail_next(2, kind)
    storage.get("k", tmp_path / "dst")
    assert fault_proxy.injected == 4
    assert sha(tmp_path / "dst") == sha(src)


def test_s3_resumes_a_download_cut_short(
    s3_bucket: tuple[str, str], boto_session: Session, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    storage = s3_storage(fault_proxy.endpoint, s3_bucket[1], boto_session)
    src = write_random(tmp_path / "src", 3 * MB)
    storage.put("k", src)
    fault_proxy.fail_next(1, "cut")
    before = fault_proxy.requests
    storage.get("k", tmp_path / "dst")
    assert fault_proxy.injected == 1
    assert fault_proxy.requests - before == 2  # the cut GET, then one ranged GET for the rest
    assert sha(tmp_path / "dst") == sha(src)


def test_s3_persistent_503_is_transient(
    s3_bucket: tuple[str, str], boto_session: Session, fault_proxy: FaultProxy
) -> None:
    storage = s3_storage(fault_proxy.endpoint, s3_bucket[1], boto_session, total_attempts=2)
    fault_proxy.fail_next(1000, "503")
    with pytest.raises(TransientStorageError, match="SlowDown"):
        storage.list()
    assert fault_proxy.injected == 2 * 3  # botocore's 2 attempts, inside spotrun's 3


def test_s3_missing_bucket_names_it(moto_server: str, boto_session: Session, tmp_path: Path) -> None:
    storage = s3_storage(moto_server, "spotrun-no-such-bucket", boto_session)
    src = write_random(tmp_path / "src", 10)
    for op in (lambda: storage.put("k", src), lambda: storage.get("k", tmp_path / "d"), storage.list):
        with pytest.raises(StorageError, match=r"'spotrun-no-such-bucket'.*create it") as info:
            op()
        assert not isinstance(info.value, TransientStorageError)
        assert "\n" not in str(info.value)


def test_s3_no_credentials(s3_bucket: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint, bucket = s3_bucket
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/spotrun-test-aws-credentials")
    storage = s3_storage(endpoint, bucket, session=None)  # a fresh session finds no credentials
    with pytest.raises(StorageError, match="no AWS credentials") as info:
        storage.list()
    assert not isinstance(info.value, TransientStorageError)


def client_error(code: str, status: int) -> ClientError:
    response: dict[str, Any] = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "Op")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "code,status,words",
    [
        ("InvalidAccessKeyId", 403, "AWS_ACCESS_KEY_ID"),
        ("SignatureDoesNotMatch", 403, "AWS_SECRET_ACCESS_KEY"),
        ("ExpiredToken", 400, "expired"),
        ("AccessDenied", 403, "s3:GetObject"),
        ("403", 403, "access denied"),
    ],
)
def test_credential_errors_say_what_to_fix(code: str, status: int, words: str) -> None:
    mapped = map_s3_error(client_error(code, status), "bkt", "k")
    assert type(mapped) is StorageError
    assert words in str(mapped) and "s3://bkt/k" in str(mapped)


@pytest.mark.parametrize(
    "error,expected",
    [
        (client_error("NoSuchKey", 404), FileNotFoundError),
        (client_error("404", 404), FileNotFoundError),
        (client_error("SlowDown", 503), TransientStorageError),
        (client_error("RequestLimitExceeded", 400), TransientStorageError),
        (client_error("InternalError", 500), TransientStorageError),
        (client_error("InvalidArgument", 400), StorageError),
        (client_error("PreconditionFailed", 412), PreconditionFailed),
        (client_error("ConditionalRequestConflict", 409), PreconditionFailed),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), TransientStorageError),
        (ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), TransientStorageError),
        (ConnectionResetError(104, "Connection reset by peer"), TransientStorageError),
        (NoCredentialsError(), StorageError),
    ],
)
def test_error_mapping_table(error: Exception, expected: type[BaseException]) -> None:
    assert type(map_s3_error(error, "bkt", "k")) is expected


def test_with_retries_retries_only_transient() -> None:
    calls: list[int] = []
    sleeps: list[float] = []

    def flaky() -> str:
        calls.append(0)
        if len(calls) < 3:
            raise TransientStorageError("slow down")
        return "ok"

    assert with_retries(flaky, attempts=3, base_delay=0, sleep=sleeps.append) == "ok"
    assert (len(calls), len(sleeps)) == (3, 2)

    def denied() -> None:
        calls.append(0)
        raise StorageError("denied")

    calls.clear()
    with pytest.raises(StorageError):
        with_retries(denied, attempts=5, base_delay=0)
    assert len(calls) == 1

    calls.clear()
    with pytest.raises(TransientStorageError):
        with_retries(lambda: flaky() and flaky() and flaky(), attempts=2, base_delay=0, sleep=sleeps.append)


@pytest.mark.parametrize("sse,key_id", [("AES256", None), ("aws:kms", "alias/spotrun-test")])
def test_s3_server_side_encryption(
    s3_bucket: tuple[str, str], boto_session: Session, sse: str, key_id: str | None
) -> None:
    endpoint, bucket = s3_bucket
    storage = s3_storage(endpoint, bucket, boto_session, sse=sse, kms_key_id=key_id)
    put_bytes(storage, "enc", b"secret weights")
    head = boto_session.client("s3", endpoint_url=endpoint).head_object(Bucket=bucket, Key=f"{PREFIX}/enc")
    assert head["ServerSideEncryption"] == sse
    assert head.get("SSEKMSKeyId") == key_id


def test_open_storage_maps_s3_uri(s3_bucket: tuple[str, str]) -> None:
    endpoint, bucket = s3_bucket
    storage = open_storage(f"s3://{bucket}/{PREFIX}", S3Options(endpoint_url=endpoint))
    assert isinstance(storage, S3Storage)
    assert storage.uri == f"s3://{bucket}/{PREFIX}"
    put_bytes(storage, "via-uri", b"1")
    assert get_bytes(storage, "via-uri") == b"1"


def test_confirm_stored_checks_what_was_written(backend: Contract, tmp_path: Path) -> None:
    """After a put, `confirm_stored` accepts the object by its size and the backend's check on receipt
    (S3: a checksum S3 verified; a HEAD, no download) or its digest read back (local); a wrong size or
    digest is named; a missing object is FileNotFoundError."""
    from spotrun.trainer.storage import confirm_stored
    from spotrun.trainer.storage.digests import digest_file

    for key, size in (("ckpt/small.bin", 1000), ("ckpt/big.bin", 12 * MB + 123)):  # single put, multipart
        src = write_random(tmp_path / key.replace("/", "-"), size)
        backend.storage.put(key, src)
        digest = digest_file(src)
        assert confirm_stored(backend.storage, key, size, digest=digest) is None
        assert (
            confirm_stored(backend.storage, key, size + 1, digest=digest)
            == f"stored size {size} != {size + 1}"
        )
    assert backend.storage.checked_size("ckpt/small.bin") == (1000 if backend.vouches else None)
    if not backend.vouches:  # nothing vouches for a local copy: its digest is compared
        assert (
            confirm_stored(backend.storage, "ckpt/small.bin", 1000, digest="0" * 32)
            == "stored xxh3_128 differs"
        )
    with pytest.raises(FileNotFoundError):
        backend.storage.checked_size("ckpt/nope.bin")


def test_staging_and_adopt(backend: Contract, tmp_path: Path) -> None:
    """A directory store takes a checkpoint written in place (renamed, not copied), each writer in a
    new directory of its own; staging is never listed, and a killed writer's leftovers there go with
    cleanup_incomplete. An object store has no staging: its files are uploaded with put."""
    staging = backend.storage.staging()
    if staging is None:
        assert not isinstance(backend.storage, LocalStorage) and backend.storage.local_path("x") is None
        return
    other = backend.storage.staging()
    assert other != staging and not any(staging.iterdir()) and not any(other.iterdir())
    src = write_random(staging / "step_7" / "model.bin", 1000)
    inode = src.stat().st_ino
    rng = write_random(staging / "step_7" / "rng.pt", 10)
    backend.storage.adopt([("ckpt/step_7/model.bin", src), ("ckpt/step_7/rng.pt", rng)])  # one call
    stored = backend.storage.local_path("ckpt/step_7/model.bin")
    assert stored is not None and not src.exists() and stored.stat().st_ino == inode  # no second copy
    shutil.rmtree(staging)  # as the writer does once it has adopted its files
    assert [o.key for o in backend.storage.list()] == ["ckpt/step_7/model.bin", "ckpt/step_7/rng.pt"]
    backend.storage.delete(["ckpt/step_7/rng.pt"])
    with pytest.raises(ValueError, match="not under"):
        backend.storage.adopt([("ckpt/x.bin", write_random(tmp_path / "elsewhere.bin", 10))])

    write_random(other / "step_8" / "model.bin", 10)  # a writer killed before it adopted its files
    assert [o.key for o in backend.storage.list()] == ["ckpt/step_7/model.bin"]
    assert backend.storage.cleanup_incomplete(older_than_s=3600) == 0  # too young
    time.sleep(0.05)
    assert backend.storage.cleanup_incomplete(older_than_s=0) == 1
    assert not other.exists() and stored.is_file()


def test_cleanup_incomplete_while_other_writers_come_and_go(tmp_path: Path) -> None:
    """Retention on one rank walks the store while the other ranks remove their staging directories
    and retention deletes step directories: a directory gone mid-walk is passed over, not an error
    (it failed a 2-rank FSDP2 save 1 time in 7 under load)."""
    import threading

    storage = LocalStorage(tmp_path / "store")
    put_bytes(storage, "ckpt/keep/done", b"ok")
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            i = (i + 1) % 5
            for d in (storage.staging(), tmp_path / "store" / "ckpt" / f"step_{i}" / "a" / "b"):
                assert d is not None
                d.mkdir(parents=True, exist_ok=True)
                (d / "f").write_bytes(b"x")
                shutil.rmtree(d.parent if d.name == "b" else d)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(300):
            storage.cleanup_incomplete(older_than_s=3600)
    finally:
        stop.set()
        t.join()
    assert [o.key for o in storage.list()] == ["ckpt/keep/done"]
