"""Reading a sharded (DCP) checkpoint without unpickling anything a store could have written.

torch's own reader trusts its files: `FileSystemReader.read_metadata` is `pickle.load` of `.metadata`,
and `DefaultLoadPlanner.load_bytes` is `torch.load(weights_only=False)` of every non-tensor entry (the
optimizer's param groups), so a `.metadata` pickle that calls `open(path, "w")` ran under
`spotrun checkpoints verify --structure` before this module. Here:

- `.metadata` goes through `RestrictedUnpickler`: only DCP's metadata classes, `torch.Size`, dtypes,
  layouts and memory formats, `pathlib`'s paths and plain builtins load; attributes are set only on the
  index's own dataclasses, calls are made only of an allow-list with checked arguments, and the sizes the
  index names must fit the files it indexes (`bounds_problem`); anything else is refused by name;
- every storage key the index names must be a plain file name (trainer/checkpoint/safe_names.py) listed in
  the checkpoint, so the reader never opens a path outside its directory;
- byte entries load with `torch.load(weights_only=True)` (`SafeLoadPlanner`, `SafeFullLoadPlanner`).

These subclass torch's reader and planners and override one method each; `_load_state_dict` and
`_EmptyStateDictLoadPlanner` are private names of torch's, pinned by tests/unit/test_safe_load.py.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import pathlib
import pickle
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
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
    "builtins": {"set", "frozenset"},
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
MAX_DIMS, MAX_DIM = 64, 2**48  # a tensor's shape in the index: more than torch itself makes
MAX_WORDS, MAX_WORD = 64, 4096  # a path's parts, a layout's name
MAX_METADATA_BYTES = 256 * 2**20  # the index of a checkpoint of millions of tensors is a few MB


class UnsafePickle(ValueError):
    """Stored bytes asked for something other than plain data."""


def _record_fields() -> dict[type, frozenset[str]]:
    """The index's dataclasses -> the attribute names a BUILD may set on one of their instances."""
    classes = [
        getattr(dcp_metadata, n)
        for n in sorted(_ALLOWED[_DCP_METADATA_MODULE])
        if n != "_MEM_FORMAT_ENCODING"
    ]
    return {c: frozenset(f.name for f in dataclasses.fields(c)) for c in [*classes, _StorageInfo]}


def _words(args: tuple[Any, ...], what: str) -> None:
    if len(args) > MAX_WORDS or not all(isinstance(a, str) and len(a) <= MAX_WORD for a in args):
        raise UnsafePickle(
            f"refused {what}{_shown(args)}: at most {MAX_WORDS} strings of {MAX_WORD} characters"
        )


def _shape(args: tuple[Any, ...], what: str) -> None:
    dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else None
    ok = dims is not None and len(dims) <= MAX_DIMS
    if not ok or not all(type(d) is int and 0 <= d <= MAX_DIM for d in dims):  # type: ignore[union-attr]
        raise UnsafePickle(f"refused {what}{_shown(args)}: a shape is up to {MAX_DIMS} sizes of 0..2**48")


def _nothing(args: tuple[Any, ...], what: str) -> None:
    if args:
        raise UnsafePickle(f"refused {what}{_shown(args)}: it is built from no arguments here")


def _small_int(args: tuple[Any, ...], what: str) -> None:
    if len(args) != 1 or type(args[0]) is not int or not 0 <= args[0] < 16:
        raise UnsafePickle(f"refused {what}{_shown(args)}: an encoding is one small int")


def _hashables(args: tuple[Any, ...], what: str) -> None:
    items = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else None
    if items is None or not all(isinstance(i, (str, int, bytes)) for i in items):
        raise UnsafePickle(f"refused {what}{_shown(args)}: a set here holds strings and ints")


def _shown(args: tuple[Any, ...]) -> str:
    return f"({', '.join(type(a).__name__ for a in args[:4])}{', ...' if len(args) > 4 else ''})"


# the pure-Python unpickler, whose opcode table a subclass can replace (the C one's is fixed)
_PyUnpickler: Any = pickle._Unpickler  # type: ignore[attr-defined]


