"""trainer/checkpoint/safe_load.py: DCP's index through the allow-list unpickler, and the private torch names
it builds on (a torch upgrade that moves them fails here, not in a user's resume)."""

from __future__ import annotations

import inspect
import pickle
import re
import shutil
from pathlib import Path, PurePosixPath

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
    elif change == "range":
        md.storage_data[key] = type(info)(info.relative_path, info.offset, 10**9)
    elif change in ("huge", "chunk"):
        tensor = next(v for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))
        if change == "huge":  # a 1 TiB tensor in a checkpoint of a few KB: registered, it is an allocation
            tensor.size = torch.Size([2**20, 2**20])
        else:
            tensor.chunks[0].offsets = torch.Size([o + 10**6 for o in tensor.chunks[0].offsets])
    elif change == "planner":
        md.planner_data = {f"k{i}": ("model", f"k{i}") for i in range(10_000)}
    (d / ".metadata").write_bytes(pickle.dumps(md))
    for data in checkpoint.glob("*.distcp"):  # the files it indexes, whose sizes bound its own
        shutil.copyfile(data, d / data.name)
    return d


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ("escape", "'.' or '..' component"),
        ("unlisted", "is not a file of this checkpoint"),
        ("transform", "names stream transforms"),
        ("range", "reads bytes"),
        ("huge", "more than the checkpoint's"),
        ("chunk", "lies outside its tensor"),
        ("planner", "planner map is larger than its index"),
    ],
)
def test_an_index_naming_keys_or_sizes_outside_the_checkpoint_is_refused(
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


META = b"ctorch.distributed.checkpoint.metadata\n"


def _str(text: str) -> bytes:
    return b"X" + len(text).to_bytes(4, "little") + text.encode()


# Each a pickle that would act if unpickled by a plain Unpickler (or find_class's filter alone).
ACTING = [
    (  # BUILD on a class: setattr(PurePosixPath, "parents", None) for the whole process
        b"\x80\x02cpathlib\nPurePosixPath\nN}" + _str("parents") + b"Ns\x86b.",
        "refused to set attributes of type",
    ),
    (  # BUILD on an allowed instance that is no record of the index: a path that lies about itself
        b"\x80\x02cpathlib\nPosixPath\n"
        + _str("a")
        + b"\x85R}"
        + _str("_str")
        + _str("/etc/passwd")
        + b"sb.",
        "refused to set attributes of PosixPath",
    ),
    (  # a field that is not the dataclass's
        b"\x80\x02" + META + b"MetadataIndex\n)\x81}" + _str("__class__") + b"Nsb.",
        "refused to set ['__class__'] on MetadataIndex",
    ),
    (b"\x80\x02cbuiltins\nbytearray\nJ\x00\x00\x00@\x85R.", "refused to unpickle builtins.bytearray"),
    (pickle.dumps(torch.Size([1] * 100)), "a shape is up to 64 sizes"),
    (pickle.dumps(torch.Size([2**60])), "a shape is up to 64 sizes"),
    (b"\x80\x02" + META + b"MetadataIndex\n" + _str("a") + b"\x85R.", "refused to call MetadataIndex"),
    (b"\x80\x02" + META + b"MetadataIndex\n" + _str("a") + b"\x85\x81.", "refused to make a MetadataIndex"),
    (b"(ipathlib\nPosixPath\n.", "refused a protocol-0 object opcode"),
    (b"\x80\x02cposix\nsystem\n" + _str("touch MARKER") + b"\x85R.", "refused to unpickle posix.system"),
]


@pytest.mark.parametrize(("payload", "says"), ACTING)
def test_an_index_that_would_act_is_refused_before_it_does(
    tmp_path: Path, payload: bytes, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    before = inspect.getattr_static(PurePosixPath, "parents")
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(UnsafePickle, match=re.escape(says)):
        read_dcp_metadata(tmp_path)
    assert inspect.getattr_static(PurePosixPath, "parents") is before and not (tmp_path / "MARKER").exists()


def test_an_index_over_its_size_bound_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spotrun.trainer.checkpoint import safe_load

    monkeypatch.setattr(safe_load, "MAX_METADATA_BYTES", 100)
    (tmp_path / ".metadata").write_bytes(b"x" * 101)
    with pytest.raises(UnsafePickle, match="is 101 bytes, over 100"):
        read_dcp_metadata(tmp_path)
