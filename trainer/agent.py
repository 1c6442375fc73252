"""torchrun without its traceback: `python -m trainer.agent ARGS` is `python -m torch.distributed.run ARGS`.

When a rank fails, or a SIGTERM arrives, torchrun ends in an uncaught exception (ChildFailedError,
SignalException) whose traceback says nothing the ranks' exit records do not (trainer/launch.py
combines them); a user would read it as a crash of spotrun. Here it ends with exit code 1 instead.
`run_forked` is the same for an agent forked from the worker (trainer/launch.py, ForkedAgent).
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main


class _NoTraceback(logging.Filter):
    """torchrun logs a forked rank that exited non-zero with the traceback of its own `join()`, which
    says nothing about the rank; the line itself (rank, pid, exit code) stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def run_forked(args: list[str]) -> int:
    """torchrun's CLI in this (forked) process; its ranks fork from here and run trainer/rank.py."""
    import torch._dynamo  # noqa: F401  # every optimizer's first step imports it: once here, not per rank

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoTraceback())

    try:
        main(args)
    except (ChildFailedError, SignalException):
        return 1
    return 0


if __name__ == "__main__":
    try:
        main()
    except (ChildFailedError, SignalException):
        sys.exit(1)
