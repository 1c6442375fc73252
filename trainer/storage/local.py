"""Local-directory backend: also the stand-in for a network volume in tests and benchmarks."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

from spotrun.trainer.errors import ConfigError, PreconditionFailed, StorageError, TransientStorageError
from spotrun.trainer.storage.base import CHUNK, ObjectInfo, Stamped, Storage
from spotrun.trainer.storage.locks import flock_waiting
from spotrun.trainer.storage.registry import is_local

TMP_MARK = ".spotrun-tmp-"
# Under the root: checkpoints written in place by the writer, then renamed into their keys (adopt).
STAGING = f"{TMP_MARK}staging"
# `<key>.spotrun-lock`: the flock that makes put_if's compare and replace one step. Never deleted
# (unlinking a lock file someone holds would let a third writer lock a fresh inode), never listed.
LOCK_SUFFIX = ".spotrun-lock"
LOCK_WAIT_S = 30.0
# Errors no retry fixes: the user must remount, grant or free space first.
UNWRITABLE = {
    errno.EROFS: "the file system is read-only; remount it writable or choose another storage",
    errno.EACCES: "permission denied; grant this user write access or choose another storage",
    errno.EPERM: "operation not permitted; grant this user write access or choose another storage",
    errno.ENOSPC: "no space left on the device; free space or choose another storage",
    errno.EDQUOT: "disk quota exceeded; free space or choose another storage",
}


def unwritable(e: OSError, what: str) -> StorageError | None:
    """A store that refuses writes (read-only, permissions, full) as a StorageError: not retried, one
    line naming the store and the fix; None for other OSErrors (I/O errors), which pass as they are.
    Also for writes into a `staging()` directory, which are not LocalStorage's own."""
    return StorageError(f"{what}: {UNWRITABLE[e.errno]}") if e.errno in UNWRITABLE else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_durable(src: Path, dst: Path) -> None:
    """Copy to a temp name beside dst, fsync, rename, fsync the directory: dst is whole or absent."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{TMP_MARK}{dst.name}.{uuid.uuid4().hex[:8]}")
    try:
        shutil.copyfile(src, tmp)  # kernel-side copy (sendfile): no user-space buffer, little CPU
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dst.parent)


def check_local_path(uri: str) -> None:
    """ConfigError, naming the file, when a local storage path or one of its parents is a file: said
    before anything starts rather than by a worker that cannot create it."""
    if not is_local(uri):
        return
    path = Path(uri.removeprefix("file://")).expanduser()
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"is under {p}, which is a file"
                raise ConfigError(f"storage {path} {where}, not a directory: point storage at a directory")
            return


def open_store(uri: str, options: object = None, create: bool = True) -> LocalStorage:
    """The factory of the local scheme (trainer/storage/registry.py): a path or `file://` URI; no options.

    With `create=False` (readers), a missing directory is an error instead of being made."""
    path = Path(uri.removeprefix("file://")).expanduser()
    check_local_path(str(path))
    if not create and not path.is_dir():
        raise ConfigError(f"storage directory {path} does not exist; check the storage URI")
    return LocalStorage(path)


class LocalStorage:
    """Objects are files under `root`; keys map to relative paths."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self.uri = str(self.root)
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"storage {self.root} is a file, not a directory: point storage at a directory")
        try:
            _mkdirs(self.root)
        except (FileExistsError, NotADirectoryError):
            raise ConfigError(
                f"storage {self.root}: a part of the path is a file, not a directory; fix storage"
            ) from None
        except OSError as e:
            raise StorageError(f"cannot create storage directory {self.root}: {e.strerror}") from None
        # What the store creates takes the root's mode, not the process's umask (077 under SPOTRUN_HOME):
        # a team's shared directory stays shared, a private one stays private.
        self._dir_mode = self.root.stat().st_mode & 0o2777
        self._file_mode = self._dir_mode & 0o666

    @contextlib.contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            mapped = unwritable(e, f"cannot {what} in storage {self.root}")
            if mapped is None:
                raise
            raise mapped from e

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if self.root not in p.parents:
            raise ValueError(f"key {key!r} escapes the storage root")
        return p

    def put(self, key: str, src: Path) -> None:
        with self._writing(f"write {key}"):
            dst = self._path(key)
            _mkdirs(dst.parent, self._dir_mode)
            copy_durable(Path(src), dst)
            dst.chmod(self._file_mode)

    def local_path(self, key: str) -> Path:
        return self._path(key)

    def reopener(self) -> Callable[[], Storage] | None:
        """`LocalStorage(root)` again; None for a subclass (a test double injecting faults)."""
        return partial(LocalStorage, self.root) if type(self) is LocalStorage else None

    def staging(self) -> Path:
        """A new directory for one writer, on this directory's own file system, so that `adopt` is a
        rename: at 1 GB, the copy from a local cache into the store was 3.0 s of a 10.3 s save
        (measured), on the cores training uses. Unique, so that a writer that lost its lease (a zombie
        on another host of a shared volume) never touches another's files before their adopt."""
        d = self.root / STAGING / uuid.uuid4().hex[:16]
        with self._writing("create a staging directory"):
            _mkdirs(d.parent, self._dir_mode)
            d.mkdir()
            d.chmod(self._dir_mode)
        return d

    def adopt(self, files: Sequence[tuple[str, Path]]) -> None:
        """Rename every file, then fsync each directory that changed once: a directory fsync after
        each of a 1 GB checkpoint's six files cost 0.7-1.0 s of wall time on this VM's disk."""
        moves = []
        for key, src in files:
            src = Path(src).resolve()
            if self.root / STAGING not in src.parents:
                raise ValueError(f"{src} is not under {self.root / STAGING}: put() copies other files")
            moves.append((self._path(key), src))
        if not moves:
            return
        changed: set[Path] = set()
        with self._writing(f"write {files[0][0]}"):
            for dst, src in moves:
                if not dst.parent.is_dir():
                    _mkdirs(dst.parent, self._dir_mode)
                    changed.update(p for p in dst.parent.parents if p.is_relative_to(self.root))
                src.chmod(self._file_mode)  # the writer made it under the process's umask
                os.replace(src, dst)
                changed.add(dst.parent)
            for d in sorted(changed, key=lambda p: len(p.parts), reverse=True):  # entries, then their dirs
                fsync_dir(d)

    def get(self, key: str, dst: Path) -> None:
        p = self._path(key)
        if not p.is_file():
            raise FileNotFoundError(f"{self.uri}/{key}")
        copy_durable(p, Path(dst))

    def read(self, key: str) -> Iterator[bytes]:
        p = self._path(key)
        if not p.is_file():
            raise FileNotFoundError(f"{self.uri}/{key}")
        return _iter_file(p)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Walks only the directory the prefix names, and at its top only the entries the prefix's last
        part begins: listing `metrics/` or the step directories never walks the rest of the store."""
        head, _, start = prefix.rpartition("/")
        base = self._path(head) if head else self.root
        if not base.is_dir():
            return []
        out = []
        for dirpath, dirs, files in os.walk(base):
            top = dirpath == str(base)
            dirs[:] = [d for d in dirs if not d.startswith(TMP_MARK) and (not top or d.startswith(start))]
            for f in files:
                if f.startswith(TMP_MARK) or f.endswith(LOCK_SUFFIX) or (top and not f.startswith(start)):
                    continue
                full = Path(dirpath) / f
                try:
                    st = full.stat()
                except FileNotFoundError:  # deleted while listing
                    continue
                out.append(ObjectInfo(full.relative_to(self.root).as_posix(), st.st_size, st.st_mtime))
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: Sequence[str]) -> None:
        with self._writing("delete"):
            self._delete(keys)

    def _delete(self, keys: Sequence[str]) -> None:
        parents = set()
        for key in keys:
            p = self._path(key)
            p.unlink(missing_ok=True)
            parents.add(p.parent)
        for d in sorted(parents, key=lambda q: len(q.parts), reverse=True):
            _remove_empty_dirs(d, self.root)

    def cleanup_incomplete(self, older_than_s: float) -> int:
        cutoff = time.time() - older_than_s
        n = 0
        for tmp in self._partials():
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
                    n += 1
            except FileNotFoundError:
                continue
        staging = self.root / STAGING
        for d in staging.iterdir() if staging.is_dir() else ():  # a writer killed before it adopted them
            try:
                if d.stat().st_mtime < cutoff:
                    shutil.rmtree(d) if d.is_dir() else d.unlink()
                    n += 1
            except FileNotFoundError:
                continue
        return n

    def _partials(self) -> Iterator[Path]:
        """Files a killed `put` left, staging excepted (taken whole below). os.walk, not rglob: ranks
        remove their staging directories while another rank's retention walks the store, and rglob
        raised FileNotFoundError on a directory gone mid-walk (1 save in 7 of a 2-rank FSDP2 run on a
        loaded 2-core VM); os.walk passes over it."""
        for parent, dirs, files in os.walk(self.root):
            if parent == str(self.root) and STAGING in dirs:
                dirs.remove(STAGING)
            for name in files:
                if name.startswith(TMP_MARK):
                    yield Path(parent, name)

    def checked_size(self, key: str) -> int | None:
        """None: a local copy is confirmed by reading it back (at xxh3 speed, ~0.1 s per GB)."""
        if not self._path(key).is_file():
            raise FileNotFoundError(f"{self.uri}/{key}")
        return None

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        p = self._path(key)
        try:
            data = p.read_bytes()  # a whole old or new file: writers replace it with a rename
        except (FileNotFoundError, IsADirectoryError):
            raise FileNotFoundError(f"{self.uri}/{key}") from None
        return data, _version(data)

    def read_stamped(self, key: str) -> Stamped:
        """The file's mtime against a touched file's: both set by the file system's clock (a network
        volume's server), never by this machine's idea of the time."""
        p = self._path(key)
        try:
            with open(p, "rb") as f:  # the mtime of the inode read: a rename may replace the name meanwhile
                data, written = f.read(), os.fstat(f.fileno()).st_mtime
        except (FileNotFoundError, IsADirectoryError):
            raise FileNotFoundError(f"{self.uri}/{key}") from None
        with self._writing(f"read the clock of {key}"):
            fd = os.open(p.with_name(p.name + LOCK_SUFFIX), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.utime(fd)
                now = os.fstat(fd).st_mtime
            finally:
                os.close(fd)
        return Stamped(data, _version(data), now - written)

    def put_if(self, key: str, data: bytes, *, if_version: str | None) -> str:
        with self._writing(f"write {key}"):
            return self._put_if(key, data, if_version)

    def _put_if(self, key: str, data: bytes, if_version: str | None) -> str:
        dst = self._path(key)
        _mkdirs(dst.parent, self._dir_mode)
        tmp = dst.with_name(f"{TMP_MARK}{dst.name}.{uuid.uuid4().hex[:8]}")
        try:
            _write_durable(tmp, data)
            tmp.chmod(self._file_mode)
            with _locked(dst.with_name(dst.name + LOCK_SUFFIX), self._file_mode):
                try:
                    current: str | None = _version(dst.read_bytes())
                except FileNotFoundError:
                    current = None
                if current != if_version:
                    want = "absent" if if_version is None else f"at version {if_version[:12]}"
                    raise PreconditionFailed(f"{self.uri}/{key}: expected it {want}")
                os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(dst.parent)
        return _version(data)


def _version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _locked(lock: Path, mode: int) -> Iterator[None]:
    """An exclusive flock on `lock`: released by the kernel when the holder dies, so no stale locks.
    Its holder only compares and renames, in milliseconds: a wait past LOCK_WAIT_S is a stuck holder
    (a hung network volume), and the put fails as retryable rather than hang the trainer."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, mode)
    try:
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, mode)  # O_CREAT's mode passed through the umask
        if not flock_waiting(fd, LOCK_WAIT_S, poll_s=0.05):
            raise TransientStorageError(
                f"{lock} has been locked by another writer for {LOCK_WAIT_S:.0f} s; will retry"
            )
        yield
    finally:
        os.close(fd)


def _mkdirs(path: Path, mode: int | None = None) -> None:
    """mkdir -p `path`; the directories it creates get `mode`, or else that of the nearest one that
    existed (without its sticky bit or write for others): not the process's umask."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    if not missing:
        return
    mode = p.stat().st_mode & 0o2775 if mode is None else mode
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another writer made it first
            d.mkdir()
            d.chmod(mode)


def _iter_file(p: Path) -> Iterator[bytes]:
    with open(p, "rb") as f:
        while chunk := f.read(CHUNK * 4):
            yield chunk


def _remove_empty_dirs(d: Path, stop: Path) -> None:
    while d != stop and stop in d.parents:
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent
