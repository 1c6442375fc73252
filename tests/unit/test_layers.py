"""The layering, read from the source with `ast` (nothing is imported): what each package may import, and
no import cycle among first-party modules. Every import counts: at module level, inside a function, and
under `if TYPE_CHECKING:` (a cycle of types is still two modules that cannot be understood apart).

Layers, innermost first: trainer (runs on workers: no Prefect, no controller) < tasks < flows <
deployments < spotrun (the CLI: anything). `spotrun/__init__.py` and `spotrun/integrations/` are the
face a user's loop imports on a worker: the trainer, torch and the standard library only.

An edge goes to the module named: `from pkg import sub` is an edge to `pkg.sub` alone, so a package's
`__init__` that re-exports its submodules is no cycle with them. A backend a registry names by a string
(trainer/storage/registry.py) is no edge at all: it is imported when its scheme is first opened.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "tasks", "flows", "deployments", "spotrun", "bench")
CONTROLLER = {"prefect", "mlflow", "sqlalchemy", "alembic", "slack_sdk"}
FORBIDDEN = {
    "trainer": CONTROLLER | {"tasks", "flows", "deployments", "spotrun"},
    "tasks": {"flows", "deployments", "spotrun"},
    "flows": {"deployments", "spotrun"},
    "deployments": {"spotrun"},
}
WORKER_FACE_MAY = set(sys.stdlib_module_names) | {"trainer", "torch"}
# Cycles not broken yet, each with what keeps it and the edit that breaks it; the test fails when one of
# them is gone too (then delete its line).
KNOWN_CYCLES: dict[frozenset[str], str] = {}  # a cycle that must stay for a while: its modules, and why


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def sources() -> dict[str, Path]:
    """Every first-party module by name."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


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
        if m.split(".")[0] == package
        for line, name in found
        if name.split(".")[0] in FORBIDDEN[package]
    ]
    assert not bad, "\n".join(bad)


def test_the_worker_face_of_spotrun_imports_only_the_trainer() -> None:
    face = [m for m in imports() if m == "spotrun" or m.startswith("spotrun.integrations")]
    bad = [
        where(m, line, name)
        for m in face
        for line, name in imports()[m]
        if name.split(".")[0] not in WORKER_FACE_MAY and not name.startswith("spotrun.integrations")
    ]
    assert face and not bad, "\n".join(bad)


def test_no_import_cycle_but_the_known_ones() -> None:
    found = cycles()
    new = [", ".join(sorted(c)) for c in found - KNOWN_CYCLES.keys()]
    gone = [", ".join(sorted(c)) for c in KNOWN_CYCLES.keys() - found if c <= sources().keys()]
    assert not new, f"new import cycle(s): {new}; break each, or list it in KNOWN_CYCLES with why"
    assert not gone, f"no longer a cycle: {gone}; remove it from KNOWN_CYCLES"


@pytest.mark.parametrize(
    ("source", "module", "is_package", "expected"),
    [
        ("import torch.nn", "trainer.x", False, ["torch.nn"]),
        ("def f():\n    from trainer import storage", "trainer.x", False, ["trainer.storage"]),
        ("from trainer.storage import check_uri", "trainer.x", False, ["trainer.storage"]),
        ("if TYPE_CHECKING:\n    from trainer.spec import JobSpec", "trainer.x", False, ["trainer.spec"]),
        ("from . import local", "trainer.storage", True, ["trainer.storage.local"]),
        ("from .base import Storage", "trainer.storage.local", False, ["trainer.storage.base"]),
        ("from .. import errors", "trainer.storage.local", False, ["trainer.errors"]),
        ("try:\n    pass\nexcept E:\n    import prefect", "trainer.x", False, ["prefect"]),
        ("class A:\n    def f(self):\n        with x:\n            import mlflow", "m", False, ["mlflow"]),
    ],
)
def test_imports_are_read_wherever_they_are(
    source: str, module: str, is_package: bool, expected: list[str]
) -> None:
    assert [name for _, name in imports_of(source, module, is_package)] == expected
