"""The launcher's pure parts: one exit code from the ranks', torchrun's arguments, the spec's world size."""

from __future__ import annotations

import pytest

from spotrun.trainer.errors import ConfigError
from spotrun.trainer.exitcodes import ExitCode
from spotrun.trainer.launch.start import (
    RANK_START,
    RankExit,
    combine,
    fork_ranks,
    read_rank_exits,
    torchrun_args,
    write_rank_exit,
)
from spotrun.trainer.session.faults import Fault
from spotrun.trainer.spec.job import DistributedOptions, parse_spec

C, P, S, K, CFG, LH = (
    ExitCode.COMPLETED,
    ExitCode.PREEMPTED,
    ExitCode.STOPPED,
    ExitCode.CRASHED,
    ExitCode.CONFIG_ERROR,
    ExitCode.LEASE_HELD,
)


@pytest.mark.parametrize(
    ("codes", "world", "want", "says"),  # world: this machine's ranks are 0..world-1
    [
        ({0: C, 1: C}, 2, C, ""),
        ({0: P, 1: P}, 2, P, ""),  # a SIGTERM: torchrun exits 1, the ranks agree on PREEMPTED
        ({0: S, 1: S, 2: S}, 3, S, ""),
        ({0: K}, 2, K, "rank 1 died without an exit record"),  # rank 1 SIGKILLed
        ({}, 2, K, "rank 0 died"),
        ({0: K, 1: CFG}, 2, CFG, "rank 1"),  # rank 1 could not load; rank 0 only saw the socket close
        ({0: LH}, 2, LH, "rank 0"),  # the lease is held: a verdict, though rank 1 never wrote one
        ({0: P, 1: K}, 2, K, "rank 1"),
        ({0: C, 1: P}, 2, K, "ranks disagree"),
    ],
)
def test_combine(codes: dict[int, ExitCode], world: int, want: ExitCode, says: str) -> None:
    exits = {r: RankExit(r, c, f"err{r}" if c is not C else "") for r, c in codes.items()}
    code, error = combine(exits, range(world))
    assert code is want and says in error


def test_combine_on_the_second_machine_expects_only_its_own_ranks() -> None:
    # node 1 of 2, 2 ranks each: global ranks 2 and 3 are this machine's; 0 and 1 live elsewhere
    exits = {2: RankExit(2, S), 3: RankExit(3, S)}
    assert combine(exits, [2, 3]) == (S, "")
    assert combine({2: RankExit(2, S)}, [2, 3])[0] is K


def test_rank_exit_files_round_trip(tmp_path: object) -> None:
    from pathlib import Path

    d = Path(str(tmp_path))
    write_rank_exit(str(d), RankExit(1, ExitCode.PREEMPTED, "", step=40, durable_step=40))
    (d / "rank0.json").write_text("{half")  # a rank killed while writing: counts as missing
    assert read_rank_exits(d) == {1: RankExit(1, ExitCode.PREEMPTED, "", step=40, durable_step=40)}


def test_torchrun_args_one_node_meets_on_loopback_several_meet_at_the_first() -> None:
    one = torchrun_args(DistributedOptions(nproc_per_node=2), 2, {"SPOTRUN_MASTER_ADDR": "10.0.0.5"}, 41000)
    assert "--nproc_per_node=2" in one and "--max_restarts=0" in one and "--standalone" not in one
    assert "--master_addr=127.0.0.1" in one and "--master_port=41000" in one and "--nnodes=1" in one
    two = DistributedOptions(nproc_per_node=4, nnodes=2, port=29600)
    first = torchrun_args(two, 4, {"SPOTRUN_NODE_RANK": "0", "SPOTRUN_MASTER_ADDR": "10.0.0.5"})
    second = torchrun_args(two, 4, {"SPOTRUN_NODE_RANK": "1", "SPOTRUN_MASTER_ADDR": "10.0.0.5"})
    assert "--rdzv_backend=static" in first and "--nnodes=2" in first
    assert "--master_addr=10.0.0.5" in first and "--master_port=29600" in first
    assert "--node_rank=0" in first and "--node_rank=1" in second


