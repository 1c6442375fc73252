"""Storage backends and the one function that maps a URI to one of them."""

from __future__ import annotations

from pathlib import Path

from trainer.errors import ConfigError
from trainer.spec import S3Options
from trainer.storage.base import (
    ObjectInfo,
    Storage,
    confirm_stored,
    digest_of,
    get_bytes,
    put_bytes,
    sha256_of,
)
from trainer.storage.local import LocalStorage

__all__ = [
    "LocalStorage",
    "ObjectInfo",
    "Storage",
    "check_local_path",
    "check_uri",
    "confirm_stored",
    "digest_of",
    "get_bytes",
    "open_storage",
    "put_bytes",
    "resolve_uri",
    "sha256_of",
]


def check_uri(uri: str) -> str:
    """Return `uri` if it names a backend we have, else raise ValueError saying what forms work."""
    if "://" in uri and not uri.startswith(("file://", "s3://")):
        raise ValueError(f"unsupported scheme in {uri!r}: use a path, file:///dir or s3://bucket/prefix")
    if uri.startswith("s3://") and not uri[len("s3://") :].partition("/")[0]:
        raise ValueError(f"{uri!r} names no bucket: use s3://bucket/prefix")
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if uri.startswith("s3://") and not prefix.strip("/"):  # cleanup would abort the bucket's every upload
        raise ValueError(f"{uri!r} is a whole bucket: give the job a prefix of its own, s3://{bucket}/JOB")
    if not uri.removeprefix("file://"):
        raise ValueError("empty storage path: use a directory, file:///dir or s3://bucket/prefix")
    return uri


def resolve_uri(uri: str, home: Path) -> str:
    """A storage URI made independent of the current directory: a relative path (or `file://` with a
    relative path) is taken under `home` (SPOTRUN_HOME), so the same job file names the same checkpoints
    from any directory; `~` expands; absolute paths and `s3://` are returned as they are."""
    check_uri(uri)
    if uri.startswith("s3://"):
        return uri
    path = Path(uri.removeprefix("file://")).expanduser()
    return str(path if path.is_absolute() else home / path)


def check_local_path(uri: str) -> None:
    """ConfigError, naming the file, when a local storage path or one of its parents is a file: said
    before anything starts rather than by a worker that cannot create it."""
    if uri.startswith("s3://"):
        return
    path = Path(uri.removeprefix("file://")).expanduser()
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"is under {p}, which is a file"
                raise ConfigError(f"storage {path} {where}, not a directory: point storage at a directory")
            return


def open_storage(uri: str, s3: S3Options | None = None, create: bool = True) -> Storage:
    """Map a storage URI to a backend: a path or file:// URI is local, s3://bucket/prefix is S3.

    With `create=False` (readers), a missing local directory is an error instead of being made."""
    try:
        check_uri(uri)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if uri.startswith("s3://"):
        from trainer.storage.s3 import S3Storage, make_s3_client

        bucket, _, prefix = uri[len("s3://") :].partition("/")
        opts = s3 or S3Options()
        return S3Storage(make_s3_client(opts), bucket, prefix, opts)
    path = Path(uri.removeprefix("file://")).expanduser()
    check_local_path(str(path))
    if not create and not path.is_dir():
        raise ConfigError(f"storage directory {path} does not exist; check the storage URI")
    return LocalStorage(path)
