"""A checkpoint's manifest: the record, written last, of every file's size and digest, the step and the
spec's hashes (docs/checkpoint-format.md). Parsing one refuses what is not ours or not safe to use.

Below the parts registry (trainer/checkpoint/stateful.py), whose checks read a manifest, and the format
(trainer/checkpoint/format.py), which writes one and re-exports these names. No torch at import.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotrun.trainer.checkpoint.safe_names import name_problem
from spotrun.trainer.checkpoint.signing import (
    KEYED_DIGEST,
    Key,
    Keyring,
    Verdict,
    keyring,
    signing_block,
    verify,
)
from spotrun.trainer.storage.digests import DIGEST, DIGESTS, digest_files, new_hasher

# 2: a `layout` (single | sharded) and an xxh3-128 digest per file; 1: single only, SHA-256 (still read)
FORMAT_VERSION = 2
SINGLE, SHARDED = "single", "sharded"
# a framework's own checkpoint (an HF `checkpoint-N/`, a Lightning `.ckpt`) as the script wrote it,
# published by trainer/command/: its files are the script's, by their paths under {checkpoint_dir}
DIRECTORY = "directory"
LAYOUTS = (SINGLE, SHARDED, DIRECTORY)
MANIFEST = "manifest.json"
REJECTED = "REJECTED.json"
RESERVED_NAMES = (MANIFEST, REJECTED)  # a manifest lists neither: they are the commit and its undoing


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


@dataclass(frozen=True)
class FileEntry:
    size: int
    digest: str  # hex
    algo: str = DIGEST  # a key of DIGESTS; format 1 manifests are all sha256
    # The writer found every floating-point tensor in the file finite. The digest proves the bytes
    # are the ones it checked, so validation then reads shapes and dtypes only (`finite` absent, as in
    # manifests written before it or by hand: every tensor is scanned at validation).
    finite: bool = False
    # With SPOTRUN_MANIFEST_KEY: the keyed BLAKE3 digest (trainer/checkpoint/signing.py),
    # beside the unkeyed one
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
    signature: str | None = (
        None  # HMAC-SHA256 of the rest, with SPOTRUN_MANIFEST_KEY (trainer/checkpoint/signing.py)
    )
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
        """This manifest with its HMAC, when SPOTRUN_MANIFEST_KEY is set (trainer/checkpoint/signing.py)."""
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
        (trainer/checkpoint/safe_names.py), no duplicate keys, and the step its directory
        names (`dir_step`)."""
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
        except MALFORMED as e:
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


# what parsing a manifest that is not one raises; OverflowError: "step": Infinity is a float int() refuses
MALFORMED = (KeyError, TypeError, AttributeError, OverflowError, json.JSONDecodeError, RecursionError)
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
