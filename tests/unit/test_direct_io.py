"""Files written around the page cache hold exactly the bytes given, whatever their sizes, and where
there is no O_DIRECT."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spotrun.trainer.storage import direct_io
from spotrun.trainer.storage.direct_io import ALIGN, DirectFile


@pytest.mark.parametrize(
    "sizes",
    [[0], [1], [ALIGN], [ALIGN + 1], [3, 5000, 1, 2 * ALIGN - 7], [direct_io.BUFFER_BYTES + 123, 17]],
    ids=["empty", "one-byte", "one-block", "block-and-a-byte", "odd-pieces", "more-than-the-buffer"],
)
def test_the_file_holds_what_was_written(tmp_path: Path, sizes: list[int]) -> None:
    pieces = [os.urandom(n) for n in sizes]
    f = DirectFile(tmp_path / "x.bin")
    for p in pieces:
        assert f.write(memoryview(p)) == len(p)
    f.close()
    assert (tmp_path / "x.bin").read_bytes() == b"".join(pieces)


def test_tmpfs_holds_what_was_written() -> None:
    """tmpfs refused O_DIRECT before Linux 6.6 (EINVAL: then a buffered file) and takes it since."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no tmpfs at /dev/shm")
    path = shm / f"spotrun-direct-{os.getpid()}.bin"
    try:
        f = DirectFile(path)
        f.write(b"abc" * 5000)
        f.close()
        assert path.read_bytes() == b"abc" * 5000
    finally:
        path.unlink(missing_ok=True)


def test_without_o_direct_a_buffered_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "O_DIRECT")  # not Linux
    f = DirectFile(tmp_path / "x.bin")
    assert not f.direct
    f.write(b"abc" * 5000)
    f.close()
    assert (tmp_path / "x.bin").read_bytes() == b"abc" * 5000
