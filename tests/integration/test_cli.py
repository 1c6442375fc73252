"""`spotrun checkpoints list/verify` against checkpoints a real trainer wrote, `spotrun history` against a
SQLite history, `spotrun run`'s input checks, `spotrun deploy` onto the background Prefect server, and the
demo (the whole flow) end to end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from spotrun.cli import main
from spotrun.tasks.decisions.attempts import AttemptRecord, Outcome
from spotrun.tasks.history import HistoryStore, default_url
from spotrun.trainer.checkpoint.format import MANIFEST, step_dir
from spotrun.trainer.storage import open_storage
from spotrun.trainer.storage.options import S3Options
from tests.trainer_runs import REPO, trainer, write_spec

STEPS = (28, 30)  # total_steps 30, a checkpoint every 7, keep 2: the final one and the one before


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One small digits run: (its job file, its storage directory). Tests copy it before changing it."""
    work = tmp_path_factory.mktemp("cli-job")
    spec = write_spec(work / "job.yaml", total_steps=30, args={"hidden": 32})
    r = trainer(spec, str(work / "store"), work)
    assert r.returncode == 0, r.stderr[-2000:]
    return spec, work / "store"


@pytest.fixture
def store(job: tuple[Path, Path], tmp_path: Path) -> Path:
    """A private copy of the job's storage."""
    return Path(shutil.copytree(job[1], tmp_path / "store"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def listed(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    code, out, _ = run(capsys, "checkpoints", "list", "--json", *argv)
    assert code == 0
    rows: list[dict[str, Any]] = json.loads(out)
    return rows


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    assert err.startswith("spotrun: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_list_table_shows_each_step_valid_and_latest(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, Path]
) -> None:
    code, out, _ = run(capsys, "checkpoints", "list", str(job[1]))
    assert code == 0
    assert f"checkpoints in {job[1]}" in out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert [line.split("│")[1].strip() for line in rows] == ["30", "28"]
    assert "latest" in rows[0] and "latest" not in rows[1]
    assert all(line.split("│")[5].strip() == "yes" for line in rows)


def test_list_json(capsys: pytest.CaptureFixture[str], job: tuple[Path, Path]) -> None:
    rows = listed(capsys, str(job[1]))
    assert [r["step"] for r in rows] == sorted(STEPS, reverse=True)
    assert all(r["committed"] and r["valid"] and r["problems"] == [] and r["size"] > 0 for r in rows)
    assert [r["latest"] for r in rows] == [True, False]
    assert "best_loss" in rows[0]["metrics"] and "loss" in rows[1]["metrics"]


def test_verify_valid(capsys: pytest.CaptureFixture[str], job: tuple[Path, Path]) -> None:
    spec, store = job
    code, out, _ = run(capsys, "checkpoints", "verify", str(store))
    assert (code, out) == (0, f"step 30 in {store}: valid\n")
    code, _, _ = run(capsys, "checkpoints", "verify", f"file://{store}", "--spec", str(spec))
    assert code == 0


def test_spec_storage_is_the_default_uri(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, Path], tmp_path: Path
) -> None:
    spec = write_spec(tmp_path / "job.yaml", total_steps=30, args={"hidden": 32}, storage=str(job[1]))
    code, out, _ = run(capsys, "checkpoints", "verify", "--spec", str(spec))
    assert (code, out) == (0, f"step 30 in {job[1]}: valid\n")


def test_a_different_jobs_spec_is_reported_first(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, Path], tmp_path: Path
) -> None:
    other = write_spec(tmp_path / "other.yaml", total_steps=30, args={"hidden": 16})
    code, out, _ = run(capsys, "checkpoints", "verify", str(job[1]), "--spec", str(other))
    assert code == 1  # the shape hash alone tells: no recipe built
    assert out.startswith("step 30: compat: made by a job with different shape settings")
    code, out, _ = run(capsys, "checkpoints", "verify", str(job[1]), "--spec", str(other), "--structure")
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith("step 30: compat: made by a job with different shape settings")
    assert any("structure" in line and "model.safetensors" in line for line in lines[1:])
    rows = listed(capsys, str(job[1]), "--spec", str(other))
    assert not any(r["valid"] for r in rows)


def test_list_builds_no_recipe_and_verify_structure_does(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, Path], tmp_path: Path
) -> None:
    broken = write_spec(tmp_path / "b.yaml", total_steps=30, args={"hidden": 32, "nonsense": 1})
    rows = listed(capsys, str(job[1]), "--spec", str(broken))  # its recipe would not build: never tried
    assert [r["valid"] for r in rows] == [False, False]
    assert rows[0]["problems"][0]["kind"] == "compat"
    code, _, err = run(capsys, "checkpoints", "verify", str(job[1]), "--spec", str(broken), "--structure")
    assert_one_line_error(code, err, "recipe 'digits' has no argument 'nonsense'", "fix args in the job")


