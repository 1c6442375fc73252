"""The layering, read from the source with `ast` (nothing is imported): what each package may import, and
no import cycle among first-party modules. Every import counts: at module level, inside a function, and
under `if TYPE_CHECKING:` (a cycle of types is still two modules that cannot be understood apart).

Layers, innermost first: trainer (runs on workers: no Prefect, no controller) < tasks < flows <
deployments < spotrun (the CLI: anything). Each is installed under the one import package `spotrun`
(`spotrun.trainer`, `spotrun.tasks`, ...; pyproject.toml), and nothing imports a bare `trainer`.
`spotrun/__init__.py` and `spotrun/integrations/` are the face a user's loop imports on a worker: the
trainer, torch and the standard library only.

Rooms: trainer/ and tasks/ are packages named for a kind of change (each `__init__` says what it holds),
over a floor of a few modules everything shares. `ROOMS` lists them bottom first: a room imports only
rooms below it (and itself), so a newcomer reads them in that order. tasks imports only the trainer's
contract rooms (what the controller and a worker both read), never the loop, the savers or the recipes.

An edge goes to the module named: `from pkg import sub` is an edge to `pkg.sub` alone, so a package's
`__init__` that re-exports its submodules is no cycle with them. A backend a registry names by a string
(trainer/storage/registry.py) is no edge at all: it is imported when its scheme is first opened.
"""

from __future__ import annotations

import ast
import functools
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "tasks", "flows", "deployments", "spotrun", "bench")
ROOMS_INSTALLED = ("trainer", "tasks", "flows", "deployments")  # installed as spotrun.<room>
CONTROLLER = {"prefect", "mlflow", "sqlalchemy", "alembic", "slack_sdk"}
FORBIDDEN = {
    "trainer": CONTROLLER | {"tasks", "flows", "deployments", "spotrun"},
    "tasks": {"flows", "deployments", "spotrun"},
    "flows": {"deployments", "spotrun"},
    "deployments": {"spotrun"},
}
WORKER_FACE_MAY = set(sys.stdlib_module_names) | {"trainer", "torch", "numpy"}  # layers
# an integration also imports its own framework, and no other
FRAMEWORKS = {
    "spotrun.integrations.transformers": "transformers",
    "spotrun.integrations.lightning": "lightning",
}
# Cycles not broken yet, each with what keeps it and the edit that breaks it; the test fails when one of
# them is gone too (then delete its line).
KNOWN_CYCLES: dict[frozenset[str], str] = {}  # a cycle that must stay for a while: its modules, and why
# bottom first; "floor" is the package's top-level modules (errors, exit codes, settings...), "entry" its
# entry points (`python -m spotrun.trainer`, and a rank torchrun forks: trainer/rank.py)
ROOMS = {
    "trainer": [
        "floor",
        "storage",
        "spec",
        "checkpoint",
        "telemetry",
        "distributed",
        "preemption",
        "hooks",
        "saving",
        "recipes",
        "session",
        "command",
        "launch",
        "entry",
    ],
    "tasks": [
        "market",
        "providers",
        "decisions",
        "deadlines",
        "history",
        "floor",
        "tracking",
        "reports",
        "alerts",
        "ownership",
        "retraining",
        "admission",
        "control",
    ],
}
ENTRY = {"__main__", "rank"}
FLOOR = {
    "trainer": {"errors", "exitcodes", "parent_death", "redact", "home", "exports", "interpreter"},
    "tasks": {"settings"},
}
# what the controller shares with a worker: the job, storage, checkpoints, what a trainer reports, the
# handover protocol, the hook runner (on_attempt_end), and the fork server the local provider talks to
CONTRACT = {"floor", "spec", "storage", "checkpoint", "telemetry", "preemption", "hooks", "launch"}


