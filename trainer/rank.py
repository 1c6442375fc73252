"""One rank forked by torchrun (`--run-path`, trainer/launch/start.py): `python -m spotrun.trainer` with torch
and the training stack already imported. torchrun runs this file as `__main__` in the forked child and takes a
normal return as success; a non-zero exit code leaves as SystemExit, as a fresh rank's would.

What a fresh rank would have from its start-up is set here: OpenMP's thread count (read from
OMP_NUM_THREADS once, when torch was imported in the worker, so the launcher's value would be ignored
by a job that leaves `threads` unset) and default handlers for the signals torchrun turned into
exceptions in itself (SIGHUP, SIGQUIT). Once main() has returned, torch keeps the rank waiting until
every rank is done: SIGTERM and SIGINT then end it at once, as they would a fresh rank that had
already exited, instead of reaching a stop request nobody reads (torchrun would SIGKILL it 30 s later).
"""

import os
import signal
import sys

import torch

from spotrun.trainer.__main__ import main

if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for sig in (signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    code = main()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    if code:
        sys.exit(code)
