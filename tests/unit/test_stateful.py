"""The registry of checkpoint parts: the protocol, the file layout, and leftovers as errors (tables)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from spotrun.trainer.checkpoint.format import REQUIRED_FILES, Manifest, rng_file
from spotrun.trainer.checkpoint.state import RngState
from spotrun.trainer.checkpoint.stateful import (
    Expectation,
    Registry,
    Stateful,
    check_compat,
    reconcile,
    spec_of_file,
)
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.recipes.data import Position
from tests.fakes.extra_recipe import Calls as Counter


def _parts() -> dict[str, Any]:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        "scaler": torch.amp.GradScaler("cpu"),
        "rng": RngState(torch.device("cpu")),
        "trainer": Position(),
    }


def test_every_standard_part_and_a_plain_object_satisfy_the_protocol() -> None:
    for name, obj in [*_parts().items(), ("counter", Counter())]:
        assert isinstance(obj, Stateful), name
    assert not isinstance(object(), Stateful)


def test_registry_keeps_capture_order_and_names_each_rank_file() -> None:
    reg = Registry(3, _parts(), {"ema": Counter()})
    assert list(reg) == ["model", "optimizer", "scheduler", "scaler", "rng", "trainer", "ema"]
    assert reg.files()["rng"] == "rng.rank3.pt" == rng_file(3)
    assert reg.files()["ema"] == "extra.ema.pt"
    assert reg.capture()["ema"] == {"n": 0}


@pytest.mark.parametrize(
    ("name", "obj", "error"),
    [
        ("model", Counter(), "none of"),
        ("has space", Counter(), "use letters, digits"),
        ("x/y", Counter(), "use letters, digits"),
        ("ema", object(), r"'ema' \(object\) is not Stateful: give it state_dict\(\)"),
    ],
)
def test_bad_extra_state_is_a_config_error_naming_it(name: str, obj: Any, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        Registry(0, _parts(), {name: obj})


@pytest.mark.parametrize(
    ("fname", "part"),
    [
        ("model.safetensors", "model"),
        ("optimizer.pt", "optimizer"),
        ("scaler.pt", "scaler"),
        ("rng.rank0.pt", "rng"),
        ("rng.rank12.pt", "rng"),
        ("trainer.pt", "trainer"),
        ("extra.ema.pt", "ema"),
        ("extra..pt", None),
        ("rng.rankX.pt", None),
        ("notes.txt", None),
    ],
)
def test_which_part_a_file_holds(fname: str, part: str | None) -> None:
    spec = spec_of_file(fname)
    assert (spec.name if spec else None) == part


def test_required_files_are_the_v1_list() -> None:
    assert REQUIRED_FILES == ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer.pt")


V1 = ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng.rank0.pt", "trainer.pt"]
WANT = {
    "model": "model.safetensors",
    "optimizer": "optimizer.pt",
    "scheduler": "scheduler.pt",
    "rng": "rng.rank0.pt",
    "trainer": "trainer.pt",
}


@pytest.mark.parametrize(
    ("wanted", "present", "missing", "leftovers"),
    [
        (WANT, V1, [], []),
        ({**WANT, "ema": "extra.ema.pt"}, V1, ["'ema' (extra.ema.pt)"], []),
        (WANT, [*V1, "extra.ema.pt"], [], ["'ema' (extra.ema.pt)"]),
        (WANT, [*V1, "stray.bin"], [], ["'stray.bin'"]),
        (WANT, [f for f in V1 if f != "rng.rank0.pt"], ["'rng' (rng.rank0.pt)"], []),
        # optional: the scaler may be absent (AMP switched on) or unused (AMP switched off)
        ({**WANT, "scaler": "scaler.pt"}, V1, [], []),
        (WANT, [*V1, "scaler.pt"], [], []),
        # another rank's RNG belongs to that rank, not left over
        (WANT, [*V1, "rng.rank1.pt"], [], []),
    ],
)
def test_reconcile_names_missing_and_leftover_parts(
    wanted: dict[str, str], present: list[str], missing: list[str], leftovers: list[str]
) -> None:
    assert reconcile(wanted, present) == (missing, leftovers)


_SAVED = {"recipe": "digits", "args": {"hidden": 32, "lr": 0.003}, "seed": 0, "batch_size": 64, "amp": False}


@pytest.mark.parametrize(
    ("new", "world", "allow", "reshard", "found"),
    [
        ({}, 1, False, False, None),
        (
            {"args": {"hidden": 64, "lr": 0.003}},
            1,
            True,
            False,
            "different shape settings (args.hidden 32 -> 64)",
        ),
        (
            {"args": {"hidden": 32, "lr": 0.001}},
            1,
            False,
            False,
            "different training settings (args.lr 0.003 -> 0.001); restore them, or pass --allow-changes",
        ),
        ({"seed": 7}, 1, False, False, "different training settings (seed 0 -> 7)"),
        ({"seed": 7, "batch_size": 32}, 1, True, False, None),  # allowed
        ({}, 2, False, False, "was written by 1 rank(s) and this run has 2; set distributed.allow_reshard"),
        ({}, 2, False, True, None),
        ({"seed": 7}, 2, True, False, "was written by 1 rank(s)"),  # allow_changes is not allow_reshard
        ({"args": {"hidden": 64, "lr": 0.003}}, 2, True, True, "different shape settings"),  # shape wins
    ],
)
def test_compat_refuses_shape_always_trajectory_unless_allowed(
    new: dict[str, Any], world: int, allow: bool, reshard: bool, found: str | None
) -> None:
    m = Manifest(step=5, spec_hash="a", shape_hash="b", world_size=1, files={})
    expect = Expectation(
        spec={**_SAVED, **new},
        shape_args=frozenset({"hidden"}),
        allow_changes=allow,
        world_size=world,
        allow_reshard=reshard,
    )
    findings = check_compat(_SAVED, m, expect)
    if found is None:
        assert findings == []
    else:
        assert [k for k, _ in findings] == ["compat"] and found in findings[0][1], findings
