"""A one-node job's torchrun store listens on loopback only (Linux: /proc/net/tcp*).

torchrun's static rendezvous creates its store as `TCPStore(addr, port, ..., multi_tenant=True)`;
`trainer.distributed.agent.loopback_store` serves that port first, from the socket the launcher bound to
127.0.0.1, so the rendezvous shares it. Checked here in-process, the way the agent does it; the
distributed end-to-end tests run the same through torchrun.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from spotrun.trainer.distributed.agent import loopback_store
from spotrun.trainer.launch.start import STORE_FD, loopback_listener

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net")
LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net has them


def listening_hosts(port: int) -> set[str]:
    """The local addresses (hex) of every socket on this host listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            host, _, hexport = cols[1].partition(":")
            if cols[3] == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                found.add(host)
    return found


def listeners_of(pids: list[int]) -> set[str]:
    """The local addresses (hex host:port) those processes listen on; a process gone meanwhile has none."""
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except FileNotFoundError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except FileNotFoundError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                found.add(cols[1])
    return found


def test_torchruns_own_store_would_listen_on_every_interface() -> None:
    """Why: a TCPStore server binds the wildcard address, whatever host it is given."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert listening_hosts(store.port) - LOOPBACK  # "::" or 0.0.0.0


def test_the_one_node_store_listens_on_loopback_and_torchrun_shares_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listener = loopback_listener()
    port = listener.getsockname()[1]
    monkeypatch.setenv(STORE_FD, str(listener.fileno()))
    store = loopback_store()
    assert store is not None
    rendezvous = TCPStore("127.0.0.1", port, 1, True, multi_tenant=True)  # as torchrun's static rendezvous
    rendezvous.set("k", "v")
    assert store.get("k") == b"v"  # one server
    assert listening_hosts(port) == {"0100007F"}
