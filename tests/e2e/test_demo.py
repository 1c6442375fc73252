"""`make demo` end to end: `python -m spotrun.demo` in a fresh SPOTRUN_HOME, against its own Prefect
server, read back through the history command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spotrun.demo import TOTAL_STEPS
from spotrun.tasks.history import HistoryStore, default_url
from spotrun.trainer.checkpoint.format import MANIFEST, step_dir
from tests.integration.test_cli import table_rows
from tests.prefect_server import seed
from tests.trainer_runs import REPO


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_end_to_end(tmp_path: Path) -> None:
    seed(tmp_path / "prefect")  # the server's migrated tables (tests/prefect_server.py): 8 s less
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPOTRUN_HOME": str(tmp_path)}
    env = {k: v for k, v in env.items() if not k.startswith("SPOTRUN_SLACK_")}  # never a real Slack
    for k in ("PREFECT_API_URL", "SPOTRUN_DATABASE_URL"):  # the demo ignores them; make sure of it
        env[k] = "http://127.0.0.1:9/api" if k == "PREFECT_API_URL" else "postgresql://x@127.0.0.1:9/x"
    r = subprocess.run(
        [sys.executable, "-m", "spotrun.demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "PASS" in r.stdout and "FAIL" not in r.stdout
    outcomes = [row[1] for row in table_rows(r.stdout) if len(row) > 2]  # not the alert's panel
    assert len(outcomes) >= 4 and outcomes[-1] == "completed", r.stdout
    assert set(outcomes[:-1]) == {"preempted"}, r.stdout
    assert "reclaimed without notice" in r.stdout
    demo = tmp_path / "demo"
    assert (demo / "checkpoints" / step_dir(TOTAL_STEPS) / MANIFEST).is_file()
    assert (demo / "checkpoints" / "reports" / "timeline.png").is_file()
    assert (tmp_path / "history.db").is_file() and (tmp_path / "prefect" / "server.log").is_file()
    assert not (demo / "history.db").exists()  # one history per SPOTRUN_HOME: the demo's run is in it
    made = [tmp_path, *tmp_path.rglob("*")]  # SPOTRUN_HOME: 0700, everything in it 0600/0700
    assert [p for p in made if p.stat().st_mode & 0o077] == []
    assert "/runs/flow-run/" in r.stdout and "the Prefect server has stopped" in r.stdout
    # the three restarts raised one restart-storm alert through the deployed path (no Slack set here)
    assert "restart-storm alert for digits: no Slack configured" in r.stdout
    assert "digits restarted 3 times in 1 h" in r.stdout
    store = HistoryStore.open(default_url(tmp_path))
    storms = store.alerts(job="digits", kind="restart-storm")  # a recovery note may follow, or not yet
    store.close()
    assert [a.status.value for a in storms] == ["logged"]
    env.pop("SPOTRUN_DATABASE_URL")
    history = subprocess.run(
        [sys.executable, "-m", "spotrun.cli", "history", "digits", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert history.returncode == 0, history.stderr
    assert [r["outcome"] for r in json.loads(history.stdout)][-1] == "completed"
