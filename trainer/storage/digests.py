"""File digests: which algorithms a manifest may name, and hashing a file or a stored object.

New manifests use xxh3-128; format 1 manifests hold SHA-256, still verified. An unkeyed digest detects
damage, not tampering (whoever can rewrite a file can rewrite the manifest; trainer/checkpoint/signing.py
signs manifests for that), so speed decides. Measured on this kind of 2-core VM, 512 MB in memory, one
thread: xxh3-128 8.7 GB/s, BLAKE3 2.1 GB/s, SHA-256 1.27 GB/s (0.5 GB/s under load), a plain memory
copy 0.84 GB/s: hashing a 1 GB checkpoint costs ~0.1 s instead of ~0.8 s, on every save and resume.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import xxhash

DIGEST = "xxh3_128"
DIGESTS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def new_hasher(algo: str = DIGEST) -> Any:
    return DIGESTS[algo]()


def digest_chunks(chunks: Iterable[bytes], algo: str = DIGEST) -> tuple[str, int]:
    """(hex digest, byte count) of a stream."""
    h, n = new_hasher(algo), 0
    for chunk in chunks:
        h.update(chunk)
        n += len(chunk)
    return str(h.hexdigest()), n


def digest_files(path: Path, hashers: list[Any]) -> list[str]:
    """One mapped pass over a file into several hashers (the unkeyed digest and the keyed one)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:  # an empty file cannot be mapped
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                for h in hashers:
                    h.update(m)
    return [str(h.hexdigest()) for h in hashers]


def digest_file(path: Path, algo: str = DIGEST) -> str:
    """The file's digest, hashed straight from the page cache through a read-only mapping. read()
    copied every byte first, and the copy cost 4x the hash: 100 MB in 17 ms read in 4 MiB chunks, 4.3 ms
    mapped (xxh3-128 on this VM). A file truncated by another program while it is hashed would raise
    SIGBUS; nothing of spotrun's rewrites a file in place (every write is a temp file and a rename)."""
    h = new_hasher(algo)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:  # an empty file cannot be mapped
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                h.update(m)
    return str(h.hexdigest())
