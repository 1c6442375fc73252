"""Run keys: one job run per scheduled slot, resolved once at the key's first flow run.

A job with `run_key: "{scheduled_date}"` is a series of job runs. The first flow run of a key fills the
templates from its slot (the flow run's scheduled time, in the schedule's timezone, else UTC; its name),
picks the runs it starts from (`init_from`) and is compared with (`promote`), and records all of it on
the key's job run in SQL. Every later flow run of the key (recover-job's rerun, which has a new name and
scheduled time; a retry; a double click; `spotrun run --run-key`) reads that record back and gets the
same resolved spec, so a rerun continues the same night with the same data and the same warm start.

The pure parts (`slot_values`, `values_for_key`, `resolve`, `pick_source`) are tested with tables; the
rest reads SQL, storage and the flow run's context.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from spotrun.tasks.history import StoreUnavailable
from spotrun.tasks.history.models import JobRunRow, JobStatus, KeyedRun
from spotrun.trainer.checkpoint.completion import completed_step
from spotrun.trainer.errors import ConfigError, StorageError, TransientStorageError
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.spec.runs import BEST, LATEST_COMPLETED, RunSource, key_problem
from spotrun.trainer.spec.templating import fill, fill_tree, pieces

DATE, TIME = "%Y-%m-%d", "%Y%m%dT%H%M%S"
# How each slot value reads back out of a literal key (`--run-key 2026-12-01`).
_PATTERNS = {
    "scheduled_date": r"\d{4}-\d{2}-\d{2}",
    "scheduled_time": r"\d{8}T\d{6}",
    "flow_run_name": r"[A-Za-z0-9_.=-]+?",
}
SOURCE_READ_TRIES = 3
MAX_BACKFILL_DAYS = 366
MAX_RUNS_READ = 1000  # a job's runs read to pick a source: years of nightly runs


@dataclass(frozen=True)
class Slot:
    """The slot a flow run stands for: its scheduled time, the schedule's timezone, its name."""

    scheduled: datetime  # aware
    timezone: str = "UTC"
    flow_run_name: str = ""


def slot_values(slot: Slot) -> dict[str, str]:
    """The template values of a slot (`{scheduled_date}` in the schedule's timezone)."""
    try:
        local = slot.scheduled.astimezone(ZoneInfo(slot.timezone))
    except ZoneInfoNotFoundError:
        raise ConfigError(f"unknown timezone {slot.timezone!r}: use an IANA name such as UTC") from None
    return {
        "scheduled_date": local.strftime(DATE),
        "scheduled_time": local.strftime(TIME),
        "flow_run_name": slot.flow_run_name,
    }


def values_for_key(template: str, key: str, flow_run_name: str = "") -> dict[str, str]:
    """The slot values a literal key stands for, read back through the template (`2026-12-01` through
    `{scheduled_date}`): a backfill gets the data that night had. ConfigError when it does not fit."""
    if problem := key_problem(key):
        raise ConfigError(problem)
    pattern = "".join(
        f"(?P<{text}>{_PATTERNS[text]})" if kind == "name" else re.escape(text)
        for kind, text in pieces(template, "run_key")
    )
    m = re.fullmatch(pattern, key)
    if m is None:
        example = fill(template, slot_values(Slot(datetime.now(UTC))) | {"flow_run_name": "name"})
        raise ConfigError(
            f"run key {key!r} does not fit run_key {template!r} (e.g. {example!r}); give a key of that form"
        )
    found = {k: v for k, v in m.groupdict().items() if v is not None}
    when = _when(found)
    values = slot_values(Slot(when)) if when is not None else {"scheduled_date": "", "scheduled_time": ""}
    return values | {"flow_run_name": flow_run_name} | found


def keys_to_run(job: JobSpec, text: str | None, now: datetime | None = None) -> list[str | None]:
    """The keys `spotrun run --run-key TEXT` runs, in order: TEXT, each date key of FIRST..LAST, or (no
    TEXT) the key of now in UTC; [None] for an unkeyed job."""
    if job.run_key is None:
        if text:
            raise ConfigError(
                f"--run-key {text}: job {job.name} has no run_key; add run_key to the job "
                "(e.g. {scheduled_date}) or drop --run-key"
            )
        return [None]
    if not text:
        return [fill(job.run_key, slot_values(Slot(now or datetime.now(UTC))), "run_key")]
    if ".." not in text:
        values_for_key(job.run_key, text)  # refused here, in one line, if it does not fit
        return [text]
    first, last = (_date_of(job.run_key, k) for k in text.split("..", 1))
    days = (last - first).days + 1
    if not 1 <= days <= MAX_BACKFILL_DAYS:
        raise ConfigError(
            f"--run-key {text}: give FIRST..LAST with FIRST <= LAST, at most {MAX_BACKFILL_DAYS} days apart"
        )
    return [fill(job.run_key, slot_values(Slot(first + timedelta(days=i))), "run_key") for i in range(days)]


