"""The model file in the safetensors format, written tensor by tensor instead of built in memory.

Why: `safetensors.torch.save` returns the whole file as one bytes object. For the 355 MB model of the
1 GB benchmark state that meant a fresh 355 MB allocation, page-faulted in and freed for every
checkpoint: 1.3-1.8 s of kernel CPU and 0.4 s of user CPU (measured with getrusage), on the cores the
training uses. Here each tensor's bytes are handed to the writer straight from the snapshot.

The bytes are the library's own, byte for byte (tests/unit/test_safetensors_stream.py compares them):
the header is the same compact JSON (metadata first, then the tensors sorted by dtype, widest first,
then by name, each with dtype, shape and data_offsets), padded with spaces to a multiple of 8. So the
digests in manifests do not depend on which writer produced a file. A dtype not in the table below
falls back to the library.
"""

from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class Sink(Protocol):
    def write(self, data: Any) -> int: ...


# safetensors' name for each dtype, in the order of its Rust `Dtype` enum (the writer sorts by it,
# descending): only those spotrun's states hold; anything else is written by the library.
_ORDER = ("BOOL", "U8", "I8", "I16", "F16", "BF16", "I32", "F32", "F64", "I64")


def _names() -> dict[Any, str]:
    import torch

    return {
        torch.bool: "BOOL",
        torch.uint8: "U8",
        torch.int8: "I8",
        torch.int16: "I16",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int32: "I32",
        torch.float32: "F32",
        torch.float64: "F64",
        torch.int64: "I64",
    }


def header(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None
) -> tuple[bytes, list[str]] | None:
    """The length prefix and header, and the order the tensors' bytes follow in; None when a dtype is
    not in the table."""
    names = _names()
    if any(t.dtype not in names for t in tensors.values()):
        return None
    rank = {name: i for i, name in enumerate(_ORDER)}
    order = sorted(tensors, key=lambda k: (-rank[names[tensors[k].dtype]], k))
    head: dict[str, Any] = {"__metadata__": metadata} if metadata is not None else {}
    offset = 0
    for k in order:
        t = tensors[k]
        n = t.numel() * t.element_size()
        head[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def write(out: Sink, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (CPU) to `out` as a safetensors file."""
    import torch

    prepared = header(tensors, metadata)
    if prepared is None or any(t.device.type != "cpu" for t in tensors.values()):
        from safetensors.torch import save

        out.write(save(tensors, metadata=metadata))
        return
    head, order = prepared
    out.write(head)
    for k in order:
        t = tensors[k].contiguous()
        if t.numel():
            out.write(t.reshape(-1).view(torch.uint8).numpy())
