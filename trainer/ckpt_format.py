"""The on-disk checkpoint format, version 2 (documented in docs/checkpoint-format.md).

Layout `single` (one process):

    <root>/step_000001200/
        model.safetensors      weights; metadata {"spotrun": '{"format": "spotrun/1", "step": 1200}'}
        optimizer.pt           optimizer.state_dict()            (torch.load weights_only=True)
        scheduler.pt           lr_scheduler.state_dict()
        scaler.pt              GradScaler.state_dict(), only with AMP
        rng.rank<R>.pt         python / numpy / torch / CUDA RNG of rank R
        trainer.pt             step, data position, best metric, spec + hashes, versions, threads, world
        extra.<name>.pt        a recipe's extra_state part (an EMA, a stream cursor), one per name
        manifest.json          written LAST: every file's size and digest, the step, metrics, spec hash
    <root>/latest              {"step": 1200, "dir": "step_000001200"}: moved once the copy is confirmed
    <root>/COMPLETED.json      written when the job has finished

Layout `sharded` (a job with a `distributed` spec; trainer/sharded.py writes it):

    <root>/step_000001200/
        .metadata              DCP's index: every tensor of model and optimizer, global shapes
        __<R>_0.distcp         rank R's shard of model and optimizer (torch.distributed.checkpoint)
        scheduler.pt, scaler.pt, trainer.pt, extra.<name>.pt    as in `single`, from rank 0
        rng.rank<R>.pt         every rank's RNG
        manifest.json          written by rank 0 once every rank's files are durable

Version 1 manifests (layout single, SHA-256 digests) are still read and verified.
A checkpoint exists only once its manifest exists: a directory without one is a partial write.
Which parts there are, and which file and encoding each gets, is trainer/stateful.py's registry.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.digests import DIGEST, DIGESTS, digest_file, digest_files, new_hasher
from trainer.direct_io import DirectFile
from trainer.safe_names import name_problem
from trainer.signing import KEYED_DIGEST, Key, Keyring, Verdict, keyring, signing_block, verify
from trainer.stateful import STANDARD, Codec, spec_of, table
from trainer.storage.local import fsync_dir

# torch and safetensors.torch are imported where a part is read or written: listing, integrity checks and
# the controller's reads of manifests never need them (`import torch` is ~2 s of a CLI command's start)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


# 2: a `layout` (single | sharded) and an xxh3-128 digest per file; 1: single only, SHA-256 (still read)
FORMAT_VERSION = 2
SINGLE, SHARDED = "single", "sharded"
LAYOUTS = (SINGLE, SHARDED)
FORMAT_TAG = "spotrun/1"  # in model.safetensors' metadata: the model file itself is the same in 1 and 2
MANIFEST = "manifest.json"
LATEST = "latest"
COMPLETED = "COMPLETED.json"
REJECTED = "REJECTED.json"
RESERVED_NAMES = (MANIFEST, REJECTED)  # a manifest lists neither: they are the commit and its undoing
MODEL_FILE = spec_of("model").file
REQUIRED_FILES = tuple(p.file for p in STANDARD if p.required)


def required_files(layout: str) -> tuple[str, ...]:
    """Files every checkpoint of `layout` lists (each at most once)."""
    return tuple(dict.fromkeys(p.file for p in table(layout == SHARDED) if p.required))


_DIR_RE = re.compile(r"^step_(\d{9,})$")


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


def checkpoint_uri(storage_uri: str, step: int) -> str:
    """Where one checkpoint lives: `<storage>/step_NNNNNNNNN`."""
    return f"{storage_uri.rstrip('/')}/{step_dir(step)}"


def parse_step_dir(name: str) -> int | None:
    m = _DIR_RE.match(name)
    return int(m.group(1)) if m else None


def rng_file(rank: int) -> str:
    return spec_of("rng").file_for(rank)


@dataclass(frozen=True)
class FileEntry:
    size: int
    digest: str  # hex
    algo: str = DIGEST  # a key of DIGESTS; format 1 manifests are all sha256
    # The writer found every floating-point tensor in the file finite. The digest proves the bytes
    # are the ones it checked, so validation then reads shapes and dtypes only (`finite` absent, as in
    # manifests written before it or by hand: every tensor is scanned at validation).
    finite: bool = False
    # With SPOTRUN_MANIFEST_KEY: the keyed BLAKE3 digest (trainer/signing.py), beside the unkeyed one
    keyed: str | None = None

    def body(self) -> dict[str, Any]:
        return {
            "size": self.size,
            self.algo: self.digest,
            **({KEYED_DIGEST: self.keyed} if self.keyed else {}),
            **({"finite": True} if self.finite else {}),
        }


def file_entry(path: Path, finite: bool = False, key: Key | None = None) -> FileEntry:
    """A file's manifest entry, hashed from disk: its unkeyed digest, and the keyed one with `key`."""
    hashers = [new_hasher()] + ([key.file_hasher()] if key else [])
    digest, *keyed = digest_files(path, hashers)
    return FileEntry(path.stat().st_size, digest, finite=finite, keyed=keyed[0] if keyed else None)


