"""`spotrun checkpoints list|verify`: what a storage root holds, and whether it is safe to resume from."""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

from trainer.catalog import fetch, list_checkpoints, read_latest
from trainer.ckpt_format import load_part, step_dir
from trainer.errors import ConfigError
from trainer.spec import JobSpec, S3Options, load_spec, parse_spec
from trainer.storage import Storage, open_storage
from trainer.validate import Expectation, Problem, read_manifest, validate_dir

if TYPE_CHECKING:  # imported where used: `spotrun checkpoints` must not load SQLAlchemy or Prefect
    pass

from spotrun.console import (
    EXIT_FINDINGS,
    EXIT_OK,
    Subparsers,
    size_text,
    wide_console,
)

log = logging.getLogger(__name__)


# ---- checkpoints: what a storage root holds, and whether it is safe to resume from ----


@dataclass
class Row:
    """One step directory as `checkpoints list` reports it."""

    step: int
    size: int
    committed: bool
    latest: bool
    problems: list[Problem] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return self.committed and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "size": self.size,
            "committed": self.committed,
            "latest": self.latest,
            "valid": self.valid,
            "problems": [{"kind": p.kind, "file": p.file, "detail": p.detail} for p in self.problems],
            "metrics": self.metrics,
        }


class Expectations:
    """The structure a checkpoint must have: from --spec when given, else from the spec it carries.

    Built recipes are cached by shape hash: every checkpoint of one job shares one."""

    def __init__(self, spec: JobSpec | None) -> None:
        self.fixed = Expectation.for_spec(spec) if spec is not None else None
        self._by_shape: dict[str, Expectation | None] = {}

    def for_dir(self, d: Path) -> Expectation | None:
        if self.fixed is not None:
            return self.fixed
        spec = _embedded_spec(d)
        if spec is None:
            return None
        key = spec.shape_hash()
        if key not in self._by_shape:
            try:
                self._by_shape[key] = Expectation.for_spec(spec)
            except ConfigError as e:  # e.g. a user recipe not importable here: check integrity only
                log.info("not checking structure of %s against its recipe: %s", d.name, e)
                self._by_shape[key] = None
        return self._by_shape[key]


def _embedded_spec(d: Path) -> JobSpec | None:
    """The job spec stored in a checkpoint's trainer.pt, or None when it cannot be read."""
    try:
        meta = load_part(d / "trainer.pt")["state"]
        return parse_spec(meta["spec"], source=f"{d.name}/trainer.pt")
    except Exception:  # a damaged or foreign trainer.pt: validate_dir reports it; check without a recipe
        return None


def inspect_step(storage: Storage, step: int, cache: Path, expect: Expectations) -> list[Problem]:
    """Fetch one committed checkpoint into `cache` and validate it."""
    path = fetch(storage, step, cache)
    return validate_dir(path, expect.for_dir(path))


def list_rows(storage: Storage, cache: Path, expect: Expectations) -> list[Row]:
    """Every step directory under the storage root, newest first, each validated when committed."""
    latest = read_latest(storage)
    rows = []
    for step, listed in sorted(list_checkpoints(storage).items(), reverse=True):
        row = Row(step, sum(listed.files.values()), listed.committed, step == latest)
        if listed.committed:
            try:
                row.problems = inspect_step(storage, step, cache, expect)
            except FileNotFoundError:  # deleted by a running trainer's retention since the listing
                continue
            manifest, _ = read_manifest(cache / step_dir(step))
            row.metrics = manifest.metrics if manifest is not None else {}
        rows.append(row)
    return rows


def cmd_checkpoints_list(args: argparse.Namespace) -> int:
    """`spotrun checkpoints list`: a table (or JSON) of every checkpoint and whether it is valid."""
    with _checkpoint_context(args) as (storage, cache, expect):
        rows = list_rows(storage, cache, expect)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
    else:
        print_rows(storage.uri, rows)
    return EXIT_OK


