"""Checkpoint validation: returns the problems found, never raises for a bad checkpoint.

Three layers, cheapest first where it matters: integrity (sizes and digests against the manifest:
torch.load and safetensors load flipped tensor bits silently, measured 148/148), structure (safe
load; each part's own check from the registry in trainer/checkpoint/stateful.py: model keys, shapes and
dtypes, optimizer state shapes), content (NaN/Inf, the same step in every part). Hashing runs in threads
(hashlib releases the GIL) while the main thread loads. A file the writer marked `finite` is not
scanned for NaN/Inf again: its shapes come from headers and mapped loads (`_check_part`).

Nothing here builds a recipe: the trainer hands in an `Expectation` read off the registry it built
(then a part it registers that the checkpoint lacks, or one it does not know, is refused by name); a
controller checks integrity alone (`check_integrity`) or the shape hash (`Expectation.of_shape`).
"""

from __future__ import annotations

import hmac
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from spotrun.trainer.checkpoint.foreign import check_files
from spotrun.trainer.checkpoint.format import (
    MANIFEST,
    FileEntry,
    Manifest,
    load_part,
    metadata_step,
    parse_step_dir,
    required_files,
)
from spotrun.trainer.checkpoint.manifest import DIRECTORY
from spotrun.trainer.checkpoint.safe_names import contained
from spotrun.trainer.checkpoint.signing import KEYED_DIGEST, Key
from spotrun.trainer.checkpoint.stateful import (
    DCP_METADATA,
    Codec,
    Expectation,
    Finding,
    Kind,
    PartSpec,
    reconcile,
    spec_of_file,
)
from spotrun.trainer.storage.digests import digest_file, digest_files


@dataclass(frozen=True)
class Problem:
    kind: Kind
    file: str | None
    detail: str

    def __str__(self) -> str:
        where = f" in {self.file}" if self.file else ""
        return f"{self.detail}{where}"


def read_manifest(d: Path) -> tuple[Manifest | None, list[Problem]]:
    """The directory's manifest, parsed by the strict rules (safe names, the directory's step) and
    checked against the keys held here. A manifest that cannot be verified comes back with an
    `unverified` problem: its unkeyed digests may still be checked, its files are never loaded."""
    try:
        manifest = Manifest.from_json((d / MANIFEST).read_bytes(), parse_step_dir(d.name))
    except FileNotFoundError:
        return None, [Problem("integrity", MANIFEST, "missing manifest (incomplete or interrupted write)")]
    except ValueError as e:
        return None, [Problem("integrity", MANIFEST, str(e))]
    problem = manifest.verdict().problem
    return manifest, [Problem("unverified", MANIFEST, problem)] if problem else []


def check_integrity(d: Path) -> list[Problem]:
    """The manifest, and every file's presence, size and digest against it; loads nothing."""
    return validate_dir(d, None, integrity_only=True)


def validate_dir(d: Path, expect: Expectation | None = None, integrity_only: bool = False) -> list[Problem]:
    """Validate one local checkpoint directory; an empty list means it is safe to resume from.

    Every file is hashed before it is deserialized (pipelined: file k loads, from the bytes just
    verified, while file k+1 hashes), with the keyed digest when the manifest verifies under a key
    held here. An unverifiable manifest gets its unkeyed digests checked (damage is still damage)
    and nothing loaded."""
    manifest, problems = read_manifest(d)
    if manifest is None:
        return problems
    key = manifest.verdict().key
    with ThreadPoolExecutor(max_workers=2) as pool:
        files = sorted(manifest.files.items())
        hashes = {name: pool.submit(_check_file, d, name, e, key) for name, e in files}
        missing = [f for f in required_files(manifest.layout) if f not in manifest.files]
        problems += [Problem("integrity", f, "file not listed in manifest") for f in missing]
        loaded: list[Problem] = []
        if not missing and not integrity_only and not problems:
            loaded = _check_contents(d, manifest, expect, hashes)
        problems += _collect(hashes)
    # A file that fails its hash explains any load error it caused: report integrity alone then.
    return problems if problems else loaded


def _check_file(d: Path, name: str, e: FileEntry, key: Key | None) -> str | None:
    try:
        p = contained(d, name)
        actual = p.stat().st_size
    except FileNotFoundError:
        return "file missing"
    except ValueError as err:
        return str(err)
    if actual != e.size:
        return f"size {actual} != manifest {e.size} (truncated or overwritten)"
    if key is not None and e.keyed is not None:
        (keyed,) = digest_files(p, [key.file_hasher()])
        return None if hmac.compare_digest(keyed, e.keyed) else f"{KEYED_DIGEST} mismatch (tampered with)"
    if digest_file(p, e.algo) != e.digest:
        return f"{e.algo} mismatch"
    return None


