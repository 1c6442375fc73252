"""Storage backends, and the one function that opens a URI with the backend its scheme is registered to
(trainer/storage/registry.py: a new backend is one module plus one registry line)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.storage.base import (
    ObjectInfo,
    Reopenable,
    Storage,
    confirm_stored,
    digest_of,
    get_bytes,
    put_bytes,
    sha256_of,
)
from spotrun.trainer.storage.local import LocalStorage, check_local_path
from spotrun.trainer.storage.options import S3Options
from spotrun.trainer.storage.registry import (
    Backend,
    check_uri,
    checked_backend,
    is_local,
    register_backend,
    unregister_backend,
)

__all__ = [
    "Backend",
    "LocalStorage",
    "ObjectInfo",
    "Reopenable",
    "S3Options",
    "Storage",
    "check_local_path",
    "check_uri",
    "confirm_stored",
    "digest_of",
    "get_bytes",
    "is_local",
    "open_storage",
    "put_bytes",
    "register_backend",
    "resolve_uri",
    "sha256_of",
    "unregister_backend",
]


def resolve_uri(uri: str, home: Path) -> str:
    """A storage URI made independent of the current directory: a relative path (or `file://` with a
    relative path) is taken under `home` (SPOTRUN_HOME), so the same job file names the same checkpoints
    from any directory; `~` expands; absolute paths and object stores' URIs are returned as they are."""
    check_uri(uri)
    if not is_local(uri):
        return uri
    path = Path(uri.removeprefix("file://")).expanduser()
    return str(path if path.is_absolute() else home / path)


def open_storage(uri: str, options: object = None, create: bool = True) -> Storage:
    """Open the store `uri` names with its scheme's backend: a path or file:// URI is a local directory,
    s3://bucket/prefix is S3. `options` are the backend's own (S3Options for s3://; None: defaults).

    With `create=False` (readers), a missing local directory is an error instead of being made."""
    try:
        backend = checked_backend(uri)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    factory: Callable[[str, object, bool], Storage] = getattr(
        importlib.import_module(backend.module), backend.factory
    )
    return factory(uri, options, create)