def test_corrupt_newest_fails_verify_naming_file(capsys: pytest.CaptureFixture[str], store: Path) -> None:
    flip_middle_byte(store / step_dir(30) / "model.safetensors")
    code, out, _ = run(capsys, "checkpoints", "verify", str(store))
    assert (code, out) == (1, "step 30: integrity: xxh3_128 mismatch in model.safetensors\n")
    rows = listed(capsys, str(store))
    assert [(r["step"], r["valid"]) for r in rows] == [(30, False), (28, True)]
    assert rows[0]["problems"] == [
        {"kind": "integrity", "file": "model.safetensors", "detail": "xxh3_128 mismatch"}
    ]


def test_partial_newest_is_listed_and_verify_checks_newest_committed(
    capsys: pytest.CaptureFixture[str], store: Path
) -> None:
    (store / step_dir(30) / MANIFEST).unlink()
    rows = listed(capsys, str(store))
    assert [(r["step"], r["committed"], r["valid"]) for r in rows] == [(30, False, False), (28, True, True)]
    code, out, _ = run(capsys, "checkpoints", "verify", str(store))
    assert (code, out) == (0, f"step 28 in {store}: valid\n")


def test_empty_storage(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "checkpoints", "verify", str(tmp_path))
    assert (code, out) == (1, f"no committed checkpoint in {tmp_path}\n")
    assert listed(capsys, str(tmp_path)) == []
    code, out, _ = run(capsys, "checkpoints", "list", str(tmp_path))
    assert (code, out) == (0, f"no checkpoints in {tmp_path}\n")


@pytest.mark.parametrize(
    ("uri", "fragment"),
    [
        ("gs://bucket/job", "unsupported scheme"),
        ("s3://", "names no bucket"),
        ("/nonexistent/spotrun/storage", "does not exist"),
    ],
)
def test_bad_uri_is_one_line_error(capsys: pytest.CaptureFixture[str], uri: str, fragment: str) -> None:
    code, _, err = run(capsys, "checkpoints", "verify", uri)
    assert_one_line_error(code, err, fragment)
    assert not Path("/nonexistent").exists()  # a read-only command creates nothing


def test_bad_spec_is_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "checkpoints", "list", str(tmp_path), "--spec", str(tmp_path / "missing.yaml"))
    assert_one_line_error(code, err, "cannot read job file")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nrecipe: digits\ntotal_steps: 0\n")
    code, _, err = run(capsys, "checkpoints", "list", str(tmp_path), "--spec", str(bad))
    assert_one_line_error(code, err, "total_steps")


def test_missing_bucket_is_one_line_error(capsys: pytest.CaptureFixture[str], moto_server: str) -> None:
    bucket = f"spotrun-missing-{uuid.uuid4().hex[:8]}"
    code, _, err = run(capsys, "checkpoints", "list", f"s3://{bucket}/job", "--endpoint-url", moto_server)
    assert_one_line_error(code, err, f"bucket '{bucket}' does not exist")


def test_list_and_verify_on_s3(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, Path], s3_bucket: tuple[str, str]
) -> None:
    endpoint, bucket = s3_bucket
    remote = open_storage(f"s3://{bucket}/jobs/cli", S3Options(endpoint_url=endpoint))
    for f in sorted(job[1].rglob("*")):
        if f.is_file():
            remote.put(f.relative_to(job[1]).as_posix(), f)
    rows = listed(capsys, f"s3://{bucket}/jobs/cli", "--endpoint-url", endpoint, "--region", "us-east-1")
    assert [(r["step"], r["valid"], r["latest"]) for r in rows] == [(30, True, True), (28, True, False)]
    code, out, _ = run(capsys, "checkpoints", "verify", f"s3://{bucket}/jobs/cli", "--endpoint-url", endpoint)
    assert (code, out) == (0, f"step 30 in s3://{bucket}/jobs/cli: valid\n")


