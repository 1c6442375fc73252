"""What a checkpoint holds: one registry of stateful parts, in one place.

A part is anything with `state_dict()` / `load_state_dict()` (torchdata's `Stateful`). Each part's
`PartSpec` says which file it lives in, how that file is encoded, whether every checkpoint must hold
it, and how to check its loaded state against what the running job expects. Saving
(`ckpt_format.write_checkpoint_dir`), loading (`resume.load_state`) and validation
(`validate.validate_dir`) all walk these specs by name; none keeps a list of its own.

The parts, in the order they are captured and loaded (docs/checkpoint-format.md):

    model      model.safetensors   required   keys, shapes, dtypes vs the recipe's model; finite
    optimizer  optimizer.pt        required   state shapes vs the parameters; finite
    scheduler  scheduler.pt        required
    scaler     scaler.pt           optional   only with AMP; absent or unused is no error
    rng        rng.rank<R>.pt                 applied by the caller later (after the epoch iterator)
    trainer    trainer.pt          required   step, data position, spec and hashes; shape hash
    <name>     extra.<name>.pt                a recipe's `Parts.extra_state` (an EMA, a stream cursor)

Fabric's rule for leftovers holds: a part this job registers that a checkpoint lacks, or one a
checkpoint holds that this job does not register, is an error naming the part (`reconcile`);
only the optional scaler and other ranks' RNG files are exempt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.spec.job import describe_changes, spec_changes

# torch is imported by the functions that touch tensors: the registry's table, its files and a manifest's
# checks are read by the controller and the CLI too, which never load a tensor
if TYPE_CHECKING:
    import torch

    from spotrun.trainer.checkpoint.manifest import Manifest
    from spotrun.trainer.spec.job import JobSpec

Kind = Literal["integrity", "unverified", "structure", "content", "compat"]
Finding = tuple[Kind, str]


@runtime_checkable
class Stateful(Protocol):
    """Anything a checkpoint can hold: torch modules, optimizers, schedulers, scalers, plain objects."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


class Codec(Enum):
    SAFETENSORS = "safetensors"  # flat name -> tensor; the step in the header metadata
    TORCH = "torch"  # torch.save of {"step", "state"}, loadable with torch.load(weights_only=True)
    DCP = "dcp"  # torch.distributed.checkpoint: `.metadata` + one `__<rank>_<n>.distcp` per rank


@dataclass(frozen=True)
class Expectation:
    """What the running job says a checkpoint must contain. `model` and `param_shapes` come from a
    built recipe (the trainer's); None skips the structure check and leaves the shape hash alone.
    `parts` (name -> file) is the job's registry: with it, missing and unknown parts are refused."""

    model: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
    param_shapes: list[tuple[int, ...]] | None = None
    shape_hash: str | None = None
    parts: dict[str, str] | None = None
    # The shape hash the job would have at another world size (JobSpec.shape_hash): with it, a
    # checkpoint of another world size is told apart from another job's, and refused by name unless
    # `allow_reshard`.
    shape_hash_at: Callable[[int], str] | None = None
    world_size: int | None = None
    allow_reshard: bool = False
    # The running job's spec (JSON form) and its recipe's `shape_args`: with them, compatibility is
    # decided field by field against the spec the checkpoint carries (JobSpec's shape and trajectory),
    # and the hash only guards the checkpoint's own consistency. `allow_changes`: trajectory changes pass.
    spec: Mapping[str, Any] | None = None
    shape_args: frozenset[str] | None = None
    allow_changes: bool = False

    @classmethod
    def of_shape(cls, shape_hash: str) -> Expectation:
        """Only JobSpec.shape_hash(): refuses another job's checkpoints without building a recipe."""
        return cls(shape_hash=shape_hash)

    @classmethod
    def of_spec(cls, spec: JobSpec, shape_args: frozenset[str] | None = None) -> Expectation:
        """The spec alone, without building a recipe: refuses shape changes and (unless the spec allows
        them) trajectory changes by name. `shape_args`: the recipe's (None: every arg is shape)."""
        return cls(
            shape_hash=spec.shape_hash(),
            spec=spec.model_dump(mode="json"),
            shape_args=shape_args,
            allow_changes=spec.resume.allow_changes,
        )

    @classmethod
    def from_parts(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        shape_hash: str | None,
        parts: dict[str, str] | None = None,
    ) -> Expectation:
        sd = model.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return cls(
            model={k: (tuple(v.shape), v.dtype) for k, v in sd.items()},
            param_shapes=[tuple(p.shape) for p in params],
            shape_hash=shape_hash,
            parts=parts,
        )

    @classmethod
    def from_registry(cls, registry: Registry, shape_hash: str | None) -> Expectation:
        import torch

        model, optimizer = registry["model"], registry["optimizer"]
        assert isinstance(model, torch.nn.Module) and isinstance(optimizer, torch.optim.Optimizer)
        return cls.from_parts(unwrap(model), optimizer, shape_hash, registry.files())


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The recipe's model inside a DDP wrapper (whose state_dict keys gain a `module.` prefix)."""
    import torch

    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


