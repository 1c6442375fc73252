"""Checkpoint files written around the page cache (trainer/storage/direct.py): the bytes on disk are the
bytes given, whatever the size against the block and chunk grid, and a write the file system refuses
finishes through the cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer.ckpt_format import Codec, read_part, write_part
from trainer.digests import digest_file
from trainer.storage import LocalStorage, digest_of
from trainer.storage.direct import BLOCK, DirectFile, copy_direct, iter_direct

CHUNK = 1 << 20
SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, CHUNK, CHUNK + 5, 3 * CHUNK + BLOCK + 3]


@pytest.mark.parametrize("n", SIZES)
def test_written_copied_and_read_back_byte_for_byte(tmp_path: Path, n: int) -> None:
    data = os.urandom(n)
    f = DirectFile(tmp_path / "a", chunk=CHUNK)
    for i in range(0, n, 300_001):  # writes off every grid
        f.write(memoryview(data)[i : i + 300_001])
    f.close()
    assert f.size == n and (tmp_path / "a").read_bytes() == data
    copy_direct(tmp_path / "a", tmp_path / "b", chunk=CHUNK)
    assert (tmp_path / "b").read_bytes() == data
    chunks = list(iter_direct(tmp_path / "b", chunk=CHUNK))
    assert b"".join(chunks) == data and all(len(c) <= CHUNK for c in chunks)


def test_a_refused_direct_write_finishes_through_the_cache(tmp_path: Path) -> None:
    # a chunk off the block grid: the kernel refuses the O_DIRECT write (EINVAL), as a file system
    # that accepts the flag at open but not the I/O would
    data = os.urandom(3 * 5000 + 11)
    f = DirectFile(tmp_path / "odd", chunk=5000)
    f.write(data)
    f.close()
    assert not f.direct and (tmp_path / "odd").read_bytes() == data


def test_an_existing_file_is_replaced_not_overlaid(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * (3 * BLOCK))
    f = DirectFile(tmp_path / "f", chunk=CHUNK)
    f.write(b"short")
    f.close()
    assert (tmp_path / "f").read_bytes() == b"short"


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("codec", [Codec.SAFETENSORS, Codec.TORCH])
def test_a_part_has_its_size_and_digest_and_loads_either_way(
    tmp_path: Path, codec: Codec, direct: bool
) -> None:
    import torch

    state = {"w": torch.randn(300, 41), "n": torch.arange(5)}
    entry = write_part(tmp_path / "p", codec, state, 7, direct=direct)
    assert entry.size == (tmp_path / "p").stat().st_size and entry.digest == digest_file(tmp_path / "p")
    back = read_part(tmp_path / "p", codec)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_a_local_storage_writing_around_the_cache_stores_and_reads_back_the_same(tmp_path: Path) -> None:
    data = os.urandom(3 * CHUNK + 123)
    (tmp_path / "src").write_bytes(data)
    storage = LocalStorage(tmp_path / "store")
    storage.direct_writes = True
    storage.put("a/big", tmp_path / "src")
    assert (storage.root / "a" / "big").read_bytes() == data
    assert b"".join(storage.read("a/big")) == data  # read back from the disk: chunks of the contract's size
    assert digest_of(storage, "a/big") == (digest_file(tmp_path / "src"), len(data))
    storage.get("a/big", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == data