def test_module_entry_point_exit_codes(tmp_path: Path) -> None:
    """`python -m spotrun.cli` as a user runs it: exit codes and stderr without a traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "spotrun.cli", "checkpoints", "verify"]
    r = subprocess.run([*cmd, "ftp://host/x"], env=env, capture_output=True, text=True, timeout=120)
    assert_one_line_error(r.returncode, r.stderr, "unsupported scheme")
    r = subprocess.run([*cmd, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "no committed checkpoint" in r.stdout


# ---- spotrun history ----

T0 = 1_700_000_000.0


def attempt(
    n: int, outcome: Outcome, cause: str, resumed_from: int | None, *, last_step: int, after: float = 0
) -> AttemptRecord:
    start = T0 + 10 * n + after
    return AttemptRecord(
        attempt=n,
        worker_id=f"local-{100 + n}",
        provider="local",
        started_at=start,
        ended_at=start + 5,
        outcome=outcome,
        cause=cause,
        resumed_from=resumed_from,
        last_step=last_step,
        lost_steps=3 if outcome is Outcome.PREEMPTED else 0,
        wall_s=5.0,
    )


@pytest.fixture
def history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """A SQLite history with two job runs (digits: preempted then completed; other: crashed), and
    SPOTRUN_DATABASE_URL pointing at it: (url, the digits job run's id)."""
    url = default_url(tmp_path)
    monkeypatch.setenv("SPOTRUN_DATABASE_URL", url)
    with HistoryStore.open(url) as store:
        run = store.start_job_run(
            "digits", "hash", None, storage_uri=str(tmp_path / "store"), provider="local"
        )
        store.record_attempt(
            run, attempt(1, Outcome.PREEMPTED, "reclaimed without notice (SIGKILL)", None, last_step=40)
        )
        store.record_attempt(run, attempt(2, Outcome.COMPLETED, "completed at step 300", 25, last_step=300))
        store.finish_job_run(run, "completed")
        other = store.start_job_run(
            "other", "hash", None, storage_uri=str(tmp_path / "other"), provider="local"
        )
        store.record_attempt(
            other, attempt(1, Outcome.CRASHED, "exited CRASHED: boom", None, last_step=7, after=100)
        )
    return url, run


def table_rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]


def test_history_table(capsys: pytest.CaptureFixture[str], history: tuple[str, str]) -> None:
    code, out, _ = run(capsys, "history")
    assert code == 0
    rows = table_rows(out)
    assert [(r[0], r[2], r[3]) for r in rows] == [
        ("digits", "1", "preempted"),
        ("digits", "2", "completed"),
        ("other", "1", "crashed"),
    ]
    assert rows[0][1] == history[1][:8]
    assert rows[0][4:8] == ["reclaimed without notice (SIGKILL)", "scratch", "40", "3"]
    assert rows[1][5:7] == ["25", "300"]
    code, out, _ = run(capsys, "history", "digits", "--limit", "1")
    assert [(r[0], r[2]) for r in table_rows(out)] == [("digits", "2")]


