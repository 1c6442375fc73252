"""Stores that grow: with 10,000 step directories, present at once or written and retired over a store's
life, listing and retention cost requests in proportion to the checkpoints kept, counted as Storage calls
on a directory (tests/fakes/counting_store.py) and as HTTP requests at the moto server (through a proxy
that counts them); and the metrics objects MLflow holds are gone after a run, its tracker having listed
only `metrics/` and the step directories. Objects are made directly, not by training."""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from spotrun.tasks.tracking import Tracker, Where
from spotrun.tasks.tracking.collect import Hold, collect, collectable
from spotrun.tasks.tracking.fidelity import TREND_WINDOW
from spotrun.tasks.tracking.steps import committed_step, metric_objects
from spotrun.trainer.checkpoint.catalog import Catalog
from spotrun.trainer.checkpoint.format import MANIFEST, step_dir
from spotrun.trainer.spec.job import JobSpec
from spotrun.trainer.storage import (
    Backend,
    Storage,
    open_storage,
    put_bytes,
    register_backend,
    unregister_backend,
)
from spotrun.trainer.storage.options import S3Options
from spotrun.trainer.storage.s3 import S3Storage, make_s3_client
from spotrun.trainer.telemetry.metrics_log import PREFIX, MetricsLog, metrics_key
from tests.aws_backdoor import seed_objects
from tests.fakes.counting_store import CountingStorage, calls_at
from tests.servers import FaultProxy

N = 10_000
KEEP = 2
PAGE = 1000  # keys per LIST page and per DeleteObjects request


@pytest.fixture
def counting_scheme() -> Iterator[None]:
    register_backend(Backend("counting", "tests.fakes.counting_store", "counting:///dir"))
    yield
    unregister_backend("counting")


@pytest.fixture
def store_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory for 30,000 small files: in memory where the machine has /dev/shm (this VM's disk made
    and removed them in 200 s under load, tmpfs in 3 s); Storage calls are counted the same."""
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix="spotrun-growth-", dir=shm)) if shm.is_dir() else tmp_path
    try:
        yield base / "store"
    finally:
        if base != tmp_path:
            shutil.rmtree(base, ignore_errors=True)


def _counting(root: Path) -> CountingStorage:
    storage = open_storage(f"counting://{root}")
    assert isinstance(storage, CountingStorage)
    return storage


def _seed_dir(root: Path, steps: range, metrics: range | None = None) -> None:
    """What `steps` checkpoints leave in a directory: a manifest and a model each, and metrics objects
    (for `metrics`; None: for every step)."""
    (root / PREFIX).mkdir(parents=True, exist_ok=True)
    for s in steps:
        d = root / step_dir(s)
        d.mkdir()
        (d / MANIFEST).write_bytes(b"{}")
        (d / "model.safetensors").write_bytes(b"")
    for s in steps if metrics is None else metrics:
        (root / metrics_key(s)).write_bytes(b"")


def _tracker_round(storage: Storage, newest: int) -> None:
    """What the tracker does to the store each round once MLflow has everything up to `newest`."""
    committed = committed_step(storage)
    assert committed == newest
    collect(storage, metric_objects(storage), sent_through=newest, holds=[Hold(committed, committed)])


def test_a_directory_with_10000_checkpoints_costs_the_same_few_calls(
    store_dir: Path, counting_scheme: None
) -> None:
    root = store_dir
    _seed_dir(root, range(1, N + 1), metrics=range(1, PAGE + 1))
    storage, calls = _counting(root), calls_at(root)
    assert len(Catalog(storage).list()) == N and committed_step(storage) == N
    assert calls.listed == ["step_", "step_"]  # never the whole root with its 10,000 metrics objects
    calls.reset()
    assert len(Catalog(storage).retain(verified=N, keep=KEEP)) == N - KEEP
    assert calls.by_method == {"list": 1, "delete": 2, "cleanup_incomplete": 1}  # manifests, then the rest
    assert sorted(Catalog(storage).list()) == [N - 1, N]


def test_a_directory_over_a_life_of_10000_checkpoints_costs_the_same_each_round(
    store_dir: Path, counting_scheme: None
) -> None:
    root = store_dir
    storage, calls = _counting(root), calls_at(root)
    per_round = []
    for first in range(1, N + 1, 100):
        _seed_dir(root, range(first, first + 100))
        calls.reset()
        Catalog(storage).retain(verified=first + 99, keep=KEEP)
        _tracker_round(storage, first + 99)
        per_round.append(dict(calls.by_method))
    assert all(r == per_round[0] for r in per_round), per_round
    assert per_round[0] == {"list": 3, "delete": 3, "cleanup_incomplete": 1}
    assert sorted(Catalog(storage).list()) == [N - 1, N]
    assert [k for _, k in metric_objects(storage)] == [metrics_key(s) for s in _trend(N)]
    assert sorted(p.name for p in root.iterdir()) == ["metrics", step_dir(N - 1), step_dir(N)]


def _trend(newest: int) -> range:
    """The steps whose metrics objects stay with a checkpoint every step: the next notice check's trend."""
    return range(newest - TREND_WINDOW + 1, newest + 1)


@pytest.fixture
def counted_s3(
    s3_bucket: tuple[str, str], boto_session: boto3.session.Session
) -> Iterator[tuple[S3Storage, FaultProxy, str]]:
    """A job's S3 store whose every request passes a proxy that counts them."""
    endpoint, bucket = s3_bucket
    proxy = FaultProxy(endpoint).start()
    opts = S3Options(endpoint_url=proxy.endpoint)
    storage = S3Storage(make_s3_client(opts, session=boto_session), bucket, "runs/job", opts)
    try:
        yield storage, proxy, bucket
    finally:
        proxy.stop()


