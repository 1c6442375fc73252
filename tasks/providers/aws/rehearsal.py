"""Rehearsal of the `aws` provider against an EC2-compatible test endpoint (moto), which records
instances but runs nothing: each launched instance is played by a local process running the
instance's own user data, and dies when the instance is released. Everything else (placement,
tags, spot interruptions set on the endpoint, heartbeats through the job's storage, the sweeper)
is the real path. `AwsProviderConfig.rehearse_locally` turns it on; never against AWS itself.

A multi-node attempt is several instances, so several local processes, one per node, each with its own
worker id (its instance id: its own heartbeat) and its own directory (the user data's `workdir/node<i>`:
its own job file and checkpoint cache). Every node runs on this host, where the instances' private IPs
lead nowhere, so each process gets SPOTRUN_MASTER_ADDR=127.0.0.1, which the user data keeps.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

from spotrun.tasks.market.prices import Prices
from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.provider import AwsProvider
from spotrun.tasks.providers.aws.watch import AwsWorkerState
from spotrun.tasks.providers.base import (
    LogCallback,
    Market,
    StatusCallback,
    StopCause,
    WarmSettings,
    WatchResult,
    Worker,
)
from spotrun.tasks.providers.processes import die_with_parent, on_spawner_thread
from spotrun.tasks.providers.trainer_env import trainer_env
from spotrun.trainer.spec.job import EnvOptions, JobSpec

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"  # node 0's address as the other nodes reach it: every node plays on this host
INSTANCE_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


class LocalInstances:
    """The processes playing instances: `bash user-data.sh` under root/<instance id>/."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def launch(self, instance_id: str, script: str) -> None:
        home = self.root / instance_id
        home.mkdir(parents=True, exist_ok=True)
        (home / "user-data.sh").write_text(script)
        # The current user plays the instance: no switch to the instance's trainer user. It boots with
        # what a local trainer may see of this environment, and the test endpoint's AWS keys in place of
        # the instance profile a real instance has (a rehearsal runs against a loopback endpoint).
        stand_in = {k: os.environ[k] for k in INSTANCE_CREDENTIALS if k in os.environ}
        env = {
            **trainer_env(os.environ, EnvOptions()),
            **stand_in,
            "SPOTRUN_WORKER_ID": instance_id,
            "SPOTRUN_MASTER_ADDR": LOOPBACK,
            "SPOTRUN_TRAINER_USER": "",
        }

        def start() -> subprocess.Popen[bytes]:
            with open(home / "console.log", "wb") as out:
                return subprocess.Popen(
                    ["bash", str(home / "user-data.sh")],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_parent(),
                )

        self.procs[instance_id] = on_spawner_thread(start)
        log.info("rehearsal: %s played by local process %d", instance_id, self.procs[instance_id].pid)

    def exit_status(self, instance_id: str) -> int | None:
        proc = self.procs.get(instance_id)
        return None if proc is None else proc.poll()

    def stop(self, instance_id: str) -> None:
        """The instance is gone: so is everything that played it."""
        proc = self.procs.get(instance_id)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        proc.wait()


class RehearsalProvider:
    """`AwsProvider` whose instances are played by `LocalInstances`."""

    name = "aws"

    def __init__(
        self, cfg: AwsProviderConfig, root: Path, flow_run_id: str | None, installation: str | None = None
    ) -> None:
        self.prewarm = cfg.prewarm
        self.warm = WarmSettings(cfg.warm, cfg.warm_idle_s)
        self.heartbeat_timeout_s = cfg.heartbeat_timeout_s
        self.rebalance_wait_s = cfg.rebalance_prewarm_s if cfg.prewarm else None
        self.capacity_poll_s = 30.0
        self.instances = LocalInstances(root)
        self.inner = AwsProvider.from_config(
            cfg,
            flow_run_id=flow_run_id,
            installation=installation,
            launcher=self.instances.launch,
            exit_status=self.instances.exit_status,
        )

    @property
    def prices(self) -> Prices | None:
        """The inner provider's, asked of the test endpoint."""
        return self.inner.prices

    @prices.setter
    def prices(self, value: Prices | None) -> None:
        self.inner.prices = value

    def provision(
        self, job: JobSpec, attempt: int, spec_path: Path, extra_args: list[str], *, market: Market = "spot"
    ) -> Worker:
        return self.inner.provision(job, attempt, spec_path, extra_args, market=market)

    def watch(
        self, worker: Worker, on_status: StatusCallback | None = None, on_log: LogCallback | None = None
    ) -> WatchResult:
        return self.inner.watch(worker, on_status, on_log)

    def stop(self, worker: Worker, cause: StopCause) -> WatchResult:
        return self.inner.stop(worker, cause)

    def stop_leftovers(self, flow_run_id: str) -> list[str]:
        """[]: the instances a dead controller played were its own processes, and died with it."""
        return []

    def release(self, worker: Worker) -> None:
        state: AwsWorkerState = worker.handle
        try:
            self.inner.release(worker)
        finally:
            for iid in state.instance_ids:
                self.instances.stop(iid)