def test_history_json(capsys: pytest.CaptureFixture[str], history: tuple[str, str]) -> None:
    code, out, _ = run(capsys, "history", "digits", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [(r["attempt"], r["outcome"], r["resumed_from"], r["last_step"]) for r in rows] == [
        (1, "preempted", None, 40),
        (2, "completed", 25, 300),
    ]
    assert {r["job_run_id"] for r in rows} == {history[1]}
    assert rows[0]["cause"] == "reclaimed without notice (SIGKILL)" and rows[0]["started_at"] == T0 + 10


def test_history_without_a_database_creates_none(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTRUN_DATABASE_URL", default_url(tmp_path / "nothing"))
    code, out, _ = run(capsys, "history")
    assert (code, out) == (0, f"no attempts in {default_url(tmp_path / 'nothing')}\n")
    assert not (tmp_path / "nothing").exists()
    code, out, _ = run(capsys, "history", "--json")
    assert (code, json.loads(out)) == (0, [])


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("postgresql://spotrun@127.0.0.1:9/history", "is unreachable"),  # port 9 (discard): refused
        ("not a url", "is not a URL"),
    ],
)
def test_history_database_unusable_is_one_line_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, url: str, fragment: str
) -> None:
    monkeypatch.setenv("SPOTRUN_DATABASE_URL", url)
    code, _, err = run(capsys, "history")
    assert_one_line_error(code, err, fragment)


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "table"])
def test_a_closed_stdout_ends_quietly(history: tuple[str, str], tmp_path: Path, json_out: bool) -> None:
    """`spotrun history --json | head -1`: the reader is gone, so stop quietly: 141 (128 + SIGPIPE),
    for JSON and for a table (rich's console would end it with 1, a failed run's code)."""
    read, write = os.pipe()
    os.close(read)  # gone before the first write: every write fails with EPIPE
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPOTRUN_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "spotrun.cli", "history", *(["--json"] if json_out else [])]
    try:
        r = subprocess.run(cmd, env=env, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (141, "")


def test_report_plot_to_an_unwritable_path_is_one_line_error(
    capsys: pytest.CaptureFixture[str], history: tuple[str, str], tmp_path: Path
) -> None:
    (tmp_path / "afile").write_text("a file, not a directory\n")
    for path, why in [("/proc/x.png", "No such file or directory"), (str(tmp_path / "afile" / "x.png"), "")]:
        code, out, err = run(capsys, "report", "digits", "--plot", path)
        assert_one_line_error(code, err, f"--plot {path}: cannot write there ({why}", "give a writable path")
        assert out == ""


# ---- spotrun run: input errors (the demo below runs the flow) ----


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--preempt-at", "1,x"], "--preempt-at '1,x'"),
        (["--preempt-at", "1:later"], "unknown mode 'later'"),
        (["--notice-s", "-1"], "--notice-s -1.0: Input should be greater than or equal to 0"),
        (["--total-steps", "0"], "--total-steps 0: Input should be greater than or equal to 1"),
        (["--max-errors", "0"], "--max-errors 0"),
        (["--no-notice-fraction", "0.5"], "applies to --preempt-every"),
        (["--preempt-every", "5", "--no-notice-fraction", "2"], "--no-notice-fraction 2.0"),
        (["--storage", "gs://bucket/x"], "unsupported scheme"),
    ],
)
def test_run_bad_input_is_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: list[str], fragment: str
) -> None:
    spec = write_spec(tmp_path / "job.yaml", storage=str(tmp_path / "store"))
    code, out, err = run(capsys, "run", str(spec), *extra)
    assert_one_line_error(code, err, fragment)
    assert out == ""  # rejected before any server starts


@pytest.mark.parametrize(
    ("files", "entrypoint", "fragment"),
    [
        ([], "nosuch_loop_41c.train:main", "ModuleNotFoundError: No module named 'nosuch_loop_41c'"),
        # a trainer.py beside it is the project's own (no refusal for its name): the missing main is
        (["myloop.py", "trainer.py"], "myloop:main", "has no attribute 'main'"),
    ],
)
def test_run_refuses_an_entrypoint_that_cannot_run(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    files: list[str],
    entrypoint: str,
    fragment: str,
) -> None:
    """Checked in a subprocess with a local worker's path (this directory first), before a server starts."""
    for name in files:
        (tmp_path / name).write_text("")
    monkeypatch.chdir(tmp_path)
    spec = write_spec(
        tmp_path / "job.yaml", storage=str(tmp_path / "store"), recipe=None, entrypoint=entrypoint
    )
    code, out, err = run(capsys, "run", str(spec))
    assert_one_line_error(code, err, f"entrypoint {entrypoint!r}", fragment)
    assert out == ""


AWS = "kind: aws\nregion: ca-central-1\ninstance_types: [g6.xlarge]\nimage_id: ami-0123456789abcdef0\n"


@pytest.mark.parametrize(
    ("provider", "extra", "fragment"),
    [
        (None, [], "cannot read provider file"),
        ("region: ca-central-1\n", [], "a mapping with `kind: local` or `kind: aws`"),
        ("kind: gcp\n", [], "kind: Input tag 'gcp' found using 'kind' does not match any of the expected"),
        (AWS.replace("ca-central-1", "Canada"), [], "region"),
        (
            AWS.replace("image_id: ami-0123456789abcdef0\n", ""),
            [],
            "set image_id (an AMI) or launch_template",
        ),
        (AWS, ["--preempt-at", "1"], "drive the local spot simulator; drop them for kind aws"),
    ],
)
def test_run_bad_provider_file_is_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, provider: str | None, extra: list[str], fragment: str
) -> None:
    spec = write_spec(tmp_path / "job.yaml", storage=str(tmp_path / "store"))
    path = tmp_path / "provider.yaml"
    if provider is not None:
        path.write_text(provider)
    code, out, err = run(capsys, "run", str(spec), "--provider", str(path), *extra)
    assert_one_line_error(code, err, fragment)
    assert out == ""


