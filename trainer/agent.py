"""torchrun without its traceback: `python -m trainer.agent ARGS` is `python -m torch.distributed.run ARGS`.

When a rank fails, or a SIGTERM arrives, torchrun ends in an uncaught exception (ChildFailedError,
SignalException) whose traceback says nothing the ranks' exit records do not (trainer/launch.py
combines them); a user would read it as a crash of spotrun. Here it ends with exit code 1 instead.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    except (ChildFailedError, SignalException):
        sys.exit(1)