def cmd_checkpoints_verify(args: argparse.Namespace) -> int:
    """`spotrun checkpoints verify`: exit 0 only when the newest committed checkpoint is valid."""
    with _checkpoint_context(args) as (storage, cache, expect):
        listed = list_checkpoints(storage)
        committed = sorted((s for s, c in listed.items() if c.committed), reverse=True)
        if not committed:
            partial = f" ({len(listed)} incomplete step directories)" if listed else ""
            print(f"no committed checkpoint in {storage.uri}{partial}")
            return EXIT_FINDINGS
        step = committed[0]
        problems = inspect_step(storage, step, cache, expect)
    if not problems:
        print(f"step {step} in {storage.uri}: valid")
        return EXIT_OK
    for p in ranked(problems):
        print(f"step {step}: {p.kind}: {p}")
    return EXIT_FINDINGS


@contextmanager
def _checkpoint_context(args: argparse.Namespace) -> Iterator[tuple[Storage, Path, Expectations]]:
    spec = load_spec(args.spec) if args.spec else None
    uri = args.uri or (spec.storage if spec is not None else None)
    if uri is None:
        raise ConfigError("give a storage URI (a directory or s3://bucket/prefix), or --spec JOB.yaml")
    s3 = spec.s3 if spec is not None else S3Options()
    updates = {k: v for k, v in (("endpoint_url", args.endpoint_url), ("region", args.region)) if v}
    storage = open_storage(uri, s3.model_copy(update=updates), create=False)
    expect = Expectations(spec)
    with tempfile.TemporaryDirectory(prefix="spotrun-ckpt-") as cache:
        yield storage, Path(cache), expect


def print_rows(uri: str, rows: list[Row]) -> None:
    """Render `checkpoints list` as a table."""
    out = wide_console()
    if not rows:
        out.print(f"no checkpoints in {uri}", markup=False)
        return
    table = Table(title=f"checkpoints in {escape(uri)}", title_justify="left")
    for name in ("step", "size"):
        table.add_column(name, justify="right")
    for name in ("committed", "latest", "valid", "metrics"):
        table.add_column(name, overflow="fold")
    for r in rows:
        if not r.committed:
            valid = "[yellow]- (no manifest: partial write)[/]"
        elif r.valid:
            valid = "[green]yes[/]"
        else:
            valid = f"[red]no: {escape(_summary(r.problems))}[/]"
        metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(r.metrics.items()))
        committed = "yes" if r.committed else "no"
        table.add_row(str(r.step), size_text(r.size), committed, "latest" if r.latest else "", valid, metrics)
    out.print(table)


def _summary(problems: list[Problem], most: int = 3) -> str:
    shown = "; ".join(str(p) for p in ranked(problems)[:most])
    return shown + (f" (+{len(problems) - most} more)" if len(problems) > most else "")


def ranked(problems: list[Problem]) -> list[Problem]:
    """Problems in the order that explains them: a different job's checkpoint first, then damage."""
    order = {"compat": 0, "integrity": 1, "structure": 2, "content": 3}
    return sorted(problems, key=lambda p: order[p.kind])


def add_checkpoints(sub: Subparsers) -> None:
    p = sub.add_parser("checkpoints", help="list and verify the checkpoints under a storage URI")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, handler, help_ in (
        ("list", cmd_checkpoints_list, "every step directory, its size, validity and metrics"),
        ("verify", cmd_checkpoints_verify, "exit 0 only when the newest committed checkpoint is valid"),
    ):
        q = actions.add_parser(name, help=help_, description=help_)
        q.add_argument(
            "uri", nargs="?", help="directory, file:// URI or s3://bucket/prefix (default: the spec's)"
        )
        q.add_argument("--spec", metavar="JOB.yaml", help="check structure against this job's recipe")
        q.add_argument("--endpoint-url", help="S3-compatible endpoint (credentials from the environment)")
        q.add_argument("--region", help="S3 region")
        if name == "list":
            q.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
        q.set_defaults(handler=handler)
