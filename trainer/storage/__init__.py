"""Storage backends, and the one function that opens a URI with the backend its scheme is registered to
(trainer/storage/registry.py: a new backend is one module plus one registry line)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.storage.base import ObjectInfo as ObjectInfo
from spotrun.trainer.storage.base import Reopenable as Reopenable
from spotrun.trainer.storage.base import Storage
from spotrun.trainer.storage.base import confirm_stored as confirm_stored
from spotrun.trainer.storage.base import digest_of as digest_of
from spotrun.trainer.storage.base import get_bytes as get_bytes
from spotrun.trainer.storage.base import put_bytes as put_bytes
from spotrun.trainer.storage.base import sha256_of as sha256_of
from spotrun.trainer.storage.local import LocalStorage as LocalStorage
from spotrun.trainer.storage.local import check_local_path as check_local_path
from spotrun.trainer.storage.options import S3Options as S3Options
from spotrun.trainer.storage.registry import Backend as Backend
from spotrun.trainer.storage.registry import check_uri, checked_backend, is_local
from spotrun.trainer.storage.registry import register_backend as register_backend
from spotrun.trainer.storage.registry import unregister_backend as unregister_backend


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