def test_run_missing_job_file_is_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "run", str(tmp_path / "missing.yaml"))
    assert_one_line_error(code, err, "cannot read job file", "missing.yaml")
    assert out == ""


def test_prefect_api_uses_the_server_the_environment_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.settings import PREFECT_API_URL

    from spotrun.server import prefect_api

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    with prefect_api(tmp_path) as api:
        assert (api.url, api.server, PREFECT_API_URL.value()) == ("http://127.0.0.1:9/api", None, api.url)
        assert api.flow_run_url("abc") == "http://127.0.0.1:9/runs/flow-run/abc"
    assert not (tmp_path / "prefect").exists()  # no server of its own


SERVER_CHILD = """
import sys, time
from pathlib import Path
from spotrun.server import PrefectServer
print(PrefectServer(Path(sys.argv[1])).spawn().pid, flush=True)
time.sleep(600)
"""


def test_prefect_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A demo or `spotrun run` killed with SIGKILL must not leave its server holding the database."""
    from tests.procs import wait_gone

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", SERVER_CHILD, str(tmp_path / "prefect")]
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        server_pid = int(child.stdout.readline())
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert wait_gone(server_pid, 20), f"prefect server {server_pid} outlived its parent"
    finally:
        if child.poll() is None:
            child.kill()


# ---- spotrun deploy ----


@pytest.mark.timeout(300)
def test_deploy_uses_the_background_server(tmp_path: Path) -> None:
    """PREFECT_API_URL unset: `spotrun deploy` applies to the background server, as `run` and `serve` do."""
    import base64
    import urllib.request

    from spotrun.server import auth_string, server_home, start_background, stop_background
    from tests.prefect_server import seed

    home = tmp_path / "home"
    seed(server_home(home))  # migrated tables: the start takes 4 s instead of 12
    bg, _ = start_background(home, port=0)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env |= {"PYTHONPATH": str(REPO), "SPOTRUN_HOME": str(home)}
        cmd = [sys.executable, "-m", "spotrun.cli", "deploy", "--json"]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        applied = json.loads(r.stdout)["deployments"]
        basic = base64.b64encode(auth_string(server_home(home)).encode()).decode()
        url = f"{bg.api_url}/deployments/name/recover-job/recover-job"  # with the server's auth string
        req = urllib.request.Request(url, headers={"Authorization": f"Basic {basic}"})
        with urllib.request.urlopen(req) as resp:
            assert json.load(resp)["id"] == applied["recover-job/recover-job"]  # on that server
    finally:
        stop_background(home)


def test_run_refuses_a_deadline_even_on_demand_cannot_make_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTRUN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # refused before any server is asked
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: dated\nrecipe: digits\ntotal_steps: 1000\nseconds_per_step: 1\ndeadline: 10m\n"
        f"storage: {tmp_path / 'store'}\n"
    )
    code, _, err = run(capsys, "run", str(spec))
    assert_one_line_error(code, err, "refused: deadline 10m is 0.17 h away", "1000 steps left take 0.31 h")
    assert not (tmp_path / "home" / "prefect").exists()  # no server was started, no flow run made


def test_run_refuses_a_budget_the_replays_prices_cannot_pay_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTRUN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # refused before any server is asked
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: priced\nrecipe: digits\ntotal_steps: 1000\nseconds_per_step: 1\nbudget_usd: 0.1\n"
        f"storage: {tmp_path / 'store'}\n"
    )
    traces = Path(__file__).resolve().parents[1] / "data" / "spot-traces" / "us-east-2"
    provider = tmp_path / "provider.yaml"
    provider.write_text(
        f"kind: local\ntrace: {traces}\nspot_price_per_h: 0.918\non_demand_price_per_h: 3.06\n"
    )
    code, _, err = run(capsys, "run", str(spec), "--provider", str(provider))
    assert_one_line_error(code, err, "refused: budget_usd 0.1 cannot pay", "even all on spot")
    assert not (tmp_path / "home" / "prefect").exists()
