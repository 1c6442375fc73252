"""A stand-in for the worker's `python` that injects faults per attempt: a real process, no mocks.

LocalProviderConfig(python=<an executable script running this>) makes the local provider start
`<script> -m spotrun.trainer ...`. The plan (JSON, path in SPOTRUN_TEST_FAULT_PLAN) maps an attempt number to
  {"args": [...]}             extra trainer arguments, e.g. ["--inject-fault", "hang@40"]
  {"corrupt_after": true}     after the trainer exits, flip a byte in the newest committed checkpoint's
                              model.safetensors: the damage a bad disk or a torn upload leaves behind
Attempts are counted in a file beside the plan.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


def main() -> int:
    plan_path = Path(os.environ["SPOTRUN_TEST_FAULT_PLAN"])
    counter = plan_path.with_suffix(".count")
    attempt = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(attempt))
    step = json.loads(plan_path.read_text()).get(str(attempt), {})
    cmd = [sys.executable, *sys.argv[1:], *step.get("args", [])]
    if not step.get("corrupt_after"):
        os.execv(sys.executable, cmd)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the notice is for the trainer; this process outlives it
    code = subprocess.call(cmd, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    corrupt_newest(Path(sys.argv[sys.argv.index("--storage") + 1]))
    return 128 - code if code < 0 else code


def corrupt_newest(storage: Path) -> None:
    newest = max(p.parent for p in storage.glob("step_*/manifest.json"))
    f = newest / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    print(f"fault_python: corrupted {f}", file=sys.stderr, flush=True)


def install(directory: Path) -> Path:
    """Write an executable `python` wrapper into `directory` and return its path."""
    exe = directory / "fault-python"
    exe.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(Path(__file__).parents[2])!r})\n"
        "from tests.fakes.fault_python import main\nsys.exit(main())\n"
    )
    exe.chmod(0o755)
    return exe


if __name__ == "__main__":
    sys.exit(main())
