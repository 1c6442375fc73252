"""What is installed: one import package, `spotrun`, whose subpackages are the repository's rooms
(pyproject.toml's explicit list, checked against the tree), and the version that keys what outlives a job
(a trainer pool's fork server)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from spotrun.tasks.providers.local.pool import differences
from spotrun.trainer.interpreter import spotrun_version
from spotrun.trainer.launch.zygote import VERSION_KEY, load_key

REPO = Path(__file__).resolve().parents[2]
ROOMS = {
    "spotrun": "spotrun",
    "trainer": "spotrun.trainer",
    "tasks": "spotrun.tasks",
    "flows": "spotrun.flows",
}
ROOMS |= {"deployments": "spotrun.deployments"}


def _packages_in_the_tree() -> set[str]:
    found = set()
    for folder, name in ROOMS.items():
        for d, _, files in os.walk(REPO / folder):
            if "__init__.py" in files:
                rel = Path(d).relative_to(REPO / folder)
                found.add(".".join([name, *rel.parts]))
    return found


def test_the_package_list_is_every_package_of_the_rooms() -> None:
    """setuptools' `packages.find` does not map subpackages (pypa/setuptools#4248): a package added to a
    room must be listed in pyproject.toml, or the wheel silently lacks it."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {name: folder for folder, name in ROOMS.items()}
    listed = set(tool["packages"])
    assert listed == _packages_in_the_tree(), (
        f"add to pyproject.toml: {sorted(_packages_in_the_tree() - listed)}"
    )
    assert all(p == "spotrun" or p.startswith("spotrun.") for p in listed)


def test_a_pool_started_by_another_spotrun_is_another_load_key() -> None:
    """A pool's fork server outlives the job that started it: after an upgrade it would fork the old code.
    Its key holds the version it loaded, so a job of another version gets a private server, and the
    warning names what differs."""
    ours = load_key("/py", {"OMP_NUM_THREADS": "1", "HOME": "/h"})
    assert ours == ("/py", tuple(sorted([("OMP_NUM_THREADS", "1"), (VERSION_KEY, spotrun_version())])))
    older = (ours[0], tuple((k, "0.1.0" if k == VERSION_KEY else v) for k, v in ours[1]))
    assert older != ours and differences(ours, older) == VERSION_KEY