@dataclass
class Manifest:
    step: int
    spec_hash: str
    shape_hash: str
    world_size: int
    files: dict[str, FileEntry]
    metrics: dict[str, float] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    created_at: float = field(default_factory=time.time)
    torch_version: str = field(default_factory=_torch_version)
    layout: str = "single"  # single: one process (model.safetensors, ...); sharded: DCP, one shard per rank
    strategy: str | None = None  # sharded: ddp | fsdp
    signature: str | None = None  # HMAC-SHA256 of the rest, with SPOTRUN_MANIFEST_KEY (trainer/signing.py)
    signing: dict[str, str] | None = None  # what signed it: algorithms and key id, inside the signed body

    @property
    def sharded(self) -> bool:
        return self.layout == SHARDED

    def body(self) -> dict[str, Any]:
        """Everything but the signature, as written."""
        return {
            "format": f"spotrun/{self.format_version}",
            "format_version": self.format_version,
            **({"layout": self.layout} if self.format_version >= 2 else {}),
            "step": self.step,
            "spec_hash": self.spec_hash,
            "shape_hash": self.shape_hash,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "torch_version": self.torch_version,
            "metrics": self.metrics,
            **({"strategy": self.strategy} if self.strategy else {}),
            **({"signing": self.signing} if self.signing else {}),
            "files": {k: v.body() for k, v in sorted(self.files.items())},
        }

    def to_json(self) -> bytes:
        d = self.body() | ({"signature": self.signature} if self.signature else {})
        return json.dumps(d, indent=2).encode()

    def signed(self, ring: Keyring | None = None) -> Manifest:
        """This manifest with its HMAC, when SPOTRUN_MANIFEST_KEY is set (trainer/signing.py)."""
        key = (keyring() if ring is None else ring).signing
        if key is not None:
            self.signing = signing_block(key)
            self.signature = key.mac(self.body())
        return self

    def verdict(self, ring: Keyring | None = None) -> Verdict:
        """Whether the keys held here verify this manifest (and so its keyed file digests)."""
        ring = keyring() if ring is None else ring
        verdict = verify(self.body(), self.signature, ring)
        if verdict.key is not None and self.signing:
            unkeyed = sorted(n for n, e in self.files.items() if not e.keyed)
            if unkeyed:
                return Verdict(problem=f"cannot verify: signed, but {unkeyed[0]} has no keyed digest")
        return verdict

    @classmethod
    def from_json(cls, data: bytes, dir_step: int | None = None) -> Manifest:
        """Parse a manifest read from a store; ValueError (with the reason) when it is not one we can
        read or not one to trust with local paths: every file name plain and relative
        (trainer/safe_names.py), no duplicate keys, and the step its directory names (`dir_step`)."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError(f"manifest is {len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
        try:
            d = json.loads(data, object_pairs_hook=_unique_keys)
            version = int(d["format_version"])
            if version > FORMAT_VERSION:
                raise ValueError(
                    f"format_version {version} is newer than this spotrun reads ({FORMAT_VERSION})"
                )
            layout = str(d.get("layout", "single"))
            if layout not in LAYOUTS:
                raise ValueError(f"unknown layout {layout!r}")
            parsed = cls(
                step=int(d["step"]),
                spec_hash=str(d["spec_hash"]),
                shape_hash=str(d["shape_hash"]),
                world_size=int(d["world_size"]),
                files={k: _entry(v) for k, v in _files(d).items()},
                metrics={k: float(v) for k, v in d.get("metrics", {}).items()},
                format_version=version,
                created_at=float(d.get("created_at", 0.0)),
                torch_version=str(d.get("torch_version", "")),
                layout=layout,
                strategy=d.get("strategy"),
                signature=d.get("signature"),
                signing=d.get("signing"),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"malformed manifest: {type(e).__name__}: {e}"[:300]) from None
        for name in parsed.files:
            problem = name_problem(name)
            if problem is None and name in RESERVED_NAMES:
                problem = f"file name {name!r} is reserved"
            if problem is not None:
                raise ValueError(f"unsafe manifest: {problem}")
        if dir_step is not None and parsed.step != dir_step:
            raise ValueError(f"manifest says step {parsed.step}, but its directory is {step_dir(dir_step)}")
        return parsed


MAX_MANIFEST_BYTES = 16 << 20  # ~100,000 files; a larger one is not ours


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup[:60]!r}")
    return d


def _files(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    files = d["files"]
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise TypeError("files must map each name to its size and digest")
    return files


def _entry(v: dict[str, Any]) -> FileEntry:
    algos = [a for a in DIGESTS if a in v]
    if len(algos) != 1:
        found = sorted(set(v) - {"size", "finite", KEYED_DIGEST})
        raise KeyError(f"one digest of {sorted(DIGESTS)} per file, found {found}")
    keyed = v.get(KEYED_DIGEST)
    return FileEntry(
        size=int(v["size"]),
        digest=str(v[algos[0]]),
        algo=algos[0],
        finite=v.get("finite") is True,
        keyed=str(keyed) if keyed is not None else None,
    )


def sha256_file(path: Path) -> str:
    return digest_file(path, "sha256")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A write-only file that hashes what passes through: one pass over the bytes, not two. `direct`:
    around the page cache (trainer/direct_io.py), for a file written where it will stay."""

    def __init__(self, path: Path, direct: bool = False) -> None:
        self._f: Any = DirectFile(path) if direct else open(path, "wb")  # noqa: SIM115 (closed in close())
        self._h = new_hasher()
        key = keyring().signing
        self._keyed = key.file_hasher() if key else None
        self.size = 0

    def write(self, data: Any) -> int:
        self._h.update(data)
        if self._keyed is not None:
            self._keyed.update(data)
        self.size += len(memoryview(data).cast("B"))
        return int(self._f.write(data))

    def flush(self) -> None:
        pass  # torch.save flushes; the bytes are written and fsynced in close()

    def close(self, finite: bool = False) -> FileEntry:
        if isinstance(self._f, DirectFile):
            self._f.close()
        else:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        keyed = str(self._keyed.hexdigest()) if self._keyed is not None else None
        return FileEntry(self.size, str(self._h.hexdigest()), finite=finite, keyed=keyed)


