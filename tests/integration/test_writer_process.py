"""The checkpoint writer process (trainer/saving/writer_proc.py, trainer/saving/shm.py): a real child process,
real shared memory, real storage and lease; what it writes equals what the thread writes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from spotrun.trainer.checkpoint.format import MANIFEST, Manifest, read_part, step_dir
from spotrun.trainer.checkpoint.state import capture_rng
from spotrun.trainer.checkpoint.stateful import spec_of
from spotrun.trainer.checkpoint.validate import validate_dir
from spotrun.trainer.errors import CheckpointError, LeaseLost
from spotrun.trainer.preemption.lease import LEASE_KEY, FencedStorage, Holder, Lease, LeaseDoc
from spotrun.trainer.saving.checkpointer import Checkpointer
from spotrun.trainer.storage import LocalStorage, get_bytes, open_storage, put_bytes
from spotrun.trainer.storage.options import S3Options
from spotrun.trainer.telemetry.metrics_log import metrics_key


def make_state(step: int, width: int = 64) -> dict[str, Any]:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    meta = {"step": step, "position": {"epoch": 0, "batch": step}, "rank": 0, "world_size": 1}
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": None,
        "rng": capture_rng(torch.device("cpu")),
        "trainer": meta,
    }


def base(step: int) -> dict[str, Any]:
    return {"step": step, "spec_hash": "s" * 8, "shape_hash": "h" * 8, "world_size": 1}


def loaded(storage: LocalStorage, step: int) -> dict[str, Any]:
    d = storage.root / step_dir(step)
    m = Manifest.from_json((d / MANIFEST).read_bytes())
    return {f: read_part(d / f, spec_of(f.split(".")[0]).codec) for f in sorted(m.files)}


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.fixture
def writer(tmp_path: Path) -> Any:
    made: list[Checkpointer] = []

    def make(storage: Any, **kw: Any) -> Checkpointer:
        ckpt = Checkpointer(
            storage, tmp_path / f"cache{len(made)}", keep=2, writer=kw.pop("writer", "process"), **kw
        )
        made.append(ckpt)
        return ckpt

    yield make
    for c in made:
        c.close()


def test_the_process_writes_what_the_thread_writes(tmp_path: Path, writer: Any) -> None:
    by_process, by_thread = LocalStorage(tmp_path / "p"), LocalStorage(tmp_path / "t")
    proc, thread = writer(by_process), writer(by_thread, writer="thread")
    for step in (10, 20):
        state = make_state(step)
        proc.save(state, base(step))
        thread.save(state, base(step))
        proc.wait()
        thread.wait()
    assert proc.uses_process and not thread.uses_process
    assert (proc.durable_step, thread.durable_step) == (20, 20)
    assert get_bytes(by_process, "latest") == get_bytes(by_thread, "latest")
    assert validate_dir(by_process.root / step_dir(20), integrity_only=True) == []
    assert_same(loaded(by_process, 20), loaded(by_thread, 20))
    assert [t.nbytes for t in proc.history] == [t.nbytes for t in thread.history]

    # a state that grew (every buffer changes size) gets a new arena, mapped by the same writer
    first, pid = proc._shared.generation, proc._proc.proc.pid
    state = make_state(30, width=48)
    proc.save(state, base(30))
    proc.wait()
    assert (proc._shared.generation, proc._proc.proc.pid) == (first + 1, pid)
    assert_same(loaded(by_process, 30)["model.safetensors"], dict(state["model"]))

    writer_proc = proc._proc.proc
    proc.close()
    assert writer_proc.poll() is not None


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_checkpoints_metrics_are_stored_before_its_manifest(tmp_path: Path, writer: Any, kind: str) -> None:
    """A committed checkpoint always has its steps' metrics: a kill after the manifest cannot lose them."""
    storage = LocalStorage(tmp_path / "store")
    seen: list[tuple[int, bool]] = []
    ckpt = writer(storage, writer=kind, on_durable=lambda step, ok: seen.append((step, ok)))
    body = b'{"step":3,"loss":"0x1.0p+0"}\n'
    ckpt.save(make_state(3), base(3), sidecars={metrics_key(3): body})
    ckpt.wait()
    assert seen == [(3, True)] and ckpt.uses_process is (kind == "process")
    metrics, manifest = storage.root / metrics_key(3), storage.root / step_dir(3) / MANIFEST
    # ctime: the manifest was written earlier, under the staging directory; its rename into place commits it
    assert metrics.read_bytes() == body and metrics.stat().st_mtime_ns <= manifest.stat().st_ctime_ns


