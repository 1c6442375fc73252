"""The public API, pinned: what `spotrun` and its two integrations export. A name added or removed fails
here until PUBLIC (and CHANGELOG.md, for a removal or a move) says so. The user-facing docs import only
these names."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import spotrun

REPO = Path(__file__).resolve().parents[2]
PUBLIC = {
    "spotrun": [
        "ConfigError",
        "Parts",
        "RecipeContext",
        "SessionEnded",
        "__version__",
        "arg",
        "evaluating",
        "recipe",
        "sample_generator",
        "session",
        "warmup_cosine",
    ],
    "spotrun.integrations.transformers": ["SpotrunCallback"],
    "spotrun.integrations.lightning": ["SpotrunCallback"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_the_public_names_are_exactly_these(module: str) -> None:
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == PUBLIC[module], f"{module}.__all__ changed: update PUBLIC and CHANGELOG.md"
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert not missing, f"{module} exports {missing}, which it does not have"


def test_the_public_names_are_the_ones_the_docs_define() -> None:
    from spotrun.trainer.errors import ConfigError
    from spotrun.trainer.recipes import Parts, recipe
    from spotrun.trainer.recipes.data import sample_generator
    from spotrun.trainer.session.context import SessionEnded, session

    assert (spotrun.session, spotrun.SessionEnded, spotrun.ConfigError) == (
        session,
        SessionEnded,
        ConfigError,
    )
    assert (spotrun.Parts, spotrun.recipe, spotrun.sample_generator) == (Parts, recipe, sample_generator)
    assert "session" in dir(spotrun) and re.fullmatch(r"\d+\.\d+\.\d+.*|0\+unknown", spotrun.__version__)
    with pytest.raises(AttributeError, match="no attribute 'Session'"):
        spotrun.Session  # noqa: B018


def test_importing_spotrun_loads_neither_torch_nor_prefect() -> None:
    code = "import sys, spotrun; print(sorted(m for m in ('torch', 'prefect') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]


INTERNAL = re.compile(r"^\s*(?:from|import)\s+(spotrun\.(?!integrations\b)[\w.]+)", re.M)


def test_the_docs_import_only_public_names() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    bad = [f"{p.relative_to(REPO)}: {m}" for p in pages for m in INTERNAL.findall(p.read_text())]
    assert not bad, "the docs import internal modules (import from spotrun instead):\n" + "\n".join(bad)


def test_internal_rooms_declare_no_public_names() -> None:
    """Only the public modules have `__all__`: a room's `__init__` lists what it holds, not an API."""
    roots = [REPO / d for d in ("trainer", "tasks", "flows", "deployments")] + [REPO / "spotrun"]
    found = [
        str(p.relative_to(REPO))
        for root in roots
        for p in sorted(root.rglob("*.py"))
        if re.search(r"^__all__\s*=", p.read_text(), re.M)
    ]
    allowed = {
        "spotrun/__init__.py",
        "spotrun/integrations/transformers.py",
        "spotrun/integrations/lightning.py",
    }
    assert set(found) == allowed, sorted(set(found) - allowed)


def test_a_script_beside_its_own_trainer_py_imports_the_callbacks(tmp_path: Path) -> None:
    """A `command:` job's script runs as `python train.py`, its directory first on sys.path: a project's
    `trainer.py` and `tasks/` there are its own, and spotrun's callback still imports (it used to import
    a top-level `trainer` package, which such a file replaced)."""
    (tmp_path / "trainer.py").write_text("OWNER = 'project'\n")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "__init__.py").write_text("REGISTRY = {}\n")
    (tmp_path / "train.py").write_text(
        "import trainer, tasks\nfrom spotrun.integrations.transformers import SpotrunCallback\n"
        "print(trainer.OWNER, tasks.REGISTRY, SpotrunCallback.__module__)\n"
    )
    done = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["project", "{}", "spotrun.integrations.transformers"]