# (state, manifest, expectation, scan): `scan` is False where the writer recorded the file's tensors
# as finite (FileEntry.finite): then a check reads shapes and dtypes only, never the values.
Check = Callable[[Any, "Manifest", Expectation | None, bool], list[Finding]]


def check_finite(state: Any, m: Manifest, expect: Expectation | None, scan: bool = True) -> list[Finding]:
    """No NaN/Inf in any tensor of the state: the check every part gets at least."""
    from spotrun.trainer.checkpoint.state import all_finite, iter_tensors

    if not scan:
        return []
    return [("content", f"NaN/Inf in {name}") for name, t in iter_tensors(state) if not all_finite(t)]


def check_model(
    state: Mapping[str, torch.Tensor], m: Manifest, expect: Expectation | None, scan: bool = True
) -> list[Finding]:
    from spotrun.trainer.checkpoint.state import all_finite

    out: list[Finding] = []
    keys = set(state)
    model = expect.model if expect is not None else None
    if model is not None and keys != set(model):
        out.append(("structure", f"keys differ from the recipe's model: {sorted(keys ^ set(model))[:3]}"))
    for k in sorted(keys):
        t = state[k]  # one tensor at a time: `state` may read lazily from the file (or, not scanning,
        # hand over only the header's shape and dtype)
        want = model.get(k) if model is not None else None
        if want is not None and (tuple(t.shape), t.dtype) != want:
            out.append(("structure", f"{k}: {tuple(t.shape)} {t.dtype}, expected {want}"))
        elif scan and not all_finite(t):
            out.append(("content", f"NaN/Inf in {k}"))
    return out


def check_optimizer(sd: Any, m: Manifest, expect: Expectation | None, scan: bool = True) -> list[Finding]:
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        return [("structure", "not an optimizer state_dict")]
    import torch

    from spotrun.trainer.checkpoint.state import all_finite

    n_params = sum(len(g["params"]) for g in sd["param_groups"])
    shapes = expect.param_shapes if expect is not None else None
    if shapes is not None and n_params != len(shapes):
        return [("structure", f"{n_params} params, recipe has {len(shapes)}")]
    out: list[Finding] = []
    for idx, st in sd["state"].items():
        for name, t in st.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue
            if shapes is not None and tuple(t.shape) != shapes[int(idx)]:
                out.append(("structure", f"param {idx} {name}: {tuple(t.shape)} != {shapes[int(idx)]}"))
            elif scan and not all_finite(t):
                out.append(("content", f"NaN/Inf in param {idx} {name}"))
    return out