def _collect(futures: dict[str, Future[str | None]]) -> list[Problem]:
    return [Problem("integrity", name, msg) for name, f in sorted(futures.items()) if (msg := f.result())]


def _check_contents(
    d: Path, m: Manifest, expect: Expectation | None, hashes: Mapping[str, Future[str | None]]
) -> list[Problem]:
    if m.layout == DIRECTORY:  # a framework's own files: checks that need no model
        intact = {name for name, f in hashes.items() if f.result() is None}
        return [Problem(kind, name, detail) for kind, name, detail in check_files(d, m, intact)]
    problems = _check_registry(m, expect)
    if problems and problems[0].detail.startswith("written by"):
        return problems  # the other format: its parts would only repeat that
    for fname in sorted(m.files):
        spec = spec_of_file(fname, m.sharded)
        # a file no part writes: refused above when the job's registry is known; a DCP shard: its
        # hash is the check (`.metadata`, checked once, says what the shards hold)
        if spec is not None and fname == spec.file and hashes[fname].result() is None:
            problems += _check_part(d / fname, spec, m, expect)
    return problems


def _check_registry(m: Manifest, expect: Expectation | None) -> list[Problem]:
    if expect is None or expect.parts is None:
        return []
    wants_sharded = expect.parts.get("model") == DCP_METADATA
    if wants_sharded != m.sharded:
        how = "a distributed job (sharded layout)" if m.sharded else "a single-process job (single layout)"
        fix = "with its distributed spec" if m.sharded else "without a distributed spec"
        return [Problem("compat", None, f"written by {how}; resume it {fix}, or use a new storage URI")]
    missing, leftovers = reconcile(expect.parts, m.files, m.sharded)
    return [Problem("compat", None, f"has no part {p}, which this job registers") for p in missing] + [
        Problem("compat", None, f"holds part {p}, which this job does not register") for p in leftovers
    ]


def _check_part(path: Path, spec: PartSpec, m: Manifest, expect: Expectation | None) -> list[Problem]:
    # Values are scanned for NaN/Inf unless the writer found them finite: its digest, checked in
    # parallel, proves these are the bytes it checked. Then shapes come from the safetensors header
    # and from a mapped torch.load, and no tensor byte is read (the scan was most of the gap to a
    # plain load at 100 MB: validation 1.91x; the resume's own load reads the values once).
    scan = not m.files[path.name].finite
    try:
        with _open_part(path, spec.codec, scan, listed=m.files) as (step, state):
            step = m.step if spec.codec is Codec.DCP else step  # DCP files carry no step of ours
            found: list[Finding] = (
                [] if step == m.step else [("content", f"step {step} != manifest step {m.step}")]
            )
            found += spec.check(state, m, expect, scan)
        return [Problem(kind, path.name, detail) for kind, detail in found]
    except Exception as e:  # torch.load and safetensors raise a dozen types on damage; each is a finding
        what = "unreadable" if spec.codec is Codec.SAFETENSORS else "unsafe or unreadable"
        return [Problem("structure", path.name, f"{what} ({type(e).__name__}: {e})"[:300])]


@contextmanager
def _open_part(
    path: Path, codec: Codec, scan: bool = True, listed: Collection[str] | None = None
) -> Iterator[tuple[int | None, Any]]:
    """(the step the part carries, its state); a model's tensors are read one at a time, or (not
    `scan`) described by their header entries alone."""
    if codec is Codec.TORCH:
        obj = load_part(path, mmap=not scan)
        yield int(obj["step"]), obj["state"]
        return
    if codec is Codec.DCP:
        from spotrun.trainer.checkpoint.safe_load import read_dcp_metadata

        yield None, read_dcp_metadata(path.parent, listed)
        return
    with safe_open(str(path), framework="pt") as f:
        yield metadata_step(f.metadata()), _LazyTensors(f, scan)


@dataclass(frozen=True)
class _Described:
    """A tensor as the safetensors header describes it: what the structure checks compare."""

    shape: tuple[int, ...]
    dtype: Any  # torch.dtype


class _LazyTensors(Mapping[str, Any]):  # str -> torch.Tensor, or _Described when not reading values
    def __init__(self, f: Any, values: bool = True) -> None:
        self._f, self._keys, self._values = f, list(f.keys()), values

    def __getitem__(self, k: str) -> Any:
        if not self._values:
            part = self._f.get_slice(k)
            shape = tuple(part.get_shape())
            if shape:  # an empty slice reads no value and carries safetensors' own dtype mapping
                return _Described(shape, part[0:0].dtype)
        return self._f.get_tensor(k)  # a 0-dim tensor cannot be sliced: read whole (one value)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