def _date_of(template: str, key: str) -> datetime:
    if "{scheduled_date}" not in template or "{flow_run_name}" in template:
        raise ConfigError(
            f"a FIRST..LAST range needs a run_key of dates such as {{scheduled_date}}, not "
            f"{template!r}; give the keys one at a time"
        )
    values = values_for_key(template, key)
    return datetime.strptime(values["scheduled_date"], DATE).replace(tzinfo=UTC)


def preview(job: JobSpec, key: str | None) -> JobSpec:
    """The job as one key resolves it, without its sources (which the flow picks): its storage, its
    directories."""
    if key is None or job.run_key is None:
        return job
    return resolve(job, values_for_key(job.run_key, key), Lineage())


def _when(found: dict[str, str]) -> datetime | None:
    try:
        if "scheduled_time" in found:
            return datetime.strptime(found["scheduled_time"], TIME).replace(tzinfo=UTC)
        if "scheduled_date" in found:
            return datetime.strptime(found["scheduled_date"], DATE).replace(tzinfo=UTC)
    except ValueError:
        raise ConfigError(f"{found} is not a real date or time; give one that is") from None
    return None


@dataclass(frozen=True)
class Lineage:
    """The runs a keyed run was resolved against, as recorded on its job run."""

    init_from: RunSource | None = None
    init_note: str = ""  # why there is no source (the first night), or which was picked
    champion: RunSource | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "init_from": self.init_from.model_dump(mode="json") if self.init_from else None,
            "init_note": self.init_note,
            "champion": self.champion.model_dump(mode="json") if self.champion else None,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any] | None) -> Lineage:
        doc = doc or {}
        src, champ = doc.get("init_from"), doc.get("champion")
        return cls(
            init_from=RunSource.model_validate(src) if src else None,
            init_note=str(doc.get("init_note", "")),
            champion=RunSource.model_validate(champ) if champ else None,
        )


def resolve(job: JobSpec, values: dict[str, str], lineage: Lineage) -> JobSpec:
    """The job run of one key: key and args filled, storage `<storage>/<key>`, sources recorded. Pure;
    a spec that is already resolved comes back unchanged."""
    if job.resolved or job.run_key is None:
        return _with_sources(job, lineage) if job.run_key is None else job
    key = fill(job.run_key, values, "run_key")
    if problem := key_problem(key):
        raise ConfigError(problem)
    filled = values | {"run_key": key}
    doc = job.model_dump(mode="json", by_alias=True) | {
        "run_key": key,
        "run_values": filled,
        "args": fill_tree(job.args, filled, "args"),
        "storage": f"{job.storage.rstrip('/')}/{key}",
    }
    return _with_sources(JobSpec.model_validate(doc), lineage)


def _with_sources(job: JobSpec, lineage: Lineage) -> JobSpec:
    update: dict[str, Any] = {}
    if job.init_from is not None:
        update["init_from"] = job.init_from.model_copy(update={"source": lineage.init_from})
    if job.promote is not None:
        update["promote"] = job.promote.model_copy(update={"champion": lineage.champion})
    return job.model_copy(update=update) if update else job


def pick_source(runs: Sequence[JobRunRow], which: str, this_key: str | None) -> JobRunRow | None:
    """The run `which` names among a job's runs: `latest-completed` (newest to complete, other than this
    key), `best` (the newest promoted: the run the alias holds), or a run key's completed run. A key is
    ranked by the job run that completed it (a later flow run that found it complete changes nothing)."""
    done = _first_completions(runs)
    if which == BEST:
        done = [r for r in done if (r.promotion or {}).get("promoted") and r.run_key != this_key]
    elif which == LATEST_COMPLETED:
        done = [r for r in done if r.run_key != this_key or r.run_key is None]
    else:
        done = [r for r in done if r.run_key == which]
    return max(done, key=lambda r: (r.ended_at or r.started_at, r.started_at), default=None)


def _first_completions(runs: Sequence[JobRunRow]) -> list[JobRunRow]:
    """Per run key (an unkeyed run: per job run), the completed job run that ended first."""
    first: dict[str, JobRunRow] = {}
    for r in sorted(runs, key=lambda r: (r.ended_at or r.started_at, r.started_at)):
        if r.status is JobStatus.COMPLETED:
            first.setdefault(r.run_key or f"run:{r.id}", r)
    return list(first.values())


