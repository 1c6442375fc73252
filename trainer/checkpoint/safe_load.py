"""Reading a sharded (DCP) checkpoint without unpickling anything a store could have written.

torch's own reader trusts its files: `FileSystemReader.read_metadata` is `pickle.load` of `.metadata`,
and `DefaultLoadPlanner.load_bytes` is `torch.load(weights_only=False)` of every non-tensor entry (the
optimizer's param groups), so a `.metadata` pickle that calls `open(path, "w")` ran under
`spotrun checkpoints verify --structure` before this module. Here:

- `.metadata` goes through `RestrictedUnpickler`: only DCP's metadata classes, `torch.Size`, dtypes,
  layouts and memory formats, `pathlib`'s paths and plain builtins; anything else is refused by name;
- every storage key the index names must be a plain file name (trainer/checkpoint/safe_names.py) listed in
  the checkpoint, so the reader never opens a path outside its directory;
- byte entries load with `torch.load(weights_only=True)` (`SafeLoadPlanner`, `SafeFullLoadPlanner`).

These subclass torch's reader and planners and override one method each; `_load_state_dict` and
`_EmptyStateDictLoadPlanner` are private names of torch's, pinned by tests/unit/test_safe_load.py.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from spotrun.trainer.checkpoint.safe_names import name_problem

DCP_METADATA = ".metadata"
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _DCP_METADATA_MODULE: {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex", "bytearray"},
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafePickle(ValueError):
    """Stored bytes asked for something other than plain data."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP's index and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), _TORCH_VALUES)):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafePickle(f"refused to unpickle {module}.{name} (not part of DCP's index)")


def read_dcp_metadata(checkpoint: Path, listed: Collection[str] | None = None) -> Metadata:
    """A DCP checkpoint's `.metadata`, unpickled with the allow-list, and every storage key it names
    checked: a plain name, and one of `listed` (the manifest's files) when given."""
    data = (checkpoint / DCP_METADATA).read_bytes()
    try:
        metadata = RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafePickle:
        raise
    except Exception as e:  # pickle raises a dozen types on damage; each means "not an index"
        raise ValueError(f"{DCP_METADATA} is not a DCP index ({type(e).__name__}: {e})"[:300]) from None
    if not isinstance(metadata, Metadata):
        raise UnsafePickle(f"{DCP_METADATA} holds a {type(metadata).__name__}, not DCP's Metadata")
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        problem = name_problem(path)
        if problem is None and listed is not None and path not in listed:
            problem = f"{path!r} is not a file of this checkpoint"
        if problem is None and getattr(info, "transform_descriptors", None):
            problem = f"{path!r} names stream transforms, which spotrun never writes"
        if problem is not None:
            raise UnsafePickle(f"{DCP_METADATA} names a storage key outside the checkpoint: {problem}")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with `read_metadata` through `read_dcp_metadata`."""

    def __init__(self, path: str | Path, listed: Collection[str] | None = None) -> None:
        super().__init__(str(path))
        self._dir, self._listed = Path(path), listed

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self._dir, self._listed)
        meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata


def _load_bytes_safely(planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    """`DefaultLoadPlanner.load_bytes` with `torch.load(weights_only=True)`."""
    loaded = torch.load(value, map_location="cpu", weights_only=True)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but byte entries load with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes_safely(self, read_item, value)


class SafeFullLoadPlanner(_EmptyStateDictLoadPlanner):
    """The planner of torch's `dcp_to_torch_save` (loads every entry into an empty dict), made safe."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes_safely(self, read_item, value)


def load_full_state(
    checkpoint: Path, listed: Collection[str] | None = None, keys: Collection[str] | None = None
) -> dict[str, Any]:
    """What a DCP checkpoint holds (only the top-level `keys`, when given), as one nested dict on CPU,
    in this process (no process group): what `dcp_to_torch_save` does, with the safe reader and planner."""
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=SafeFileSystemReader(checkpoint, listed),
            planner=SafeFullLoadPlanner(keys=set(keys) if keys is not None else None),
            no_dist=True,
        )
    except CheckpointException as e:  # a BaseException: one line, for callers that catch ValueError
        causes = [str(f[0] if isinstance(f, tuple) else f) for f in e.failures.values()]
        raise ValueError(f"{checkpoint.name} not loadable: {'; '.join(causes)}"[:300]) from None
    return state