def check_dcp(md: Any, m: Manifest, expect: Expectation | None, scan: bool = True) -> list[Finding]:
    """A sharded checkpoint's `.metadata` (global shapes of every tensor, whatever the world size)
    against the recipe's model; the shards themselves are checked by their hashes."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = md.state_dict_metadata
    model = {k[len("model.") :]: v for k, v in meta.items() if k.startswith("model.")}
    out: list[Finding] = []
    if not model or not any(k.startswith("optimizer.") for k in meta):
        return [("structure", "DCP metadata lacks the model or the optimizer")]
    want = expect.model if expect is not None else None
    if want is not None and set(model) != set(want):
        out.append(
            ("structure", f"keys differ from the recipe's model: {sorted(set(model) ^ set(want))[:3]}")
        )
    for k in sorted(set(model) & set(want or {})):
        v = model[k]
        if isinstance(v, TensorStorageMetadata) and (tuple(v.size), v.properties.dtype) != want[k]:  # type: ignore[index]
            out.append(("structure", f"{k}: {tuple(v.size)} {v.properties.dtype}, expected {want[k]}"))  # type: ignore[index]
    return out


def check_nothing(state: Any, m: Manifest, expect: Expectation | None, scan: bool = True) -> list[Finding]:
    return []


def check_trainer(meta: Any, m: Manifest, expect: Expectation | None, scan: bool = True) -> list[Finding]:
    if not isinstance(meta, dict) or "spec" not in meta:
        return [("structure", "missing trainer metadata")]
    out: list[Finding] = []
    if meta.get("shape_hash") != m.shape_hash:
        out.append(("content", "shape hash differs from the manifest's"))
    if expect is not None:
        out += check_compat(meta["spec"], m, expect)
    return out + check_finite(meta, m, expect, scan)


def check_compat(saved: Mapping[str, Any], m: Manifest, expect: Expectation) -> list[Finding]:
    """Can this job resume a checkpoint made by the job `saved`? Shape changes never; another world
    size with `allow_reshard`; trajectory changes with `allow_changes`. Each refusal names the fields
    (old -> new) and the fix."""
    if expect.spec is None:  # a tool that knows only the hash
        if expect.shape_hash is None:
            return []
        want = expect.shape_hash_at(m.world_size) if expect.shape_hash_at else expect.shape_hash
        if m.shape_hash == want:
            return _check_world(m, expect)
        theirs = json.dumps({k: saved.get(k) for k in ("recipe", "args", "batch_size")})
        return [("compat", f"made by a job with different shape settings {theirs}")]
    changes = spec_changes(saved, expect.spec, expect.shape_args)
    shape = [c for c in changes if c.kind == "shape"]
    if shape:
        return [
            (
                "compat",
                f"made by a job with different shape settings ({describe_changes(shape)}); restore them, "
                "or use a new storage URI for a changed model",
            )
        ]
    trajectory = [c for c in changes if c.kind == "trajectory"]
    if trajectory and not expect.allow_changes:
        return [
            (
                "compat",
                f"made with different training settings ({describe_changes(trajectory)}); restore them, or "
                "pass --allow-changes (or set resume.allow_changes: true) to go on with the new ones (the "
                "run is then no longer bitwise equal to an uninterrupted one)",
            )
        ]
    return _check_world(m, expect)


def _check_world(m: Manifest, expect: Expectation) -> list[Finding]:
    if expect.world_size is None or m.world_size == expect.world_size or expect.allow_reshard:
        return []
    return [
        (
            "compat",
            f"was written by {m.world_size} rank(s) and this run has {expect.world_size}; set "
            f"distributed.allow_reshard: true to resume it resharded (not bitwise), or run "
            f"{m.world_size} rank(s)",
        )
    ]


@dataclass(frozen=True)
class PartSpec:
    """One kind of part: where it lives, how it is encoded, and how it is checked."""

    name: str
    file: str  # "{rank}" in it: one file per rank; else one file, written by rank 0
    codec: Codec = Codec.TORCH
    required: bool = False  # every checkpoint holds it: its absence is damage (integrity)
    optional: bool = False  # a checkpoint may lack it, or hold it unused (the scaler: AMP on or off)
    deferred: bool = False  # loaded with the rest, applied by the caller when its time comes
    check: Check = check_finite
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pattern = re.escape(self.file).replace(re.escape("{rank}"), r"\d+")
        object.__setattr__(self, "_pattern", re.compile(f"^{pattern}$"))

    def file_for(self, rank: int) -> str:
        return self.file.format(rank=rank)

    @property
    def per_rank(self) -> bool:
        return "{rank}" in self.file

    def matches(self, fname: str) -> bool:
        """Is `fname` this part's file, of any rank (for a DCP part: its metadata or a shard)?"""
        if self.codec is Codec.DCP and SHARD_FILE.match(fname):
            return True
        return self._pattern.match(fname) is not None


STANDARD: tuple[PartSpec, ...] = (
    PartSpec("model", "model.safetensors", Codec.SAFETENSORS, required=True, check=check_model),
    PartSpec("optimizer", "optimizer.pt", required=True, check=check_optimizer),
    PartSpec("scheduler", "scheduler.pt", required=True),
    PartSpec("scaler", "scaler.pt", optional=True),
    # Deferred: creating the epoch's data iterator draws from the global RNG (loop.py's docstring).
    PartSpec("rng", "rng.rank{rank}.pt", deferred=True),
    PartSpec("trainer", "trainer.pt", required=True, check=check_trainer),
)
# The sharded layout, with a `distributed` spec: model and optimizer go through DCP, one shard per
# rank, in any world size (resharded on load); the rest as in the single layout, written by rank 0
# (rng: by every rank).
DCP_METADATA = ".metadata"
SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")
SHARDED: tuple[PartSpec, ...] = (
    PartSpec("model", DCP_METADATA, Codec.DCP, required=True, check=check_dcp),
    PartSpec("optimizer", DCP_METADATA, Codec.DCP, required=True, check=check_nothing),
    *STANDARD[2:],
)
_BY_NAME = {p.name: p for p in STANDARD}
_BY_NAME_SHARDED = {p.name: p for p in SHARDED}
EXTRA_FILE = "extra.{name}.pt"
_EXTRA_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_EXTRA_FILE = re.compile(r"^extra\.([A-Za-z0-9_-]+)\.pt$")


