"""torchrun without its traceback: `python -m spotrun.trainer.distributed.agent ARGS` is
`python -m torch.distributed.run ARGS`.

When a rank fails, or a SIGTERM arrives, torchrun ends in an uncaught exception (ChildFailedError,
SignalException) whose traceback says nothing the ranks' exit records do not (trainer/launch/start.py
combines them); a user would read it as a crash of spotrun. Here it ends with exit code 1 instead.
`run_forked` is the same for an agent forked from the worker (trainer/launch/start.py, ForkedAgent).
"""

from __future__ import annotations

import logging
import os
import socket
import sys

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

from spotrun.trainer.distributed.rendezvous import LOOPBACK, STORE_FD


class _NoTraceback(logging.Filter):
    """torchrun logs a forked rank that exited non-zero with the traceback of its own `join()`, which
    says nothing about the rank; the line itself (rank, pid, exit code) stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def loopback_store() -> TCPStore | None:
    """A one-node job's store, served on the loopback socket the launcher bound (`STORE_FD`): torchrun's
    static rendezvous in this process then shares it (same port, multi-tenant) instead of binding a
    server of its own to every interface. Keep it referenced while torchrun runs."""
    fd = os.environ.pop(STORE_FD, "")
    if not fd:
        return None
    with socket.socket(fileno=os.dup(int(fd))) as s:
        port = int(s.getsockname()[1])
    return TCPStore(
        LOOPBACK, port, is_master=True, multi_tenant=True, master_listen_fd=int(fd), wait_for_workers=False
    )


def run_forked(args: list[str]) -> int:
    """torchrun's CLI in this (forked) process; its ranks fork from here and run trainer/rank.py."""
    import torch._dynamo  # noqa: F401  # every optimizer's first step imports it: once here, not per rank

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoTraceback())
    store = loopback_store()  # noqa: F841  # served while torchrun runs

    try:
        main(args)
    except (ChildFailedError, SignalException):
        return 1
    return 0


if __name__ == "__main__":
    _store = loopback_store()  # served while torchrun runs
    try:
        main()
    except (ChildFailedError, SignalException):
        sys.exit(1)
