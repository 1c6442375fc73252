"""Copies of the state to a warm standby (trainer/saving/peer.py), over a real loopback socket: found
through the signed standby record, confirmed, committed as an ordinary checkpoint only when newer than
the store's, and refused when hostile (a wrong token, a name outside the step directory, a sidecar
outside the metrics prefix, more bytes than the standby's cap, an address a bucket writer chose)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from spotrun.trainer.checkpoint.catalog import Catalog
from spotrun.trainer.checkpoint.format import MANIFEST
from spotrun.trainer.checkpoint.state import capture_rng
from spotrun.trainer.preemption.handover import Advert, read_standby, write_standby
from spotrun.trainer.saving.peer import PeerReceiver, PeerSender, address_problem
from spotrun.trainer.storage import get_bytes, open_storage
from spotrun.trainer.telemetry.metrics_log import metrics_key


def _state(step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 2)
    meta = {"step": step, "rank": 0, "world_size": 1, "spec": {}, "shape_hash": "h" * 8}
    snap = {
        "model": model.state_dict(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1).state_dict(),
        "scheduler": {"last_epoch": step},
        "scaler": None,
        "rng": capture_rng(torch.device("cpu")),
        "trainer": meta,
    }
    return snap, {"step": step, "spec_hash": "s" * 8, "shape_hash": "h" * 8, "world_size": 1}


def _wait(cond: Any, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_a_copy_is_found_confirmed_and_committed_only_when_newer(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "store"))
    receiver = PeerReceiver(tmp_path / "recv", max_bytes=10 << 20)
    write_standby(storage, "w1", "waiting", "w2", peer=receiver.advert)
    assert read_standby(storage).peer == receiver.advert  # type: ignore[union-attr]
    sender = PeerSender(storage, "w1", tmp_path / "send", every_s=0.01)
    time.sleep(0.02)
    assert sender.due()
    for step in (12, 15):
        snap, base = _state(step)
        sender.send(snap, base, {metrics_key(step): b'{"step": 1}\n'})
        _wait(lambda s=step: sender.acked == s)  # type: ignore[misc]
    sender.close()
    assert receiver.newest is not None and receiver.newest[0] == 15
    assert [p.name for p in (tmp_path / "recv").iterdir()] == ["15"]  # only the newest is kept
    assert receiver.commit(storage) == 15
    listed = Catalog(storage).list()
    assert listed[15].committed
    assert get_bytes(storage, metrics_key(15)) == b'{"step": 1}\n'  # its steps' metrics came along
    # a standby whose copy is not newer than the store's newest checkpoint leaves the store alone
    again = PeerReceiver(tmp_path / "recv2", max_bytes=10 << 20)
    write_standby(storage, "w1", "waiting", "w3", peer=again.advert)
    late = PeerSender(storage, "w1", tmp_path / "send2", every_s=0.01)
    time.sleep(0.02)
    assert late.due()
    snap, base = _state(14)
    late.send(snap, base, {})
    _wait(lambda: late.acked == 14)
    assert again.commit(storage) is None and 14 not in Catalog(storage).list()


def _offer(advert: Advert, header: dict[str, Any], body: bytes) -> bytes:
    with socket.create_connection(tuple(advert.addr.rsplit(":", 1)), timeout=5) as c:  # type: ignore[arg-type]
        c.sendall(json.dumps(header).encode() + b"\n" + body)
        c.shutdown(socket.SHUT_WR)
        return c.recv(64)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"token": "0" * 32}, "token"),
        ({"files": [["../../etc/x", 3]]}, "name"),
        ({"files": [["/abs", 3]]}, "absolute"),
        ({"sidecars": [["_lease.json", 3]]}, "sidecar"),
        ({"files": [["model.safetensors", 1 << 30]]}, "over"),
    ],
)
def test_a_hostile_copy_is_refused(tmp_path: Path, change: dict[str, Any], why: str) -> None:
    receiver = PeerReceiver(tmp_path / "recv", max_bytes=1 << 20)
    header = {"token": receiver.advert.token, "step": 5, "files": [[MANIFEST, 3]], "sidecars": [], **change}
    assert _offer(receiver.advert, header, b"abc") == b""  # no confirmation
    time.sleep(0.1)
    assert receiver.newest is None and not (tmp_path / "etc").exists()
    receiver.close()


@pytest.mark.parametrize(
    ("addr", "ok"),
    [
        ("127.0.0.1:5000", True),
        ("10.1.2.3:5000", True),
        ("[::1]:5000", True),
        ("8.8.8.8:5000", False),
        ("example.com:5000", False),
        ("169.254.169.254:80", False),
        ("127.0.0.1", False),
        ("127.0.0.1:0", False),
    ],
)
def test_copies_go_only_to_a_loopback_or_private_ip(addr: str, ok: bool) -> None:
    assert (address_problem(addr) is None) is ok


def test_a_sender_does_not_send_to_a_public_address_a_bucket_names(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "store"))
    write_standby(storage, "w1", "waiting", "w2", peer=Advert("8.8.8.8:443", "t" * 32))
    sender = PeerSender(storage, "w1", tmp_path / "send", every_s=0.01)
    time.sleep(0.02)
    assert not sender.due()  # so nothing is ever written or sent
    assert not (tmp_path / "send").exists()