def module_name(path: Path) -> str:
    """The name a file is imported by: trainer/spec/job.py is `spotrun.trainer.spec.job`."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = ("spotrun", *parts) if parts[0] in ROOMS_INSTALLED else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(name: str) -> str:
    """The layer (one of PACKAGES) module `name` belongs to, or its top-level name when it is not ours:
    `spotrun.trainer.spec` -> trainer, `spotrun.cli` -> spotrun, `torch.nn` -> torch."""
    top, _, rest = name.partition(".")
    second = rest.partition(".")[0]
    return second if top == "spotrun" and second in ROOMS_INSTALLED else top


def within(name: str) -> str:
    """`name` below its layer: `spotrun.trainer.spec.job` -> `spec.job`, `spotrun.cli` -> `cli`."""
    parts = name.split(".")
    return ".".join(parts[2:] if layer(name) in ROOMS_INSTALLED else parts[1:])


@functools.cache
def sources() -> dict[str, Path]:
    """Every first-party module by name: a `.py` file in a package, not a script kept in a plain folder
    below one (deployments/jobs/scripts/: a job's `command:` runs it as a user's script would run)."""
    return {
        module_name(p): p
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if all((d / "__init__.py").is_file() for d in p.parents if ROOT / pkg in d.parents)
    }


def statements(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every statement, however deeply nested (imports are statements: expressions are not walked)."""
    for node in body:
        yield node
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, block, None)
            if isinstance(inner, list):
                yield from statements(inner)


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module named) of every import in `source`, relative ones made absolute; for
    `from m import a`, `m.a` when that is a first-party module, else `m`."""
    known = sources()
    found: list[tuple[int, str]] = []
    for node in statements(ast.parse(source).body):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".")[: len(module.split(".")) - (0 if is_package else 1)]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            found += [(node.lineno, s) for s in subs]
            if len(subs) < len(node.names):
                found.append((node.lineno, base))
    return found


@functools.cache
def imports() -> dict[str, list[tuple[int, str]]]:
    return {m: imports_of(p.read_text(), m, p.name == "__init__.py") for m, p in sources().items()}


def first_party(name: str) -> str | None:
    """The first-party module `name` is, or is in; None for a third-party or standard one."""
    known = sources()
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def cycles() -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph = {m: {t for _, n in found if (t := first_party(n)) and t != m} for m, found in imports().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                out.add(frozenset(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def where(module: str, line: int, name: str) -> str:
    return f"{sources()[module].relative_to(ROOT)}:{line} imports {name}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_above_it(package: str) -> None:
    bad = [
        where(m, line, name)
        for m, found in imports().items()
        if layer(m) == package
        for line, name in found
        if layer(name) in FORBIDDEN[package]
    ]
    assert not bad, "\n".join(bad)


def test_the_worker_face_of_spotrun_imports_only_the_trainer() -> None:
    face = [m for m in imports() if m == "spotrun" or m.startswith("spotrun.integrations")]
    bad = [
        where(m, line, name)
        for m in face
        for line, name in imports()[m]
        if layer(name) not in WORKER_FACE_MAY | {FRAMEWORKS.get(m)}
        and not name.startswith("spotrun.integrations")
    ]
    assert face and not bad, "\n".join(bad)


def test_no_import_cycle_but_the_known_ones() -> None:
    found = cycles()
    new = [", ".join(sorted(c)) for c in found - KNOWN_CYCLES.keys()]
    gone = [", ".join(sorted(c)) for c in KNOWN_CYCLES.keys() - found if c <= sources().keys()]
    assert not new, f"new import cycle(s): {new}; break each, or list it in KNOWN_CYCLES with why"
    assert not gone, f"no longer a cycle: {gone}; remove it from KNOWN_CYCLES"


def room_of(module: str) -> str:
    """`spotrun.trainer.checkpoint.catalog` -> checkpoint; a top-level module of the floor -> floor."""
    package, rest = layer(module), within(module)
    head = rest.split(".")[0]
    if not rest or head in FLOOR[package]:
        return "floor"
    return "entry" if head in ENTRY else head


@pytest.mark.parametrize("package", sorted(ROOMS))
def test_every_module_is_in_a_room_or_the_floor(package: str) -> None:
    stray = [m for m in sources() if layer(m) == package and room_of(m) not in ROOMS[package]]
    assert not stray, f"{stray}: put each in a room of {ROOMS[package]} (or add a room, with its place)"


@pytest.mark.parametrize("package", sorted(ROOMS))
def test_rooms_import_downward_only(package: str) -> None:
    order = {room: i for i, room in enumerate(ROOMS[package])}
    bad = [
        f"{where(m, line, name)}: room {room_of(m)} imports room {room_of(target)}, which is not below it"
        for m, found in imports().items()
        if layer(m) == package
        for line, name in found
        if (target := first_party(name)) and layer(target) == package
        if order[room_of(target)] > order[room_of(m)]
    ]
    assert not bad, "\n".join(bad)


def test_tasks_imports_only_the_trainers_contract_rooms() -> None:
    bad = [
        where(m, line, name)
        for m, found in imports().items()
        if layer(m) == "tasks"
        for line, name in found
        if (target := first_party(name)) and layer(target) == "trainer"
        if room_of(target) not in CONTRACT
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "room", [f"spotrun.{p}.{r}" for p, rooms in ROOMS.items() for r in rooms if r not in {"floor", "entry"}]
)
def test_each_room_says_what_it_holds_and_exports_its_names(room: str) -> None:
    """A room's `__init__` has a docstring, and every name of its `__all__` resolves (re-exports are
    imported when first read: trainer/exports.py)."""
    package = importlib.import_module(room)
    assert (package.__doc__ or "").strip(), f"{room}/__init__.py: say what the room holds"
    missing = [name for name in getattr(package, "__all__", []) if not hasattr(package, name)]
    assert not missing, f"{room} exports {missing}, which it does not have"


@pytest.mark.parametrize(
    ("source", "module", "is_package", "expected"),
    [
        ("import torch.nn", "spotrun.trainer.x", False, ["torch.nn"]),
        ("def f():\n    from spotrun.trainer import storage", "m", False, ["spotrun.trainer.storage"]),
        ("from spotrun.trainer.storage import check_uri", "m", False, ["spotrun.trainer.storage"]),
        (
            "if TYPE_CHECKING:\n    from spotrun.trainer.spec.job import JobSpec",
            "spotrun.trainer.x",
            False,
            ["spotrun.trainer.spec.job"],
        ),
        ("from . import local", "spotrun.trainer.storage", True, ["spotrun.trainer.storage.local"]),
        (
            "from .base import Storage",
            "spotrun.trainer.storage.local",
            False,
            ["spotrun.trainer.storage.base"],
        ),
        ("from .. import errors", "spotrun.trainer.storage.local", False, ["spotrun.trainer.errors"]),
        ("try:\n    pass\nexcept E:\n    import prefect", "spotrun.trainer.x", False, ["prefect"]),
        ("class A:\n    def f(self):\n        with x:\n            import mlflow", "m", False, ["mlflow"]),
    ],
)
def test_imports_are_read_wherever_they_are(
    source: str, module: str, is_package: bool, expected: list[str]
) -> None:
    assert [name for _, name in imports_of(source, module, is_package)] == expected


BARE = {"trainer", "tasks", "flows", "deployments"}


def test_nothing_imports_a_bare_room_name() -> None:
    """Installed, the rooms are `spotrun.trainer`, `spotrun.tasks`, ...: an import of a bare `trainer` would
    find a user's own `trainer.py`, or, from the checkout, load a second copy of spotrun's modules. The
    tests and benchmarks are read too."""
    files = [p for top in (*PACKAGES, "tests") for p in sorted((ROOT / top).rglob("*.py"))]
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {name}"
        for p in files
        for line, name in imports_of(p.read_text(), module_name(p), p.name == "__init__.py")
        if name.split(".")[0] in BARE
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("spotrun.trainer.spec.job", ("trainer", "spec.job")),
        ("spotrun.cli", ("spotrun", "cli")),
        ("spotrun.integrations.lightning", ("spotrun", "integrations.lightning")),
        ("bench.chaos", ("bench", "chaos")),
        ("torch.nn", ("torch", "nn")),
    ],
)
def test_layer_of_a_module(name: str, expected: tuple[str, str]) -> None:
    assert (layer(name), within(name)) == expected
