"""trainer/checkpoint/safe_load.py: DCP's index through the allow-list unpickler, and the private torch names
it builds on (a torch upgrade that moves them fails here, not in a user's resume)."""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, default_planner, state_dict_loader
from torch.distributed.checkpoint.state_dict import get_state_dict

from spotrun.trainer.checkpoint.safe_load import (
    SafeFullLoadPlanner,
    SafeLoadPlanner,
    UnsafePickle,
    load_full_state,
    read_dcp_metadata,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dcp")
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(d))
    return d


def test_the_private_names_it_overrides_are_still_there() -> None:
    assert callable(state_dict_loader._load_state_dict)
    assert issubclass(default_planner._EmptyStateDictLoadPlanner, default_planner.DefaultLoadPlanner)
    assert "set_element" in vars(default_planner)  # what DefaultLoadPlanner.load_bytes calls
    overridden = ((FileSystemReader, "read_metadata"), (default_planner.DefaultLoadPlanner, "load_bytes"))
    for base, method in overridden:
        assert method in vars(base), f"torch moved {base.__name__}.{method}"
    assert "weights_only=False" in inspect.getsource(default_planner.DefaultLoadPlanner.load_bytes)
    assert "pickle.load" in inspect.getsource(FileSystemReader.read_metadata)
    assert SafeLoadPlanner.load_bytes is not default_planner.DefaultLoadPlanner.load_bytes
    assert SafeFullLoadPlanner.load_bytes is not default_planner.DefaultLoadPlanner.load_bytes


def test_a_real_index_reads_and_the_whole_state_loads(checkpoint: Path) -> None:
    md = read_dcp_metadata(checkpoint, {"__0_0.distcp", ".metadata"})
    assert any(k.startswith("model.") for k in md.state_dict_metadata)
    state = load_full_state(checkpoint, keys=("model",))
    assert set(state) == {"model"} and state["model"]["weight"].shape == (2, 3)
    assert load_full_state(checkpoint)["optimizer"]["param_groups"][0]["lr"] == 0.001


def _rewritten(checkpoint: Path, tmp: Path, change: str) -> Path:
    d = tmp / change
    d.mkdir()
    md = pickle.loads((checkpoint / ".metadata").read_bytes())
    key = next(iter(md.storage_data))
    info = md.storage_data[key]
    if change == "escape":
        md.storage_data[key] = type(info)("../../etc/passwd", info.offset, info.length)
    elif change == "unlisted":
        md.storage_data[key] = type(info)("__9_0.distcp", info.offset, info.length)
    elif change == "transform":
        md.storage_data[key] = type(info)(info.relative_path, info.offset, info.length, ["zstd"])
    (d / ".metadata").write_bytes(pickle.dumps(md))
    return d


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ("escape", "'.' or '..' component"),
        ("unlisted", "is not a file of this checkpoint"),
        ("transform", "names stream transforms"),
    ],
)
def test_an_index_naming_keys_outside_the_checkpoint_is_refused(
    checkpoint: Path, tmp_path: Path, change: str, says: str
) -> None:
    with pytest.raises(UnsafePickle, match=says):
        read_dcp_metadata(_rewritten(checkpoint, tmp_path, change), {"__0_0.distcp", ".metadata"})


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (pickle.dumps(print), "refused to unpickle builtins.print"),
        (pickle.dumps({"a": 1}), "holds a dict, not DCP's Metadata"),
        (b"not a pickle", "is not a DCP index"),
    ],
)
def test_anything_but_an_index_is_refused(tmp_path: Path, payload: bytes, says: str) -> None:
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(ValueError, match=says):
        read_dcp_metadata(tmp_path)
