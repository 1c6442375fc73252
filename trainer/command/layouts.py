"""Which complete checkpoints a script has written into `{checkpoint_dir}`, found without loading any.

Three layouts are recognised, each with its own sign that a checkpoint is complete:
- HF Transformers: a `checkpoint-N/` directory whose `trainer_state.json` (the Trainer writes it last)
  parses and says `global_step` N. Step N.
- Lightning: a `*.ckpt` file whose name holds `step=N`, unchanged in size and time since the previous
  look (Lightning writes it in place; spotrun's callback writes its notice save `spotrun-step=N.ckpt`
  whole and renames it into place). Step N.
- Anything else: a directory holding the marker file `SPOTRUN_COMPLETE`, written last, whose content is
  the step as a decimal number (or JSON `{"step": N}`). Step N; its files are the directory's.

A checkpoint is a set of files named by their paths under `{checkpoint_dir}`: restoring it puts them
back at the same paths, so the script's own resume logic (HF's `get_last_checkpoint`, Lightning's
`ckpt_path`) finds them where it left them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from spotrun.trainer.checkpoint.safe_names import MAX_DEPTH, name_problem

MARKER = "SPOTRUN_COMPLETE"
HF_STATE = "trainer_state.json"
_HF_DIR = re.compile(r"^checkpoint-(\d+)$")
_CKPT_STEP = re.compile(r"(?:^|[-_])step=(\d+)(?:[-_.]|$)")


@dataclass(frozen=True)
class Found:
    """One complete checkpoint of the script's: its step, which layout said so, and its files (paths
    relative to `{checkpoint_dir}`, sorted)."""

    step: int
    layout: str  # "transformers" | "lightning" | "marker"
    files: tuple[str, ...]


Seen = dict[str, tuple[int, int]]  # a .ckpt's path -> (size, mtime_ns) at the previous look


def find(root: Path, seen: Seen | None = None) -> list[Found]:
    """The complete checkpoints under `root`, oldest step first (one per step: the first layout that
    claims a step wins). `seen` carries Lightning files' sizes between looks (updated in place); without
    it a `.ckpt` counts as complete when it is found."""
    if not root.is_dir():
        return []
    by_step: dict[int, Found] = {}
    for found in [*_transformers(root), *_markers(root), *_lightning(root, seen)]:
        by_step.setdefault(found.step, found)
    return [by_step[s] for s in sorted(by_step)]


def _transformers(root: Path) -> list[Found]:
    out = []
    for d in root.iterdir():
        m = _HF_DIR.match(d.name)
        if m is None or not d.is_dir():
            continue
        try:
            state = json.loads((d / HF_STATE).read_bytes())
        except (OSError, ValueError):
            continue  # not yet written, or half written: the Trainer writes it last
        if isinstance(state, dict) and state.get("global_step") == int(m.group(1)):
            out.append(Found(int(m.group(1)), "transformers", _files(root, d)))
    return out


def _markers(root: Path) -> list[Found]:
    out = []
    for marker in root.rglob(MARKER):
        d = marker.parent
        if d == root or len(d.relative_to(root).parts) >= MAX_DEPTH:
            continue
        step = marker_step(marker)
        if step is not None:
            files = tuple(f for f in _files(root, d) if not f.endswith("/" + MARKER))
            out.append(Found(step, "marker", files))
    return out


def _lightning(root: Path, seen: Seen | None) -> list[Found]:
    out = []
    for f in root.rglob("*.ckpt"):
        m = _CKPT_STEP.search(f.name)
        if m is None or not f.is_file() or len(f.relative_to(root).parts) > MAX_DEPTH:
            continue
        st = f.stat()
        key, now = str(f), (st.st_size, st.st_mtime_ns)
        if seen is not None:
            before = seen.get(key)
            seen[key] = now
            if before != now:
                continue  # still being written, or new since the last look: complete once it holds still
        out.append(Found(int(m.group(1)), "lightning", (f.relative_to(root).as_posix(),)))
    return out


def marker_step(marker: Path) -> int | None:
    """The step a `SPOTRUN_COMPLETE` file names; None while it is empty or not a step."""
    try:
        text = marker.read_text().strip()
        value = json.loads(text).get("step") if text.startswith("{") else int(text)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value >= 0 else None


def _files(root: Path, d: Path) -> tuple[str, ...]:
    """Every regular file under `d`, as a path relative to `root`, that a manifest may name."""
    names = (p.relative_to(root).as_posix() for p in d.rglob("*") if p.is_file() and not p.is_symlink())
    return tuple(sorted(n for n in names if name_problem(n) is None))
