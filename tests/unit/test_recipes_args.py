"""A recipe that declares its args (`@recipe(args=...)`) has an unknown one refused before it is built,
with the arg it likely meant; one that declares none is left to its own checks in `build`."""

from __future__ import annotations

from typing import Any

import pytest

from spotrun.trainer import recipes
from spotrun.trainer.errors import ConfigError


@pytest.mark.parametrize(
    ("name", "args", "says"),
    [
        ("digits", {"hidden": 8}, None),
        ("digits", {}, None),
        ("digits", {"hiden": 8}, "recipe 'digits' has no argument 'hiden': did you mean 'hidden'?"),
        ("digits", {"hidden": 8, "hiden": 8}, "'hiden': digits takes ["),  # 'hidden' is given already
        ("digits", {"zz": 1, "lrr": 1}, "'lrr' (and 'zz'): did you mean 'lr'?"),
        ("charlm", {"d_modle": 8}, "did you mean 'd_model'?"),
        ("tests.fakes.extra_recipe:build", {"anything": 1}, None),  # declares nothing: its own checks
    ],
)
def test_check_args(name: str, args: dict[str, Any], says: str | None) -> None:
    if says is None:
        recipes.check_args(name, args)
        return
    with pytest.raises(ConfigError) as e:
        recipes.check_args(name, args)
    assert says in str(e.value) and str(e.value).endswith("(fix args in the job file)")
