"""`spotrun checkpoints list|verify`: what a storage root holds, and whether it is safe to resume from.

Both read through trainer.checkpoint.catalog.Catalog and build no model by default: integrity, content, and
with --spec whether the checkpoints are this job's (its shape hash). `verify --structure` also builds the
job's recipe on CPU (user code, a dataset) and checks keys, shapes and dtypes against it."""

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

from spotrun.console import (
    EXIT_FINDINGS,
    EXIT_OK,
    Subparsers,
    size_text,
    wide_console,
)
from spotrun.trainer.errors import ConfigError

if TYPE_CHECKING:  # the rest imports torch (~2 s): only the handlers that read checkpoints pay for it
    from spotrun.trainer.checkpoint.catalog import Catalog
    from spotrun.trainer.checkpoint.validate import Expectation, Problem
    from spotrun.trainer.spec.job import JobSpec

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
    """What a checkpoint must match. By default only --spec's shape hash (another job's checkpoints are
    reported first), built from nothing. With `structure`, the recipe's model and optimizer shapes: of
    --spec's recipe, else of the spec each checkpoint carries, built on CPU once per shape hash."""

    def __init__(self, spec: JobSpec | None, structure: bool = False) -> None:
        if structure and spec is not None and spec.entrypoint is not None:
            raise ConfigError(
                f"--structure builds a recipe's model, and job {spec.name} runs the entry point "
                f"{spec.entrypoint}, whose model only its own loop builds: drop --structure (its trainer "
                "checks shapes when it resumes)"
            )
        self.spec, self.structure = spec, structure
        self._by_shape: dict[str, Expectation | None] = {}

    def for_dir(self, d: Path) -> Expectation | None:
        from spotrun.trainer.checkpoint.validate import Expectation

        if not self.structure:
            return Expectation.of_shape(self.spec.shape_hash()) if self.spec is not None else None
        spec = self.spec if self.spec is not None else _embedded_spec(d)
        if spec is None:
            return None
        if spec.recipe is None:  # an entry point's model exists only inside its own loop
            log.warning("not checking structure of %s: its job runs an entry point, not a recipe", d.name)
            return None
        if self.spec is None and ":" in spec.recipe:  # a store's word is data: it names no code to import
            log.warning(
                "not checking structure of %s: its spec names the recipe %r, which only --spec may name",
                d.name,
                spec.recipe[:80],
            )
            return None
        key = spec.shape_hash()
        if key not in self._by_shape:
            try:
                self._by_shape[key] = recipe_expectation(spec)
            except ConfigError as e:
                if self.spec is not None:
                    raise  # the user's own --spec: its recipe not building is the answer
                log.info("not checking structure of %s against its recipe: %s", d.name, e)
                self._by_shape[key] = None  # e.g. a user recipe not importable here: no structure check
        return self._by_shape[key]


def recipe_expectation(spec: JobSpec) -> Expectation:
    """Build the spec's recipe on CPU and read off its shapes (ConfigError if it cannot be built)."""
    if spec.recipe is None:
        raise ConfigError(f"job {spec.name} runs an entry point: only a recipe's model can be built here")
    import torch

    from spotrun.trainer import recipes  # models, datasets: only `verify --structure` pays for them
    from spotrun.trainer.checkpoint.validate import Expectation

    ctx = recipes.RecipeContext(spec.seed, spec.total_steps, spec.batch_size, torch.device("cpu"))
    parts = recipes.build(spec.recipe, spec.args, ctx)
    return Expectation.from_parts(parts.model, parts.optimizer, spec.shape_hash())


def _embedded_spec(d: Path) -> JobSpec | None:
    """The job spec stored in a checkpoint's trainer.pt, or None when it cannot be read."""
    from spotrun.trainer.checkpoint.format import load_part
    from spotrun.trainer.spec.job import parse_spec

    try:
        meta = load_part(d / "trainer.pt")["state"]
        return parse_spec(meta["spec"], source=f"{d.name}/trainer.pt")
    except Exception:  # a damaged or foreign trainer.pt: validation reports it; check without a recipe
        return None