def model_metadata(step: int) -> dict[str, str]:
    """The model file's header metadata, as one key: safetensors writes several keys in an order that
    changes from process to process, so the same weights got different bytes and digests (two orders
    in six processes, measured); with one key the file is a function of the weights and the step."""
    return {"spotrun": json.dumps({"format": FORMAT_TAG, "step": step}, sort_keys=True)}


def metadata_step(meta: dict[str, str] | None) -> int | None:
    """The step a model file's metadata names: this format's one key, or the two keys written before."""
    meta = meta or {}
    try:
        step = json.loads(meta["spotrun"]).get("step") if "spotrun" in meta else meta.get("step")
    except (ValueError, AttributeError):
        return None
    if isinstance(step, int):
        return step
    return int(step) if isinstance(step, str) and step.isdigit() else None


def write_part(path: Path, codec: Codec, state: Any, step: int, direct: bool = False) -> FileEntry:
    """Write one part's state in its codec, fsynced and hashed as it is written, and say whether its
    tensors are all finite (checked here, in the writer, so that validation on the resume's critical
    path need not read every value: one aminmax per tensor, 1 GB in 0.04 s)."""
    from trainer.state import all_finite, iter_tensors

    finite = all(all_finite(t) for _, t in iter_tensors(state))
    w = _HashingWriter(path, direct)
    try:
        if codec is Codec.SAFETENSORS:
            from trainer import safetensors_stream

            safetensors_stream.write(w, state, model_metadata(step))
        else:
            import torch

            torch.save({"step": step, "state": state}, w)  # type: ignore[arg-type]
    finally:
        entry = w.close(finite)
    return entry


def read_part(path: Path, codec: Codec) -> Any:
    """Load one part's state whole, safely (safetensors, or torch.load weights_only)."""
    if codec is Codec.SAFETENSORS:
        from safetensors.torch import load_file

        return load_file(str(path))
    return load_part(path)["state"]


def write_checkpoint_dir(
    parent: Path, snap: dict[str, Any], manifest_base: dict[str, Any], direct: bool = False
) -> tuple[Path, Manifest]:
    """Write a snapshot as a complete checkpoint directory under `parent`, durably.

    Files go to a temp directory, each fsynced and hashed as written, then the manifest (last), then
    one rename makes the directory visible under its step name. `snap` is `Registry.capture()`: part
    name -> state (None: not held), `trainer` carrying this rank; `manifest_base` the Manifest fields
    but files. `direct`: the files go around the page cache (where they are not read again soon)."""
    step = int(manifest_base["step"])
    final = parent / step_dir(step)
    tmp = parent / f".tmp-{step_dir(step)}-{os.getpid()}"
    if tmp.exists():
        _remove_tree(tmp)
    tmp.mkdir(parents=True)
    rank = int(snap["trainer"]["rank"])
    files: dict[str, FileEntry] = {}
    try:
        for name, state in snap.items():
            if state is not None:
                spec = spec_of(name)
                fname = spec.file_for(rank)
                files[fname] = write_part(tmp / fname, spec.codec, state, step, direct)
        manifest = Manifest(files=files, **manifest_base).signed()
        (tmp / MANIFEST).write_bytes(manifest.to_json())
        fsync_file(tmp / MANIFEST)
        fsync_dir(tmp)
    except BaseException:  # a full disk must not stay full of this partial write
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # a rejected checkpoint of the same step from an earlier attempt
        _remove_tree(final)
    os.replace(tmp, final)
    fsync_dir(parent)
    return final, manifest


def _remove_tree(d: Path) -> None:
    # manifest first: a half-removed directory must never look like a checkpoint
    (d / MANIFEST).unlink(missing_ok=True)
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def load_part(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Load one .pt part safely (weights_only) and return its dict {'step', 'state'}; with `mmap`
    the tensors map the file instead of reading it (for checks of shapes alone)."""
    import torch

    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    if not isinstance(obj, dict) or "step" not in obj or "state" not in obj:
        raise ValueError(f"{path.name} is not a spotrun checkpoint part")
    return obj