class RestrictedUnpickler(_PyUnpickler):
    """An unpickler that builds DCP's index and nothing else. The pure-Python unpickler, whose opcode
    table this class overrides: `find_class` alone filters which globals load, not what is done with
    them. A BUILD sets attributes only on an instance of one of the index's dataclasses, and only its
    fields (on a class it would rewrite that class for the whole process: `PurePosixPath.parents`);
    a call (REDUCE, NEWOBJ) is made only of an allowed callable with arguments of checked types and
    sizes (`bytearray(10**12)` would allocate at will); the protocol-0 object opcodes are refused."""

    dispatch = dict(_PyUnpickler.dispatch)
    _records = _record_fields()  # each record type -> the fields a BUILD may set
    # each callable a REDUCE may call -> the check of its arguments
    _calls: dict[Any, Callable[[tuple[Any, ...], str], None]] = {
        torch.Size: _shape,
        torch.serialization._get_layout: _words,
        pathlib.PosixPath: _words,
        pathlib.PurePosixPath: _words,
        pathlib.Path: _words,
        collections.OrderedDict: _nothing,
        set: _hashables,
        frozenset: _hashables,
        dcp_metadata._MEM_FORMAT_ENCODING: _small_int,
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), _TORCH_VALUES)):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafePickle(f"refused to unpickle {module}.{name} (not part of DCP's index)")

    def _call(self, func: Any, args: tuple[Any, ...]) -> Any:
        what = getattr(func, "__qualname__", type(func).__name__)
        check = self._calls.get(func)
        if check is None:
            raise UnsafePickle(f"refused to call {what} while unpickling (not part of DCP's index)")
        check(args, what)
        return func(*args)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], tuple(args))

    def _make(self, cls: Any, args: Any, kwargs: Any = None) -> None:
        """NEWOBJ's `cls.__new__(cls, *args, **kwargs)`: only one of the index's records, from nothing."""
        if cls not in self._records or args or kwargs:
            raise UnsafePickle(f"refused to make a {getattr(cls, '__qualname__', cls)!s} while unpickling")
        self.append(cls.__new__(cls))

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self._make(self.stack.pop(), args)

    def load_newobj_ex(self) -> None:
        kwargs, args = self.stack.pop(), self.stack.pop()
        self._make(self.stack.pop(), args, kwargs)

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        fields = self._records.get(type(inst))
        if fields is None:  # a class, a function, a path, a dict: nothing of the index's
            raise UnsafePickle(f"refused to set attributes of {type(inst).__qualname__} while unpickling")
        if type(inst).__name__ == "TensorProperties" and isinstance(state, tuple) and len(state) == 5:
            inst.__setstate__(state)  # its own __setstate__: dtype, layout, grad, format encoding, pin
            return
        if not isinstance(state, dict) or not set(state) <= fields:
            extra = (
                sorted(map(str, set(state) - fields)) if isinstance(state, dict) else [type(state).__name__]
            )
            raise UnsafePickle(f"refused to set {extra[:3]} on {type(inst).__qualname__} while unpickling")
        inst.__dict__.update(state)

    def _refuse(self) -> None:
        raise UnsafePickle("refused a protocol-0 object opcode (INST, OBJ) or an extension (EXT, PERSID)")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    for _op in (
        pickle.INST,
        pickle.OBJ,
        pickle.EXT1,
        pickle.EXT2,
        pickle.EXT4,
        pickle.PERSID,
        pickle.BINPERSID,
    ):
        dispatch[_op[0]] = _refuse


def read_dcp_metadata(checkpoint: Path, listed: Collection[str] | None = None) -> Metadata:
    """A DCP checkpoint's `.metadata`, unpickled with the allow-list, and every storage key it names
    checked: a plain name, and one of `listed` (the manifest's files) when given."""
    index = checkpoint / DCP_METADATA
    if (size := index.stat().st_size) > MAX_METADATA_BYTES:
        raise UnsafePickle(f"{DCP_METADATA} is {size:,} bytes, over {MAX_METADATA_BYTES:,}")
    data = index.read_bytes()
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
    if (problem := bounds_problem(metadata, checkpoint)) is not None:
        raise UnsafePickle(f"{DCP_METADATA} does not describe these files: {problem}")
    return metadata


def bounds_problem(metadata: Metadata, checkpoint: Path) -> str | None:
    """Why the index's sizes cannot be those of this checkpoint's files (None: they can): a tensor larger
    than every file together, a chunk outside its tensor, a byte range outside its file, or a planner
    map larger than the index. Sizes are read from the files present (a missing one is the validator's
    to report): an index is data, but its sizes become allocations when a model registers them."""
    storage = metadata.storage_data or {}
    names = {getattr(info, "relative_path", None) for info in storage.values()}
    sizes = {
        n: (checkpoint / n).stat().st_size for n in names if isinstance(n, str) and (checkpoint / n).is_file()
    }
    total = sum(sizes.values())
    for fqn, md in (metadata.state_dict_metadata or {}).items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        numel = math.prod(md.size)
        if sizes and numel * getattr(md.properties.dtype, "itemsize", 1) > total:
            return f"{fqn!r} is {numel:,} elements, more than the checkpoint's {total:,} bytes hold"
        for chunk in md.chunks:
            inside = len(chunk.offsets) == len(chunk.sizes) == len(md.size) and all(
                o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, md.size, strict=True)
            )
            if not inside:
                return f"a chunk of {fqn!r} lies outside its tensor of size {tuple(md.size)}"
    for index, info in storage.items():
        size, start, length = sizes.get(info.relative_path), info.offset, info.length
        if size is not None and not (min(start, length) >= 0 and start + length <= size):
            where = getattr(index, "fqn", index)
            return f"{where!r} reads bytes {start}+{length} of a {size}-byte file"
    planner = metadata.planner_data
    if planner is not None and (
        not isinstance(planner, dict) or len(planner) > len(metadata.state_dict_metadata or {})
    ):
        return "its planner map is larger than its index"
    for key, path in (planner or {}).items():
        if (
            not isinstance(path, tuple)
            or len(path) > MAX_DIMS
            or not all(isinstance(p, (str, int)) for p in path)
        ):
            return f"its planner map's entry {str(key)[:60]!r} is not a short key path"
    return None


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
