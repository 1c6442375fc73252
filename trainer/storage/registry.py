"""Storage schemes: the one table that says which module opens a URI's scheme, and what its form is.

A new backend is one module with a factory `open_store(uri, options, create) -> Storage` plus one
`register_backend(Backend(...))` line (its options, if any, a section of the job file that `Backend.options`
names; `JobSpec.open_storage` hands them over) (here, in a plugin, or in a test). Nothing else switches on the
scheme: a URI's form is checked here (`check_uri`), whether it is a directory on this machine is asked
here (`is_local`), and whether another process can open a store again is the store's own answer
(`base.Reopenable`). A backend's module is imported on the first open of its scheme, so a local store
never loads boto3; this module imports nothing but the standard library (the job spec imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

LOCAL = "file"  # the scheme of a file:// URI and of a plain path


def no_problem(uri: str) -> str | None:
    """The form check of a scheme that takes whatever follows its `://`."""
    return None


@dataclass(frozen=True)
class Backend:
    """One scheme: `scheme://...` URIs are opened by `module.factory(uri, options, create)`."""

    scheme: str  # what comes before "://"; LOCAL also takes a plain path
    module: str  # imported on the first open of the scheme
    example: str  # a URI of the scheme as messages show it: "s3://bucket/prefix"
    check: Callable[[str], str | None] = no_problem  # what is wrong with a URI's form, without `module`
    factory: str = "open_store"
    local: bool = False  # a directory on this machine: a relative path resolves under SPOTRUN_HOME
    options: str | None = None  # the job file's section holding the scheme's options (`s3:`); None: none


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend | None:
    """Open `backend.scheme` URIs with `backend` from now on; returns the backend it replaced, if any."""
    old = _BACKENDS.get(backend.scheme)
    _BACKENDS[backend.scheme] = backend
    return old


def unregister_backend(scheme: str) -> None:
    """Forget a scheme (a test's own backend, once the test is done)."""
    _BACKENDS.pop(scheme, None)


def scheme_of(uri: str) -> str:
    """`s3` for `s3://...`; LOCAL for a `file://` URI or a plain path."""
    scheme, sep, _ = uri.partition("://")
    return scheme if sep else LOCAL


def backend_for(uri: str) -> Backend | None:
    """The backend registered for the URI's scheme; None when no backend takes it."""
    return _BACKENDS.get(scheme_of(uri))


def is_local(uri: str) -> bool:
    """Whether the URI names a directory on this machine (a path or `file://`), not an object store."""
    backend = backend_for(uri)
    return backend is not None and backend.local


def forms() -> str:
    """The URI forms the registered backends take, for messages: `file:///dir or s3://bucket/prefix`."""
    examples = [b.example for b in _BACKENDS.values()]
    return " or ".join([", ".join(examples[:-1]), examples[-1]] if len(examples) > 1 else examples)


def checked_backend(uri: str) -> Backend:
    """The backend that opens `uri`; ValueError, saying what forms work, when none takes it as it is."""
    backend = backend_for(uri)
    if backend is None:
        raise ValueError(f"unsupported scheme in {uri!r}: use a path, {forms()}")
    problem = backend.check(uri)
    if problem is not None:
        raise ValueError(problem)
    return backend


def check_uri(uri: str) -> str:
    """Return `uri` if a registered backend takes it, else raise ValueError saying what forms work."""
    checked_backend(uri)
    return uri


def local_form(uri: str) -> str | None:
    """The form of a local store's URI: any non-empty path, `file://` or not."""
    return None if uri.removeprefix("file://") else f"empty storage path: use a directory, {forms()}"


def bucket_and_prefix(uri: str) -> str | None:
    """The form of an object store's URI: `scheme://bucket/prefix`, the prefix the job's own (cleaning up
    stale uploads under a whole bucket would abort every upload in it)."""
    scheme, _, rest = uri.partition("://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        return f"{uri!r} names no bucket: use {scheme}://bucket/prefix"
    if not prefix.strip("/"):
        return f"{uri!r} is a whole bucket: give the job a prefix of its own, {scheme}://{bucket}/JOB"
    return None


register_backend(Backend(LOCAL, "spotrun.trainer.storage.local", "file:///dir", check=local_form, local=True))
register_backend(
    Backend("s3", "spotrun.trainer.storage.s3", "s3://bucket/prefix", check=bucket_and_prefix, options="s3")
)
