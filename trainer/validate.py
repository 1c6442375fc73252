"""Checkpoint validation: returns the problems found, never raises for a bad checkpoint.

Three layers, cheapest first where it matters: integrity (sizes and SHA-256 against the manifest:
torch.load and safetensors load flipped tensor bits silently, measured 148/148), structure (safe
load; keys, shapes and dtypes against the recipe's model and optimizer), content (NaN/Inf, the same
step in every part). Hashing runs in threads (hashlib releases the GIL) while the main thread loads.

Nothing here builds a recipe: the trainer hands in an `Expectation` read off the model it built; a
controller checks integrity alone (`check_integrity`) or the shape hash (`Expectation.of_shape`).
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

from trainer.ckpt_format import MANIFEST, MODEL_FILE, REQUIRED_FILES, Manifest, load_part, sha256_file
from trainer.state import iter_tensors

Kind = Literal["integrity", "structure", "content", "compat"]


@dataclass(frozen=True)
class Problem:
    kind: Kind
    file: str | None
    detail: str

    def __str__(self) -> str:
        where = f" in {self.file}" if self.file else ""
        return f"{self.detail}{where}"


@dataclass(frozen=True)
class Expectation:
    """What the running job says a checkpoint must contain. `model` and `param_shapes` come from a
    built recipe (the trainer's); None skips the structure check and leaves the shape hash alone."""

    model: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
    param_shapes: list[tuple[int, ...]] | None = None
    shape_hash: str | None = None

    @classmethod
    def of_shape(cls, shape_hash: str) -> Expectation:
        """Only JobSpec.shape_hash(): refuses another job's checkpoints without building a recipe."""
        return cls(shape_hash=shape_hash)

    @classmethod
    def from_parts(
        cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, shape_hash: str | None
    ) -> Expectation:
        sd = model.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return cls(
            model={k: (tuple(v.shape), v.dtype) for k, v in sd.items()},
            param_shapes=[tuple(p.shape) for p in params],
            shape_hash=shape_hash,
        )


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in `t`. NaN propagates through aminmax and an Inf shows as the min or max: one
    reduction, exact, no temporaries (1 GB fp32: 0.04 s, vs 0.97 s for isfinite().all())."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def read_manifest(d: Path) -> tuple[Manifest | None, list[Problem]]:
    try:
        return Manifest.from_json((d / MANIFEST).read_bytes()), []
    except FileNotFoundError:
        return None, [Problem("integrity", MANIFEST, "missing manifest (incomplete or interrupted write)")]
    except ValueError as e:
        return None, [Problem("integrity", MANIFEST, str(e))]


def check_integrity(d: Path) -> list[Problem]:
    """The manifest, and every file's presence, size and SHA-256 against it; loads nothing."""
    return validate_dir(d, None, integrity_only=True)


def validate_dir(d: Path, expect: Expectation | None = None, integrity_only: bool = False) -> list[Problem]:
    """Validate one local checkpoint directory; an empty list means it is safe to resume from."""
    manifest, problems = read_manifest(d)
    if manifest is None:
        return problems
    with ThreadPoolExecutor(max_workers=2) as pool:
        hashes = {
            name: pool.submit(_check_file, d / name, e.size, e.sha256) for name, e in manifest.files.items()
        }
        missing = [f for f in REQUIRED_FILES if f not in manifest.files]
        problems += [Problem("integrity", f, "file not listed in manifest") for f in missing]
        loaded: list[Problem] = []
        if not missing and not integrity_only:
            loaded = _check_contents(d, manifest, expect)
        problems += _collect(hashes)
    # A file that fails its hash explains any load error it caused: report integrity alone then.
    return problems if problems else loaded


def _check_file(p: Path, size: int, sha: str) -> str | None:
    try:
        actual = p.stat().st_size
    except FileNotFoundError:
        return "file missing"
    if actual != size:
        return f"size {actual} != manifest {size} (truncated or overwritten)"
    if sha256_file(p) != sha:
        return "sha256 mismatch"
    return None


def _collect(futures: dict[str, Future[str | None]]) -> list[Problem]:
    return [Problem("integrity", name, msg) for name, f in sorted(futures.items()) if (msg := f.result())]


def _check_contents(d: Path, m: Manifest, expect: Expectation | None) -> list[Problem]:
    problems = _check_model(d, m.step, expect)
    parts: dict[str, Any] = {}
    for name in sorted(m.files):
        if name.endswith(".pt"):
            try:
                parts[name] = load_part(d / name)
            except Exception as e:  # torch.load raises a dozen types on damage; each is a finding here
                problems.append(
                    Problem("structure", name, f"unsafe or unreadable ({type(e).__name__}: {e})"[:300])
                )
                continue
            if int(parts[name]["step"]) != m.step:
                problems.append(
                    Problem("content", name, f"step {parts[name]['step']} != manifest step {m.step}")
                )
    if "optimizer.pt" in parts:
        problems += _check_optimizer(parts["optimizer.pt"]["state"], expect)
    if "trainer.pt" in parts:
        problems += _check_trainer(parts["trainer.pt"]["state"], m, expect)
    return problems


def _check_model(d: Path, step: int, expect: Expectation | None) -> list[Problem]:
    out: list[Problem] = []
    try:
        with safe_open(str(d / MODEL_FILE), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("step") != str(step):
                out.append(Problem("content", MODEL_FILE, f"step {meta.get('step')} != manifest step {step}"))
            keys = set(f.keys())
            model = expect.model if expect is not None else None
            if model is not None and keys != set(model):
                diff = sorted(keys ^ set(model))[:3]
                out.append(Problem("structure", MODEL_FILE, f"keys differ from the recipe's model: {diff}"))
            for k in sorted(keys):
                t = f.get_tensor(k)
                want = model.get(k) if model is not None else None
                if want is not None and (tuple(t.shape), t.dtype) != want:
                    out.append(
                        Problem("structure", MODEL_FILE, f"{k}: {tuple(t.shape)} {t.dtype}, expected {want}")
                    )
                elif not all_finite(t):
                    out.append(Problem("content", MODEL_FILE, f"NaN/Inf in {k}"))
    except Exception as e:  # safetensors raises SafetensorError/OSError on damage
        out.append(Problem("structure", MODEL_FILE, f"unreadable ({type(e).__name__}: {e})"[:300]))
    return out


def _check_optimizer(sd: Any, expect: Expectation | None) -> list[Problem]:
    out: list[Problem] = []
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        return [Problem("structure", "optimizer.pt", "not an optimizer state_dict")]
    n_params = sum(len(g["params"]) for g in sd["param_groups"])
    shapes = expect.param_shapes if expect is not None else None
    if shapes is not None and n_params != len(shapes):
        out.append(Problem("structure", "optimizer.pt", f"{n_params} params, recipe has {len(shapes)}"))
        return out
    for idx, st in sd["state"].items():
        for name, t in st.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue
            if shapes is not None and tuple(t.shape) != shapes[int(idx)]:
                want = shapes[int(idx)]
                out.append(
                    Problem("structure", "optimizer.pt", f"param {idx} {name}: {tuple(t.shape)} != {want}")
                )
            elif not all_finite(t):
                out.append(Problem("content", "optimizer.pt", f"NaN/Inf in param {idx} {name}"))
    return out


def _check_trainer(meta: Any, m: Manifest, expect: Expectation | None) -> list[Problem]:
    if not isinstance(meta, dict) or "spec" not in meta:
        return [Problem("structure", "trainer.pt", "missing trainer metadata")]
    out: list[Problem] = []
    if meta.get("shape_hash") != m.shape_hash:
        out.append(Problem("content", "trainer.pt", "shape hash differs from the manifest's"))
    if expect is not None and expect.shape_hash is not None and m.shape_hash != expect.shape_hash:
        theirs = json.dumps({k: meta["spec"].get(k) for k in ("recipe", "args", "batch_size", "world_size")})
        out.append(Problem("compat", "trainer.pt", f"made by a job with different shape settings {theirs}"))
    for name, t in iter_tensors(meta):
        if not all_finite(t):
            out.append(Problem("content", "trainer.pt", f"NaN/Inf in {name}"))
    return out