def _seed_s3(bucket: str, steps: range, metrics: range = range(0)) -> None:
    """A manifest per step (botocore's parsing of each listed key's date costs 0.1-0.5 ms: one file a
    step keeps the test short), and metrics objects for `metrics`."""
    keys = [f"runs/job/{step_dir(s)}/{MANIFEST}" for s in steps]
    seed_objects(bucket, [*keys, *(f"runs/job/{metrics_key(s)}" for s in metrics)])


def _requests(proxy: FaultProxy) -> int:
    n, proxy.requests = proxy.requests, 0
    return n


def test_s3_with_10000_checkpoints_lists_them_in_one_request_per_1000(
    counted_s3: tuple[S3Storage, FaultProxy, str],
) -> None:
    storage, proxy, bucket = counted_s3
    _seed_s3(bucket, range(1, N + 1), metrics=range(1, PAGE + 1))
    _requests(proxy)
    assert len(Catalog(storage).retain(verified=N, keep=KEEP)) == N - KEEP
    # a LIST per 1,000 step directories (not one more for the 1,000 metrics objects beside them), a
    # DeleteObjects per 1,000 manifests, one ListMultipartUploads
    assert _requests(proxy) == N // PAGE + math.ceil((N - KEEP) / PAGE) + 1
    assert sorted(Catalog(storage).list()) == [N - 1, N]
    assert _requests(proxy) == 1


def test_s3_over_a_life_of_10000_checkpoints_costs_the_same_each_round(
    counted_s3: tuple[S3Storage, FaultProxy, str],
) -> None:
    storage, proxy, bucket = counted_s3
    per_round = []
    for first in range(1, N + 1, PAGE):
        _seed_s3(bucket, range(first, first + PAGE))
        _requests(proxy)
        Catalog(storage).retain(verified=first + PAGE - 1, keep=KEEP)
        per_round.append(_requests(proxy))
    # 1,000 new and 2 kept: 2 LIST pages; 1 DeleteObjects; 1 ListMultipartUploads; the first round keeps
    # none from before: 1 page
    assert per_round == [3] + [4] * (len(per_round) - 1), per_round
    assert sorted(Catalog(storage).list()) == [N - 1, N]
    assert _requests(proxy) == 1


# -- the tracker ----------------------------------------------------------------------------------


def _publish(storage: Storage, steps: range, durable: int) -> None:
    """A trainer's metrics sidecar for the checkpoint at `durable`, then its manifest."""
    log = MetricsLog(storage)
    for s in steps:
        log.record(s, 1.0 / s, 1e-3, 1e-3)
    for key, body in log.sidecars(durable).items():
        put_bytes(storage, key, body)
    put_bytes(storage, f"{step_dir(durable)}/{MANIFEST}", b"{}")


def test_metrics_mlflow_holds_are_gone_after_a_run_and_the_tracker_lists_only_its_prefixes(
    tmp_path: Path, counting_scheme: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "store"
    job = JobSpec.model_validate(
        {
            "name": "grown",
            "recipe": "digits",
            "total_steps": 300,
            "storage": f"counting://{root}",
            "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "register": False},
        }
    )
    storage = _counting(root)
    for durable in range(60, 301, 60):
        _publish(storage, range(durable - 59, durable + 1), durable)
    put_bytes(storage, "other/junk", b"")  # the root holds more than the tracker's prefixes
    calls = calls_at(root)
    calls.reset()
    where = Where.of(job, tmp_path, {})
    info = Tracker(job, where, "run-one", flow_run_id="flow", provider="local").start().finish("failed")
    assert info.sent_through == 300 and not info.pending
    # the newest checkpoint's object stays: the next attempt's notice check reads its lr_next
    assert [k for _, k in metric_objects(storage)] == [metrics_key(300)]
    assert set(calls.listed) == {PREFIX, "step_"}


@pytest.mark.parametrize(
    ("durables", "sent", "holds", "gone"),
    [
        ([60, 120, 180], 180, [Hold(180, 180)], [60, 120]),  # the newest's, with TREND_WINDOW before it
        ([10, 20, 30, 40], 40, [Hold(40, 40)], []),  # all within 50 steps of the newest
        ([60, 120, 180], 120, [Hold(180, 180)], [60, 120]),  # unsent: 180 stays anyway
        ([60, 120], 60, [Hold(120, 120)], [60]),
        ([60, 120], 0, [Hold(120, 120)], []),  # nothing sent
        # attempt resumed from 120 after one that reached 200: its check reads 71..200
        ([60, 120, 180, 240, 300], 300, [Hold(300, 300), Hold(120, 200)], [60]),
        # resumed from a notice's checkpoint at 300: its continuity check reads 251..301, 301 in its own 360
        ([240, 300, 360, 420], 420, [Hold(420, 420), Hold(300, 301)], [240]),
        # the lost attempt's last step not known yet: everything after 70 stays
        ([60, 120, 180, 240, 300], 300, [Hold(300, 300), Hold(120, None)], [60]),
        ([60, 120, 180, 240, 300, 360], 360, [Hold(360, 360), Hold(180, 180)], [60, 120, 240, 300]),
    ],
)
def test_collectable(durables: list[int], sent: int, holds: list[Hold], gone: list[int]) -> None:
    assert collectable(durables, sent_through=sent, holds=holds) == gone