def extra_spec(name: str) -> PartSpec:
    """The spec of a recipe's extra part: its own `.pt` file, checked for NaN/Inf."""
    return PartSpec(name, EXTRA_FILE.format(name=name))


def table(sharded: bool = False) -> tuple[PartSpec, ...]:
    """The standard parts of the sharded or the single layout."""
    return SHARDED if sharded else STANDARD


def spec_of(name: str, sharded: bool = False) -> PartSpec:
    """The spec of a part by name: a standard part, or else a recipe's extra part."""
    return (_BY_NAME_SHARDED if sharded else _BY_NAME).get(name) or extra_spec(name)


def spec_of_file(fname: str, sharded: bool = False) -> PartSpec | None:
    """Which part a checkpoint file holds; None for a file no part writes. A sharded checkpoint's
    `.metadata` and shards answer `model` (DCP holds the optimizer in the same files)."""
    for p in table(sharded):
        if p.matches(fname):
            return p
    m = _EXTRA_FILE.match(fname)
    return extra_spec(m.group(1)) if m else None


def reconcile(
    wanted: Mapping[str, str], present: Iterable[str], sharded: bool = False
) -> tuple[list[str], list[str]]:
    """(parts `wanted` (name -> file) whose file is not `present`, `present` files no wanted part
    reads), both as "'name' (file)". Optional parts and other ranks' files are neither."""
    have, reads = set(present), set(wanted.values())
    missing = [
        f"{n!r} ({f})" for n, f in wanted.items() if f not in have and not spec_of(n, sharded).optional
    ]
    leftovers = []
    for f in sorted(have - reads):
        spec = spec_of_file(f, sharded)
        if spec is None:
            leftovers.append(f"{f!r}")
        elif not spec.optional and spec.name not in wanted:  # in `wanted`: another rank's file
            leftovers.append(f"{spec.name!r} ({f})")
    return missing, leftovers


@dataclass(frozen=True)
class Part:
    spec: PartSpec
    obj: Stateful
    file: str  # this rank's file


class Registry(Mapping[str, Stateful]):
    """This job's parts, name -> live object, in capture and load order."""

    def __init__(
        self,
        rank: int,
        parts: Mapping[str, Stateful],
        extra: Mapping[str, Stateful],
        sharded: bool = False,
    ) -> None:
        self.rank, self.sharded = rank, sharded
        self._parts: dict[str, Part] = {}
        standard = _BY_NAME_SHARDED if sharded else _BY_NAME
        for name, obj in parts.items():
            if name not in standard:
                raise ValueError(f"{name!r} is not a standard part; pass it in `extra`")
            self._add(standard[name], obj)
        for name, obj in extra.items():
            if name in _BY_NAME or not _EXTRA_NAME.match(name):
                raise ConfigError(
                    f"extra_state name {name!r}: use letters, digits, '_' or '-', "
                    f"and none of {sorted(_BY_NAME)}"
                )
            if not isinstance(obj, Stateful):
                raise ConfigError(
                    f"extra_state {name!r} ({type(obj).__name__}) is not Stateful: "
                    "give it state_dict() and load_state_dict()"
                )
            self._add(extra_spec(name), obj)

    def _add(self, spec: PartSpec, obj: Stateful) -> None:
        self._parts[spec.name] = Part(spec, obj, spec.file_for(self.rank))

    def __getitem__(self, name: str) -> Stateful:
        return self._parts[name].obj

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def part(self, name: str) -> Part:
        return self._parts[name]

    def files(self) -> dict[str, str]:
        """name -> the file this rank reads and writes."""
        return {n: p.file for n, p in self._parts.items()}

    def capture(self) -> dict[str, Any]:
        """Every part's state, by name: what `write_checkpoint_dir` takes. Sharded (DCP) parts are
        not here: trainer/saving/sharded.py captures them together, model and optimizer in one state dict."""
        return {n: p.obj.state_dict() for n, p in self._parts.items() if p.spec.codec is not Codec.DCP}