def test_an_emergency_save_does_not_wait_for_a_writer_to_start(tmp_path: Path, writer: Any) -> None:
    ckpt = writer(LocalStorage(tmp_path / "s"))
    ckpt.save(make_state(5), base(5), wait=True)
    assert ckpt.durable_step == 5 and not ckpt.uses_process


def test_small_states_stay_in_the_thread_by_default(tmp_path: Path, writer: Any) -> None:
    ckpt = writer(LocalStorage(tmp_path / "s"), writer="auto")
    ckpt.save(make_state(3), base(3))
    ckpt.wait()
    assert ckpt.durable_step == 3 and not ckpt.uses_process


def test_the_writer_outlives_sigterm_and_a_dead_one_fails_the_checkpoint(tmp_path: Path, writer: Any) -> None:
    ckpt = writer(LocalStorage(tmp_path / "s"))
    ckpt.save(make_state(1), base(1))
    ckpt.wait()
    # a worker-wide SIGTERM (or Ctrl-C) reaches it too: the emergency save it asks for must still run
    os.kill(ckpt._proc.proc.pid, signal.SIGTERM)
    os.kill(ckpt._proc.proc.pid, signal.SIGINT)
    ckpt.save(make_state(2), base(2), wait=True)
    assert ckpt.durable_step == 2 and ckpt._proc.alive

    os.kill(ckpt._proc.proc.pid, signal.SIGKILL)
    ckpt._proc.proc.wait()
    ckpt.save(make_state(3), base(3))
    with pytest.raises(CheckpointError, match=r"writer process died .*SIGKILL"):
        ckpt.wait()
    assert ckpt.durable_step == 2


def test_writes_stop_once_the_lease_is_taken_over(tmp_path: Path, writer: Any) -> None:
    inner = LocalStorage(tmp_path / "s")
    lease = Lease.acquire(inner, Holder.this_process("w-1", None))
    ckpt = writer(FencedStorage(inner, lease))
    ckpt.save(make_state(1), base(1))
    ckpt.wait()
    assert ckpt.uses_process and ckpt.durable_step == 1
    theirs = Holder("w-2", "flow-2", "other-host", pid=1, pid_ns="")
    now = time.time()
    put_bytes(
        inner,
        LEASE_KEY,
        LeaseDoc(theirs, lease.doc.token + 1, now, renewed_at=now, expires_at=now + 30, ttl_s=30).to_json(),
    )
    ckpt.save(make_state(2), base(2))
    with pytest.raises(LeaseLost, match="taken over") as lost:
        ckpt.wait()
    assert lost.value.taken_by == "w-2"
    assert ckpt.durable_step == 1 and not (inner.root / step_dir(2) / MANIFEST).exists()


def test_a_storage_that_cannot_be_reopened_stays_in_the_thread(tmp_path: Path, writer: Any) -> None:
    class Wrapped(LocalStorage):  # a test double, like the fault-injecting storages
        pass

    ckpt = writer(Wrapped(tmp_path / "s"))
    ckpt.save(make_state(1), base(1))
    ckpt.wait()
    assert ckpt.durable_step == 1 and not ckpt.uses_process


def test_the_writer_opens_s3_again_with_the_same_options(
    s3_bucket: tuple[str, str], tmp_path: Path, writer: Any
) -> None:
    endpoint, bucket = s3_bucket
    storage = open_storage(f"s3://{bucket}/job", S3Options(endpoint_url=endpoint, multipart_chunk_mb=5))
    ckpt = writer(storage)
    state = make_state(7)
    ckpt.save(state, base(7))
    ckpt.wait()
    assert ckpt.uses_process and ckpt.durable_step == 7
    assert get_bytes(storage, "latest") == b'{"step": 7, "dir": "step_000000007"}'
    m = Manifest.from_json(get_bytes(storage, f"{step_dir(7)}/{MANIFEST}"))
    assert m.step == 7 and "model.safetensors" in m.files


