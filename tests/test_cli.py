"""The command line, driven as a user would drive it (`python -m unbroken ...` and the
`unbroken` console script), against real run directories: finished after a retry, errored,
left behind by a driver killed with SIGKILL, and damaged on disk."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import driver_env, read_until, start_script
from test_driver_kill import wait_exited, worker_pids
from toy_loops import toy_loop
from unbroken.train import DataParallelTrainer, FailureConfig, Result, RunConfig, TrainingFailedError

KILLED_DRIVER = """
import sys
from toy_loops import toy_loop
from unbroken.train import DataParallelTrainer, RunConfig
DataParallelTrainer(toy_loop, train_loop_config={"iterations": 12, "echo": True, "block_fifo": sys.argv[3],
                                                 "block_at": [5, 1]},
                    run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
"""
RUNS = ["damaged", "errored", "finished", "killed"]


def cli(*args: str, cwd=None, script: bool = False, **env) -> subprocess.CompletedProcess:
    """Run the command line in a fresh process: `python -m unbroken`, or the console script."""
    command = [os.path.join(os.path.dirname(sys.executable), "unbroken")] if script else \
        [sys.executable, "-m", "unbroken"]
    return subprocess.run([*command, *args], env=driver_env(**env), cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def fit(storage: str, name: str, config: dict, max_failures: int = 0) -> Result:
    return DataParallelTrainer(toy_loop, train_loop_config=config, run_config=RunConfig(
        name=name, storage_path=storage, failure_config=FailureConfig(max_failures=max_failures),
        verbose=0)).fit()


def snapshot(root: str) -> dict:
    """Every path under `root` with its mtime, size and content hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.stat(full)
            digest = hashlib.sha256(open(full, "rb").read()).hexdigest() if name in filenames else None
            out[os.path.relpath(full, root)] = (st.st_mtime_ns, st.st_size, digest)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A storage path with four runs and two directories that are not runs."""
    root = tmp_path_factory.mktemp("cli")
    storage = str(root / "results")
    # Attempt 1 fails at iteration 8, after checkpoint 6; attempt 2 resumes from it and finishes.
    fit(storage, "finished", {"iterations": 10, "fail_at": [[8, 1]]}, max_failures=1)
    # Fails at iteration 5 in attempt 1, and would fail again at 7 in attempt 2.
    with pytest.raises(TrainingFailedError):
        fit(storage, "errored", {"iterations": 9, "fail_at": [[5, 1], [7, 2]]})
    # The driver is SIGKILLed while its worker waits after reporting iteration 5.
    fifo = str(root / "fifo")
    os.mkfifo(fifo)
    driver = start_script(KILLED_DRIVER, storage, "killed", fifo)
    read_until(driver, "BLOCKING")
    killed = os.path.join(storage, "killed")
    live = {"ls": cli("ls", storage, "--json"), "show": cli("show", killed), "resume": cli("resume", killed),
            "pid": driver.pid}
    workers = worker_pids(driver.pid)
    driver.kill()
    driver.wait()
    assert all(wait_exited(pid, 10) for pid in workers)
    # A copy of "finished", damaged: checkpoint 3 torn, checkpoint 6 corrupted, checkpoint 9
    # intact, plus an uncommitted leftover and a checkpoint set aside by an earlier resume.
    damaged = os.path.join(storage, "damaged")
    shutil.copytree(os.path.join(storage, "finished"), damaged)
    with open(os.path.join(damaged, "checkpoint_000003", "weights.bin"), "r+b") as f:
        f.truncate(100)
    with open(os.path.join(damaged, "checkpoint_000006", "weights.bin"), "r+b") as f:
        f.seek(1000)
        f.write(b"\xff")
    for leftover in ("checkpoint_000012.tmp-3", "checkpoint_000004.corrupt-0"):
        os.makedirs(os.path.join(damaged, leftover))
        open(os.path.join(damaged, leftover, "it.txt"), "w").write("4")
    os.makedirs(os.path.join(storage, "notes"))
    open(os.path.join(storage, "README.txt"), "w").write("not a run")
    return {"storage": storage, "snapshot": snapshot(storage), "live": live}


def run_path(results, name: str) -> str:
    return os.path.join(results["storage"], name)


def table(stdout: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in stdout.splitlines()[1:]}


def test_ls_lists_runs_with_their_state_and_skips_other_directories(results):
    out = cli("ls", results["storage"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].split() == ["NAME", "STATUS", "ATTEMPTS", "ITER", "LAST", "METRIC",
                                                  "GOODPUT", "LATEST", "CHECKPOINT", "UPDATED"]
    rows = table(out.stdout)
    assert sorted(rows) == RUNS, "notes/ and README.txt are not runs"
    finished, errored = (rows[name][1:5] + rows[name][6:7] for name in ("finished", "errored"))
    assert finished == ["FINISHED", "2", "10", "loss=0.3", "checkpoint_000009"]
    assert errored == ["ERRORED", "1", "4", "loss=0.35", "checkpoint_000003"]
    assert all(re.fullmatch(r"\d+\.\d%", rows[name][5]) for name in ("finished", "errored", "killed"))
    assert rows["killed"][1:3] == ["ABORTED", "1"], "RUNNING in run.json, but its driver is gone"
    assert rows["killed"][3] in ("4", "5") and rows["killed"][6] == "checkpoint_000003"
    assert rows["damaged"][6] == "checkpoint_000009"

    by_name = {r["name"]: r for r in json.loads(cli("ls", results["storage"], "--json").stdout)}
    assert sorted(by_name) == RUNS
    assert by_name["killed"]["status"] == "ABORTED" and by_name["killed"]["recorded_status"] == "RUNNING"
    assert by_name["finished"]["last_metrics"]["training_iteration"] == 10
    assert [a["status"] for a in by_name["finished"]["attempts"]] == ["ERRORED", "FINISHED"]

    # The console script, with the storage path from UNBROKEN_STORAGE (as RunConfig defaults it).
    out = cli("ls", "--metric", "acc", script=True, UNBROKEN_STORAGE=results["storage"])
    assert out.returncode == 0, out.stderr
    assert table(out.stdout)["finished"][4] == "acc=1"


def test_a_run_with_a_live_driver_shows_it_and_is_not_resumed(results):
    live = results["live"]
    runs = {r["name"]: r for r in json.loads(live["ls"].stdout)}
    assert runs["killed"]["status"] == "RUNNING" and runs["killed"]["driver"]["pid"] == live["pid"]
    driver_line = rf"^driver\s+pid {live['pid']} on \S+ \(heartbeat \d+ s ago\)$"
    assert re.search(driver_line, live["show"].stdout, re.M)
    assert live["resume"].returncode == 1
    assert live["resume"].stderr.startswith("unbroken: error: run ")
    assert "is being driven by another process (pid" in live["resume"].stderr


def test_show_lists_attempts_checkpoints_config_and_last_metrics(results):
    out = cli("show", run_path(results, "finished"))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert re.search(r"^status\s+FINISHED$", text, re.M)
    assert re.search(r"^\s+1\s+ERRORED\s.*\s-\s+RuntimeError: injected failure at iteration 8$", text, re.M)
    assert re.search(r"^\s+2\s+FINISHED\s.*\scheckpoint_000006\s+-$", text, re.M)
    for it in (3, 6, 9):
        assert re.search(rf"^\s+checkpoint_00000{it}\s+committed\s+{it}\s", text, re.M)
    assert re.search(r'^\s+train_loop_config\s+\{"fail_at": \[\[8, 1\]\], "iterations": 10\}$', text, re.M)
    assert re.search(r"^\s+train_loop_per_worker\s+toy_loops:toy_loop$", text, re.M)
    assert "last metrics (iteration 10, attempt 2)" in text
    assert re.search(r"^\s+loss\s+0.3$", text, re.M)

    text = cli("show", run_path(results, "killed")).stdout
    assert re.search(r"^status\s+ABORTED \(run.json says RUNNING; the driver stopped", text, re.M)
    assert re.search(r"^\s+1\s+ABORTED\s.*the driver stopped without recording an end", text, re.M)

    text = cli("show", run_path(results, "damaged")).stdout
    assert re.search(r"checkpoint_000003\s+torn: file 'weights.bin' has 100 bytes, the marker says 4096",
                     text)
    assert re.search(r"checkpoint_000004.corrupt-0\s+quarantined", text)
    assert re.search(r"checkpoint_000012.tmp-3\s+uncommitted", text)

    summary = json.loads(cli("show", run_path(results, "damaged"), "--json").stdout)
    states = {c["name"]: c["state"] for c in summary["checkpoints"]}
    assert states == {"checkpoint_000003": "torn", "checkpoint_000004.corrupt-0": "quarantined",
                      "checkpoint_000006": "committed", "checkpoint_000009": "committed",
                      "checkpoint_000012.tmp-3": "uncommitted"}, "show checks sizes; verify checks hashes"
    assert summary["config"] == {"fail_at": [[8, 1]], "iterations": 10}


def test_verify_hashes_every_checkpoint_and_names_the_bad_ones(results):
    out = cli("verify", run_path(results, "finished"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "3 of 3 checkpoints verified"

    out = cli("verify", run_path(results, "damaged"))
    assert out.returncode == 1
    assert re.search(r"^checkpoint_000003\s+torn\s+file 'weights.bin' has 100 bytes", out.stdout, re.M)
    assert re.search(r"^checkpoint_000006\s+corrupted\s+file 'weights.bin' does not match its hash",
                     out.stdout, re.M)
    assert re.search(r"^checkpoint_000009\s+ok\s+2 files, 4.0 KiB$", out.stdout, re.M)
    assert re.search(r"^checkpoint_000012.tmp-3\s+uncommitted\s", out.stdout, re.M)
    assert out.stdout.splitlines()[-1] == "1 of 3 checkpoints verified; 1 torn, 1 corrupted"
    assert "hint: a resume starts from checkpoint_000009" in out.stderr

    report = json.loads(cli("verify", run_path(results, "damaged"), "--json").stdout)
    assert report["ok"] is False and report["resume_point"] == "checkpoint_000009"


def test_plot_writes_a_png_with_the_chosen_metrics(results, tmp_path):
    import matplotlib.image

    png = str(tmp_path / "finished.png")
    out = cli("plot", run_path(results, "finished"), "-o", png, "--metric", "loss", "--metric", "acc")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"wrote {png}: loss, acc against training_iteration"
    pixels = matplotlib.image.imread(png)
    height, width = pixels.shape[:2]
    assert (width, height) == (800, 560), "two stacked panels at 100 dpi"
    ink = (pixels[:, :, :3] < 0.9).any(axis=2).mean()
    assert 0.01 < ink < 0.5, f"{ink:.1%} of the pixels are drawn"

    out = cli("plot", run_path(results, "killed"), cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert os.path.getsize(tmp_path / "killed.png") > 10_000, "default: ./<name>.png, every metric"

    out = cli("plot", run_path(results, "finished"), "--metric", "accuracy")
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["unbroken: error: run 'finished' has no metric 'accuracy'.",
                                       "hint: choose from loss, acc, time_total_s, time_this_iter_s"]

    # --goodput: the time as coloured bands under the rows; the productive green is drawn.
    png = str(tmp_path / "finished-goodput.png")
    out = cli("plot", run_path(results, "finished"), "--goodput", "-o", png)
    assert out.returncode == 0 and out.stdout.strip() == f"wrote {png}: where the run's time went", out.stderr
    pixels = matplotlib.image.imread(png)[:, :, :3]
    green = ((abs(pixels[:, :, 0] - 0x2c / 255) < 0.02) & (abs(pixels[:, :, 1] - 0xa0 / 255) < 0.02)).mean()
    assert green > 0.001, f"{green:.2%} of the pixels are the productive band's"
    assert cli("plot", run_path(results, "finished"), "--goodput", "--metric", "loss").returncode == 2


def test_errors_are_one_line_and_a_hint_with_meaningful_exit_codes(results, tmp_path):
    out = cli("show", str(tmp_path / "nowhere"))
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"unbroken: error: no run at '{tmp_path / 'nowhere'}': the path does not exist.",
        "hint: check the path; a run is <storage_path>/<name>"]
    out = cli("verify", os.path.join(results["storage"], "README.txt"))
    assert out.returncode == 2 and "is a file, not a run directory" in out.stderr
    out = cli("show", os.path.join(results["storage"], "notes"))
    assert out.returncode == 2 and "has no .unbroken/run.json" in out.stderr
    assert cli().returncode == 2
    out = cli("resume", run_path(results, "errored"), "--max-failures", "many")
    assert out.returncode == 2 and "expected an integer >= -1" in out.stderr

    # A run whose manifest (and its fallback) is garbage: listed as UNREADABLE, exit 1.
    broken = tmp_path / "storage" / "broken" / ".unbroken"
    broken.mkdir(parents=True)
    (broken / "run.json").write_text("{not json")
    out = cli("ls", str(tmp_path / "storage"))
    assert out.returncode == 1
    assert table(out.stdout)["broken"][1] == "UNREADABLE"
    assert "run.json is corrupted" in out.stderr
    out = cli("show", str(tmp_path / "storage" / "broken"))
    assert out.returncode == 1 and out.stderr.startswith("unbroken: error: run ")
    assert "Traceback" not in out.stderr


def test_read_only_commands_leave_the_run_directories_untouched(results, tmp_path):
    """ls, show, verify and plot never clean up, quarantine or rewrite anything. The snapshot
    was taken when the runs were made, so the commands of the tests above count too."""
    for name in ("damaged", "killed"):
        for command in ("show", "verify"):
            cli(command, run_path(results, name))
    cli("plot", run_path(results, "damaged"), "-o", str(tmp_path / "damaged.png"))
    cli("ls", results["storage"])
    assert snapshot(results["storage"]) == results["snapshot"]


def copy_run(results, name: str, tmp_path) -> str:
    path = str(tmp_path / "resumed" / name)
    shutil.copytree(run_path(results, name), path)
    return path


def test_resume_continues_a_run_whose_driver_was_killed(results, tmp_path):
    path = copy_run(results, "killed", tmp_path)
    out = cli("resume", path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "resuming run killed (ABORTED, 1 attempt so far) from checkpoint_000003"
    assert lines[-1] == "run killed FINISHED at iteration 12 after 2 attempts; last loss=0.2833"
    df = Result.from_path(path).metrics_dataframe
    assert list(df["training_iteration"]) == list(range(1, 13))
    attempts = json.load(open(os.path.join(path, ".unbroken", "run.json")))["attempts"]
    assert [a["status"] for a in attempts] == ["ABORTED", "FINISHED"]

    out = cli("resume", path)
    assert out.returncode == 0
    assert out.stdout.strip() == "run killed already finished at iteration 12; nothing to resume"


def test_resume_max_failures_overrides_the_failure_config(results, tmp_path):
    # Without the override the saved FailureConfig(max_failures=0) gives up at the failure in attempt 2.
    path = copy_run(results, "errored", tmp_path)
    out = cli("resume", path)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-2].startswith("unbroken: error: training failed in attempt 2")
    assert out.stderr.splitlines()[-1].endswith(f"After fixing the cause: unbroken resume {path}")

    path = copy_run(results, "errored", tmp_path / "again")
    out = cli("resume", path, "--max-failures", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    attempts = json.load(open(os.path.join(path, ".unbroken", "run.json")))["attempts"]
    assert [(a["status"], a["resumed_from"]) for a in attempts] == [
        ("ERRORED", None), ("ERRORED", "checkpoint_000003"), ("FINISHED", "checkpoint_000006")]
    assert list(Result.from_path(path).metrics_dataframe["training_iteration"]) == list(range(1, 10))
