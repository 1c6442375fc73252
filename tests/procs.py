"""Whether a process is gone, for the tests that check what dies with what."""

from __future__ import annotations

import os
import time
from pathlib import Path


def gone(pid: int) -> bool:
    """No such process, or a zombie nobody has reaped yet (an orphan whose reaper is slow)."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


def wait_gone(pid: int, timeout: float = 15) -> bool:
    """Whether `pid` is gone within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone(pid)


def descendants(root: int) -> list[int]:
    """Every process below `root`, from /proc (whatever session or group each put itself in)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