def source_of(row: JobRunRow, job: JobSpec, sleep: Callable[[float], None] = time.sleep) -> RunSource | None:
    """`row`'s run as a source: its storage and the step its COMPLETED.json records (None: it has none,
    or cannot be read). A transient read error is retried, not taken for a missing source."""
    for i in range(SOURCE_READ_TRIES):
        try:
            step = completed_step(job.open_storage(row.storage_uri))
            break
        except TransientStorageError:
            if i == SOURCE_READ_TRIES - 1:
                return None
            sleep(2.0**i)
        except (StorageError, ConfigError, OSError):
            return None
    if step is None:
        return None
    version = (row.promotion or {}).get("version")
    return RunSource(
        job=row.job,
        run_key=row.run_key,
        storage=row.storage_uri,
        step=step,
        job_run_id=row.id,
        version=str(version) if version else None,
    )


def pick_lineage(job: JobSpec, runs_of: Callable[[str], Sequence[JobRunRow]], key: str | None) -> Lineage:
    """The warm-start source and the champion for a new job run of `key` (None where there is none)."""
    init, note = None, ""
    if job.init_from is not None:
        w = job.init_from
        row = pick_source(runs_of(w.job), w.which, key if w.job == job.name else None)
        init = source_of(row, job) if row is not None else None
        note = f"{w.which} of {w.job}: " + (
            f"run {row.run_key or row.id} step {init.step}"
            if init and row
            else "no completed run with a final checkpoint"
        )
    champion = None
    if job.promote is not None:
        row = pick_source(runs_of(job.name), BEST, key)
        champion = source_of(row, job) if row is not None else None
    return Lineage(init_from=init, init_note=note, champion=champion)


def lineage_of(job: JobSpec) -> Lineage:
    """The sources a resolved spec carries."""
    init = job.init_from.source if job.init_from is not None else None
    champion = job.promote.champion if job.promote is not None else None
    return Lineage(init_from=init, champion=champion)


def keyed_record(job: JobSpec) -> KeyedRun | None:
    """What a new job run of a resolved spec records in SQL: its key, values and sources (None: an
    unkeyed job with neither a warm start nor a promotion gate)."""
    if job.run_key is None and job.init_from is None and job.promote is None:
        return None
    return KeyedRun(
        run_key=job.run_key if job.resolved else None,
        run_values=dict(job.run_values),
        lineage=lineage_of(job).as_json(),
    )


class History(Protocol):
    """The reads resolution needs (tasks.history.HistoryStore)."""

    def job_runs(
        self, job: str | None = None, limit: int = 50, run_key: str | None = None
    ) -> list[JobRunRow]: ...

    def latest_job_run(self, job: str, run_key: str | None = None) -> JobRunRow | None: ...

    def job_run_of_flow_run(self, flow_run_id: str) -> JobRunRow | None: ...


def resolve_job_run(
    job: JobSpec, history: History, slot: Slot, *, run_key: str | None = None, recovers: str = ""
) -> tuple[JobSpec, str]:
    """The spec this flow run trains, and one line on how it was resolved. `run_key`: a literal key to
    reproduce (a backfill); `recovers`: the crashed flow run this one replaces (its key goes on). A history
    database that is down never stops training: the key then comes from the slot, with no sources."""
    if job.resolved or (job.run_key is None and job.init_from is None and job.promote is None):
        return job, ""
    if run_key and job.run_key:
        values = values_for_key(job.run_key, run_key, slot.flow_run_name)
    else:
        values = slot_values(slot)
    try:
        row = _recorded(job, history, values, recovers)
        if row is not None and row.run_values:  # the key's first flow run fixed its values and sources
            values = {k: v for k, v in row.run_values.items() if k != "run_key"}
            resolved = resolve(job, values, Lineage.from_json(row.lineage))
            return resolved, f"run key {resolved.run_key}: continuing its job run {row.id}"
        key = fill(job.run_key, values, "run_key") if job.run_key else None
        lineage = pick_lineage(job, lambda name: history.job_runs(name, limit=MAX_RUNS_READ), key)
    except StoreUnavailable as e:
        lineage = Lineage(init_note=f"none: {e}")
    resolved = resolve(job, values, lineage)
    where = f"run key {resolved.run_key}" if resolved.run_key else f"job {job.name}"
    note = f"; warm start from {lineage.init_note}" if lineage.init_note else ""
    return resolved, f"{where}: a new job run{note}"


def _recorded(job: JobSpec, history: History, values: dict[str, str], recovers: str) -> JobRunRow | None:
    """The key's job run, if an earlier flow run started it: the crashed run's (recover-job), else the
    newest of the key the slot names."""
    if job.run_key is None:
        return None
    row = history.job_run_of_flow_run(recovers) if recovers else None
    if row is not None and row.job == job.name and row.run_values:
        return row
    return history.latest_job_run(job.name, fill(job.run_key, values, "run_key"))