def inspect_step(catalog: Catalog, step: int, expect: Expectations) -> tuple[Path, list[Problem]]:
    """Fetch one committed checkpoint (into the catalog's cache; a directory store's is read in place)
    and validate it: where it is, and what is wrong with it."""
    path = catalog.fetch(step)
    _, problems = catalog.validate(step, None, integrity_only=True)  # hashed before anything is loaded
    if problems:
        return path, problems
    _, problems = catalog.validate(step, expect.for_dir(path))
    return path, problems


def list_rows(catalog: Catalog, expect: Expectations) -> list[Row]:
    """Every step directory under the storage root, newest first, each validated when committed."""
    from spotrun.trainer.checkpoint.validate import read_manifest

    latest = catalog.latest()
    rows = []
    for step, entry in sorted(catalog.list().items(), reverse=True):
        row = Row(step, sum(entry.files.values()), entry.committed, step == latest)
        if entry.committed:
            try:
                path, row.problems = inspect_step(catalog, step, expect)
            except FileNotFoundError:  # deleted by a running trainer's retention since the listing
                continue
            manifest, _ = read_manifest(path)
            row.metrics = manifest.metrics if manifest is not None else {}
        rows.append(row)
    return rows


def cmd_checkpoints_list(args: argparse.Namespace) -> int:
    """`spotrun checkpoints list`: a table (or JSON) of every checkpoint and whether it is valid."""
    with _checkpoint_context(args) as (catalog, expect):
        rows = list_rows(catalog, expect)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
    else:
        print_rows(catalog.storage.uri, rows)
    return EXIT_OK


def cmd_checkpoints_verify(args: argparse.Namespace) -> int:
    """`spotrun checkpoints verify`: exit 0 only when the newest committed checkpoint is valid."""
    with _checkpoint_context(args) as (catalog, expect):
        listed = catalog.list()
        committed = sorted((s for s, c in listed.items() if c.committed), reverse=True)
        uri = catalog.storage.uri
        if not committed:
            partial = f" ({len(listed)} incomplete step directories)" if listed else ""
            print(f"no committed checkpoint in {uri}{partial}")
            return EXIT_FINDINGS
        step = committed[0]
        _, problems = inspect_step(catalog, step, expect)
    if not problems:
        print(f"step {step} in {uri}: valid")
        return EXIT_OK
    for p in ranked(problems):
        print(f"step {step}: {p.kind}: {p}")
    return EXIT_FINDINGS


@contextmanager
def _checkpoint_context(args: argparse.Namespace) -> Iterator[tuple[Catalog, Expectations]]:
    from spotrun.tasks.settings import spotrun_home
    from spotrun.trainer.checkpoint.catalog import Catalog
    from spotrun.trainer.spec.job import load_spec
    from spotrun.trainer.storage import open_storage, resolve_uri
    from spotrun.trainer.storage.options import S3Options

    spec = load_spec(args.spec) if args.spec else None
    # a URI typed here is a path like any other argument; the spec's relative storage is under SPOTRUN_HOME
    uri = args.uri or (resolve_uri(spec.storage, spotrun_home()) if spec is not None else None)
    if uri is None:
        raise ConfigError("give a storage URI (a directory or s3://bucket/prefix), or --spec JOB.yaml")
    s3 = spec.s3 if spec is not None else S3Options()
    updates = {k: v for k, v in (("endpoint_url", args.endpoint_url), ("region", args.region)) if v}
    storage = open_storage(uri, s3.model_copy(update=updates), create=False)
    expect = Expectations(spec, structure=getattr(args, "structure", False))
    with tempfile.TemporaryDirectory(prefix="spotrun-ckpt-") as cache:
        yield Catalog(storage, Path(cache)), expect


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
    order = {"compat": 0, "integrity": 1, "unverified": 2, "structure": 3, "content": 4}
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
        q.add_argument("--spec", metavar="JOB.yaml", help="refuse checkpoints of another job (shape hash)")
        q.add_argument("--endpoint-url", help="S3-compatible endpoint (credentials from the environment)")
        q.add_argument("--region", help="S3 region")
        if name == "list":
            q.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
        else:
            q.add_argument(
                "--structure",
                action="store_true",
                help="also build the recipe (--spec's, else the checkpoint's own) on CPU and check keys, "
                "shapes and dtypes against it: runs the recipe's code",
            )
        q.set_defaults(handler=handler)
