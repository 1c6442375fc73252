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

Layout `sharded` (a job with a `distributed` spec; trainer/saving/sharded.py writes it):

    <root>/step_000001200/
        .metadata              DCP's index: every tensor of model and optimizer, global shapes
        __<R>_0.distcp         rank R's shard of model and optimizer (torch.distributed.checkpoint)
        scheduler.pt, scaler.pt, trainer.pt, extra.<name>.pt    as in `single`, from rank 0
        rng.rank<R>.pt         every rank's RNG
        manifest.json          written by rank 0 once every rank's files are durable

Version 1 manifests (layout single, SHA-256 digests) are still read and verified.
A checkpoint exists only once its manifest exists: a directory without one is a partial write.
Which parts there are, and which file and encoding each gets, is trainer/checkpoint/stateful.py's registry;
the manifest itself is trainer/checkpoint/manifest.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from spotrun.trainer.checkpoint.manifest import DIRECTORY, MANIFEST, SHARDED, FileEntry, Manifest, step_dir
from spotrun.trainer.checkpoint.manifest import (
    REJECTED as REJECTED,  # the manifest's names are read from here too
)
from spotrun.trainer.checkpoint.manifest import file_entry as file_entry
from spotrun.trainer.checkpoint.signing import keyring
from spotrun.trainer.checkpoint.stateful import STANDARD, Codec, spec_of, table
from spotrun.trainer.storage.digests import digest_file, new_hasher
from spotrun.trainer.storage.direct_io import DirectFile
from spotrun.trainer.storage.local import fsync_dir

# torch and safetensors.torch are imported where a part is read or written: listing, integrity checks and
# the controller's reads of manifests never need them (`import torch` is ~2 s of a CLI command's start)

FORMAT_TAG = "spotrun/1"  # in model.safetensors' metadata: the model file itself is the same in 1 and 2
LATEST = "latest"
COMPLETED = "COMPLETED.json"
MODEL_FILE = spec_of("model").file
REQUIRED_FILES = tuple(p.file for p in STANDARD if p.required)


def required_files(layout: str) -> tuple[str, ...]:
    """Files every checkpoint of `layout` lists (each at most once); none for a framework's directory."""
    if layout == DIRECTORY:
        return ()
    return tuple(dict.fromkeys(p.file for p in table(layout == SHARDED) if p.required))


_DIR_RE = re.compile(r"^step_(\d{9,})$")


def checkpoint_uri(storage_uri: str, step: int) -> str:
    """Where one checkpoint lives: `<storage>/step_NNNNNNNNN`."""
    return f"{storage_uri.rstrip('/')}/{step_dir(step)}"


def parse_step_dir(name: str) -> int | None:
    m = _DIR_RE.match(name)
    return int(m.group(1)) if m else None


def rng_file(rank: int) -> str:
    return spec_of("rng").file_for(rank)


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
    around the page cache (trainer/storage/direct_io.py), for a file written where it will stay."""

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


def write_part(path: Path, codec: Codec, state: Any, *, step: int, direct: bool = False) -> FileEntry:
    """Write one part's state in its codec, fsynced and hashed as it is written, and say whether its
    tensors are all finite (checked here, in the writer, so that validation on the resume's critical
    path need not read every value: one aminmax per tensor, 1 GB in 0.04 s)."""
    from spotrun.trainer.checkpoint.state import all_finite, iter_tensors

    finite = all(all_finite(t) for _, t in iter_tensors(state))
    w = _HashingWriter(path, direct)
    try:
        if codec is Codec.SAFETENSORS:
            from spotrun.trainer.checkpoint import safetensors_stream

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
                files[fname] = write_part(tmp / fname, spec.codec, state, step=step, direct=direct)
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