BASE = {"name": "j", "recipe": "digits", "total_steps": 10}


@pytest.mark.parametrize(
    ("dist", "world"),
    [
        (None, 1),
        ({"nproc_per_node": 2}, 2),
        ({"nproc_per_node": 4, "nnodes": 2}, 8),
        ({"nproc_per_node": "auto"}, 1),
    ],
)
def test_world_size_is_derived(dist: dict[str, object] | None, world: int) -> None:
    spec = parse_spec({**BASE, **({"distributed": dist} if dist else {})})
    assert spec.world_size == world
    assert spec.shape_hash() == spec.shape_hash(world) != spec.shape_hash(world + 1)


def test_world_size_typed_by_hand_is_refused_with_the_fix() -> None:
    with pytest.raises(
        ConfigError, match=r"world_size is derived now: remove it and set distributed\.nproc_per_node"
    ):
        parse_spec({**BASE, "world_size": 2})
    with pytest.raises(ConfigError, match=r"distributed\.strategy"):
        parse_spec({**BASE, "distributed": {"strategy": "zero3"}})


def test_single_process_shape_hash_is_unchanged_by_the_distributed_field() -> None:
    # checkpoints written before `distributed` existed (world_size: 1 in the hash) still resume
    import hashlib
    import json

    spec = parse_spec(BASE)
    old = {"recipe": "digits", "args": {}, "batch_size": 64, "world_size": 1}
    assert (
        spec.shape_hash()
        == hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    )


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("sigkill@30", Fault("sigkill", 30)),
        ("sigkill@30:1", Fault("sigkill", 30, 1)),
        ("sigterm@5:0", Fault("sigterm", 5, 0)),
    ],
)
def test_fault_with_a_rank(text: str, fault: Fault) -> None:
    assert Fault.parse(text) == fault


def test_fault_with_a_bad_rank_is_refused() -> None:
    with pytest.raises(ConfigError, match="KIND@STEP:RANK"):
        Fault.parse("sigkill@30:x")


@pytest.mark.parametrize(
    ("on_cpu", "env", "threads", "forked", "why"),
    [
        (True, {}, [], True, ""),
        (True, {RANK_START: "fork"}, [], True, ""),
        (True, {RANK_START: "exec"}, [], False, ""),  # asked for fresh processes
        (False, {}, [], False, ""),  # CUDA: never forked, nothing to warn about
        (True, {}, ["spotrun-heartbeat"], False, "threads running (spotrun-heartbeat)"),
        (False, {}, ["spotrun-heartbeat"], False, ""),
    ],
)
def test_fork_ranks(on_cpu: bool, env: dict[str, str], threads: list[str], forked: bool, why: str) -> None:
    assert fork_ranks(on_cpu, env, threads) == (forked, why)


@pytest.mark.parametrize(
    ("storage", "override", "resolved"),
    [
        ("ckpt/rel", None, "{home}/ckpt/rel"),  # the job file's relative storage: under SPOTRUN_HOME
        ("file://ckpt/rel", None, "{home}/ckpt/rel"),
        ("/abs/ckpt", None, "/abs/ckpt"),
        ("s3://b/x", None, "s3://b/x"),
        ("/abs/ckpt", "other", "{home}/other"),  # --storage: the same rule
        ("ckpt/rel", "s3://b/y", "s3://b/y"),
    ],
)
def test_the_trainer_resolves_storage_as_spotrun_run_does(
    storage: str, override: str | None, resolved: str, tmp_path: object
) -> None:
    from pathlib import Path

    from spotrun.trainer.__main__ import job_storage
    from spotrun.trainer.spec.job import JobSpec

    home = Path(str(tmp_path))
    spec = JobSpec.model_validate({**BASE, "storage": storage})
    assert job_storage(spec, override, home).storage == resolved.format(home=home)