def test_a_failed_write_leaves_nothing_in_a_directory_store(tmp_path: Path) -> None:
    """Written in place, a checkpoint that fails half-way takes its files with it: a full disk must
    not stay full of them, and nothing of it is ever listed."""
    from spotrun.trainer.saving.checkpointer import persist
    from spotrun.trainer.storage.local import STAGING

    storage = LocalStorage(tmp_path / "store")
    snap = {"model": {"w": torch.ones(4)}, "optimizer": {"state": lambda: None}, "trainer": {"rank": 0}}
    with pytest.raises(Exception, match="pickle"):
        persist(storage, tmp_path / "cache", snap, base=base(3), sidecars={})
    assert storage.list() == [] and not any((storage.root / STAGING).iterdir())


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_the_update_waits_for_the_copy_of_what_it_changes(
    tmp_path: Path, writer: Any, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A background save copies the parameters and optimizer state during the next step's forward
    and backward; that step's update waits at the fence. With the copy slowed to 0.3 s, the stored
    checkpoint still holds the state at the save: the parameters before the update, and the running
    stats before the forward (a buffer: copied at the save itself)."""
    from spotrun.trainer.checkpoint.state import LaterCopies, update_only_views

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train_step(ckpt: Checkpointer | None = None) -> float:
        model(torch.randn(8, 64)).sum().backward()  # moves BatchNorm's running stats
        waited = ckpt.fence() if ckpt is not None else 0.0
        opt.step()
        opt.zero_grad()
        return waited

    run = LaterCopies.run

    def slow_run(self: LaterCopies) -> None:
        time.sleep(0.3)
        run(self)

    monkeypatch.setattr(LaterCopies, "run", slow_run)
    storage = LocalStorage(tmp_path / "s")
    ckpt = writer(storage, writer=kind, update_only=lambda: update_only_views(model, opt))
    train_step()
    for step in (1, 2):  # the second reuses the buffers (and the process writer's arena)
        state: dict[str, Any] = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": {},
            "scaler": None,
            "rng": capture_rng(torch.device("cpu")),
            "trainer": {"step": step, "rank": 0, "world_size": 1},
        }
        at_save = {k: v.clone() for k, v in model.state_dict().items()}
        exp_avg = opt.state_dict()["state"][0]["exp_avg"].clone()
        ckpt.save(state, base(step))
        assert train_step(ckpt) > 0.1  # the update waited for the copy
        ckpt.wait()
        stored = loaded(storage, step)
        assert_same(stored["model.safetensors"], at_save)
        assert torch.equal(stored["optimizer.pt"]["state"][0]["exp_avg"], exp_avg)
        assert not torch.equal(model.state_dict()["0.weight"], at_save["0.weight"])  # training moved on
    assert ckpt.uses_process == (kind == "process")


def test_a_model_that_writes_its_weights_in_forward_loses_one_checkpoint_not_its_state(
    tmp_path: Path, writer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nn.Embedding(max_norm=...) renormalizes rows in place in forward: a copy left to the writer
    could hold the renormalized rows under the step before. The version counters tell: that
    checkpoint is skipped (nothing published, a warning), and every later one is copied at the save."""
    from spotrun.trainer.checkpoint.state import LaterCopies, update_only_views

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(16, 8, max_norm=0.5)
    model = torch.nn.Sequential(embedding, torch.nn.Linear(8, 2))
    with torch.no_grad():
        embedding.weight.mul_(10)  # every row over max_norm: the next forward rewrites the rows it uses
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = LaterCopies.run

    def slow_run(self: LaterCopies) -> None:
        time.sleep(0.3)  # the forward below writes the rows first
        run(self)

    monkeypatch.setattr(LaterCopies, "run", slow_run)
    storage = LocalStorage(tmp_path / "s")
    ckpt = writer(storage, writer="thread", update_only=lambda: update_only_views(model, opt))

    def state(step: int) -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": {},
            "scaler": None,
            "rng": capture_rng(torch.device("cpu")),
            "trainer": {"step": step, "rank": 0, "world_size": 1},
        }

    ckpt.save(state(1), base(1))
    model(torch.arange(16)).sum().backward()  # renormalizes every row in place
    ckpt.fence()
    opt.step()
    ckpt.wait()  # no error: the checkpoint is skipped, not failed
    assert ckpt.durable_step is None and not (storage.root / step_dir(1)).exists() and not ckpt.overlap
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save(state(2), base(2))  # copied whole at the save now
    model(torch.arange(16)).sum().backward()
    ckpt.fence()
    opt.step()
    ckpt.wait()
    assert ckpt.durable_step == 2
    assert_same(loaded(storage, 2)["model.safetensors"], at_save)
