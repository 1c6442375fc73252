"""Two style rules of this code base, checked on its source (no import of it):

- a call to a first-party function or class passes at most 4 arguments by position; the trailing
  ones go by keyword (`f(store, job, step=..., world=...)`), so a reader need not count commas;
- `# fmt: skip` is followed, on its line, by `  # <reason>`: the formatter formats everything else.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "tasks", "flows", "spotrun", "deployments", "bench", "tests")
MAX_POSITIONAL = 4


@cache
def _sources() -> dict[Path, str]:
    return {p: p.read_text() for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _scan() -> tuple[set[str], set[str], list[tuple[Path, ast.Call, set[str]]]]:
    """One walk of each module: the names of the functions, methods and classes defined in
    first-party code; those of them of which some definition takes `*args` (a variadic call:
    `Sink.step(name, fn, *args)` forwards its positional arguments, `trainer(config, storage, workdir,
    *extra)` takes command-line words; the rule is not about what such a call collects); and the
    calls with more than 4 positional arguments, each with the names its module imports from
    third-party code (`from rich.progress import Progress`: a call of one of those there is not a
    call of the first-party name it shares)."""
    names: set[str] = set()
    variadic: set[str] = set()
    wide: list[tuple[Path, ast.Call, set[str]]] = []
    for path, src in _sources().items():
        elsewhere: set[str] = set()
        for node in ast.walk(ast.parse(src, str(path))):
            if isinstance(node, ast.Call):
                if sum(not isinstance(a, ast.Starred) for a in node.args) > MAX_POSITIONAL:
                    wide.append((path, node, elsewhere))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
                if node.args.vararg is not None:
                    variadic.add(node.name)
            elif isinstance(node, ast.ClassDef):
                names.add(node.name)
                for b in node.body:
                    if isinstance(b, ast.FunctionDef) and b.name == "__init__" and b.args.vararg is not None:
                        variadic.add(node.name)
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and node.module is not None
                and node.module.split(".")[0] not in PACKAGES
            ):
                elsewhere.update(a.asname or a.name for a in node.names)
    return names, variadic, wide


def _callee(call: ast.Call) -> str | None:
    """The name a call is resolved by: `f(...)`, `mod.f(...)`, `obj.method(...)`, `Class(...)`."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


# A name that first-party code also defines but that, called with many positional arguments, is a
# third-party method here: `view`, torch.Tensor.view(b, t, h, d, ...) in trainer/recipes/charlm.py,
# beside the shared-memory `view` of trainer/saving/shm.py.
THIRD_PARTY_HOMONYMS = frozenset({"view"})


def test_no_call_passes_more_than_four_positional_arguments_to_first_party_code() -> None:
    names, variadic, calls = _scan()
    wide = []
    for path, node, elsewhere in calls:
        name = _callee(node)
        if name is None or name not in names or name in variadic or name in THIRD_PARTY_HOMONYMS:
            continue
        if isinstance(node.func, ast.Name) and name in elsewhere:
            continue
        n = sum(not isinstance(a, ast.Starred) for a in node.args)
        wide.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}() with {n} positional arguments")
    assert not wide, "pass the trailing arguments by keyword:\n" + "\n".join(wide)


FMT_SKIP = re.compile(r"^#\s*fmt:\s*skip\b(?P<rest>.*)$")


def test_every_fmt_skip_says_why_on_its_line() -> None:
    bare = []
    for path, src in _sources().items():
        if "fmt:" not in src:
            continue
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):  # comments, not strings
            m = FMT_SKIP.match(tok.string) if tok.type == tokenize.COMMENT else None
            if m is not None and not re.match(r"  # \S", m.group("rest")):
                bare.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.line.strip()}")
    assert not bare, "`# fmt: skip` needs `  # <reason>` after it on the same line:\n" + "\n".join(bare)
