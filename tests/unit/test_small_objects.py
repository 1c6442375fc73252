"""Markers and records are read with a bound (trainer/storage/base.py `get_bytes`): a bucket writer's huge
`_standby.json`, heartbeat or marker is taken as malformed by its reader (absent, with a warning), not read
into memory whole."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spotrun.trainer.checkpoint.catalog import read_marker
from spotrun.trainer.preemption.handover import STANDBY_KEY, read_standby
from spotrun.trainer.preemption.lease import HANDOFF_KEY, read_handoff
from spotrun.trainer.storage import LocalStorage, base
from spotrun.trainer.storage.base import ObjectTooLarge, get_bytes, put_bytes
from spotrun.trainer.telemetry.heartbeat import heartbeat_key, read_heartbeat

LIMIT = 4096
HUGE = json.dumps({"step": 1, "pad": "x" * (2 * LIMIT)}).encode()  # valid JSON, only too large


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalStorage:
    monkeypatch.setattr(base, "SMALL_OBJECT_MAX", LIMIT)
    return LocalStorage(tmp_path / "store")


def test_get_bytes_reads_up_to_the_bound(store: LocalStorage) -> None:
    put_bytes(store, "small", b"x" * LIMIT)
    assert get_bytes(store, "small") == b"x" * LIMIT
    put_bytes(store, "big", b"x" * (LIMIT + 1))
    with pytest.raises(ObjectTooLarge, match=f"big in .* is over {LIMIT:,} bytes"):
        get_bytes(store, "big")


READERS: list[tuple[str, Callable[[Any], Any], Any]] = [
    (STANDBY_KEY, read_standby, None),
    (HANDOFF_KEY, read_handoff, []),
    (heartbeat_key("w-1"), lambda s: read_heartbeat(s, "w-1"), None),
    ("latest", lambda s: read_marker(s, "latest"), None),
]


@pytest.mark.parametrize(("key", "reader", "absent"), READERS, ids=[r[0] for r in READERS])
def test_a_huge_marker_is_taken_as_malformed(
    store: LocalStorage, key: str, reader: Callable[[Any], Any], absent: Any
) -> None:
    put_bytes(store, key, HUGE)
    assert reader(store) == absent
