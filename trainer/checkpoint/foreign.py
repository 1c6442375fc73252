"""Content checks of a framework's own checkpoint (layout `directory`: an HF `checkpoint-N/`, a Lightning
`.ckpt`), which need no model: what a script wrote is checked before spotrun restores it.

Every file's digest is checked first (trainer/checkpoint/validate.py). Then by kind: a `.safetensors` file
opens and its tensors are finite; a torch file (`.pt`, `.pth`, `.bin`, `.ckpt`) loads with
`weights_only=True` (with the numpy allow-list HF itself loads its RNG files with) and its tensors are
finite (a Lightning checkpoint's weights and optimizer states); a `.json` file parses.
spotrun never unpickles stored bytes: a file that only a full unpickler
reads (HF's `training_args.bin`, a TrainingArguments object) is held to its digest alone, and a torch
file that fails a weights-only load is refused as unsafe or unreadable.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from spotrun.trainer.checkpoint.manifest import Manifest
from spotrun.trainer.checkpoint.stateful import Kind

# HF's TrainingArguments, pickled whole: its digest is its check. Named by file, not by suffix: any
# other `.bin` (a model's pytorch_model.bin) is a tensor file and loads weights-only.
OPAQUE = frozenset({"training_args.bin"})
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")

Found = tuple[Kind, str, str]  # kind, file, detail


def check_files(d: Path, m: Manifest, intact: set[str]) -> list[Found]:
    """What is wrong with the files of a `directory` checkpoint at `d`; `intact`: the files whose
    digests matched (the only ones loaded)."""
    problems: list[Found] = []
    for name in sorted(intact):
        base = name.rsplit("/", 1)[-1]
        try:
            detail = _check(d / name, base, scan=not m.files[name].finite)
        except Exception as e:  # torch.load and safetensors raise a dozen types on damage: each a finding
            problems.append(("structure", name, f"unsafe or unreadable ({type(e).__name__}: {e})"[:300]))
            continue
        if detail is not None:
            problems.append(("content", name, detail))
    return problems


def _check(path: Path, base: str, scan: bool) -> str | None:
    if base.endswith(".json"):
        json.loads(path.read_bytes())
        return None
    if base.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return _first_bad((k, f.get_tensor(k)) for k in f.keys()) if scan else None  # noqa: SIM118 (not a dict)
    if base.endswith(TORCH_SUFFIXES) and base not in OPAQUE:
        import torch

        from spotrun.trainer.checkpoint.state import iter_tensors

        with numpy_allowed():
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return _first_bad(iter(iter_tensors(trained(obj)))) if scan else None
    return None


def trained(obj: Any) -> Any:
    """The part of a loaded file whose values training computed: a Lightning checkpoint's weights and
    optimizer states (its callbacks keep infinities on purpose: ModelCheckpoint's `kth_value` starts at
    inf), anything else whole."""
    if isinstance(obj, dict) and "state_dict" in obj and "pytorch-lightning_version" in obj:
        return {"state_dict": obj["state_dict"], "optimizer_states": obj.get("optimizer_states")}
    return obj


def _first_bad(tensors: Iterator[tuple[str, Any]]) -> str | None:
    from spotrun.trainer.checkpoint.state import all_finite

    for key, t in tensors:
        if not all_finite(t):
            return f"tensor {key or '(top)'} holds NaN or Inf"
    return None


@contextmanager
def numpy_allowed() -> Iterator[None]:
    """The numpy types a weights-only load may rebuild: HF's RNG files hold numpy's generator state
    (the same allow-list `transformers.trainer_pt_utils.safe_globals` uses); nothing that runs code."""
    import numpy as np
    import torch

    core: Any = getattr(np, "_core", None) or np.core  # numpy 2 renamed it
    allow = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allow):
        yield
