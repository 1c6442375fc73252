"""Storage backends and the one function that maps a URI to one of them."""

from __future__ import annotations

from trainer.spec import S3Options
from trainer.storage.base import ObjectInfo, Storage, get_bytes, put_bytes, sha256_of
from trainer.storage.local import LocalStorage

__all__ = ["LocalStorage", "ObjectInfo", "Storage", "get_bytes", "open_storage", "put_bytes", "sha256_of"]


def open_storage(uri: str, s3: S3Options | None = None) -> Storage:
    """Map a storage URI to a backend: a path or file:// URI is local, s3://bucket/prefix is S3."""
    if uri.startswith("s3://"):
        from trainer.storage.s3 import S3Storage, make_s3_client

        bucket, _, prefix = uri[len("s3://") :].partition("/")
        opts = s3 or S3Options()
        return S3Storage(make_s3_client(opts), bucket, prefix, opts)
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    return LocalStorage(uri)
