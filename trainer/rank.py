"""One rank forked by torchrun (`--run-path`, trainer/launch.py): `python -m trainer` with torch and the
training stack already imported. torchrun runs this file as `__main__` in the forked child and takes
a normal return as success; a non-zero exit code leaves as SystemExit, as a fresh rank's would."""

import sys

from trainer.__main__ import main

if __name__ == "__main__":
    code = main()
    if code:
        sys.exit(code)
