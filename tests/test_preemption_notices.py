"""Preemption notices with a deadline, on the local engine: a SIGTERM with a grace period
while a step takes longer than the grace, and a cloud's spot notice served by a metadata
server on loopback. Each run is killed by nothing but the notice; each must commit every
rank's state before the deadline, stop as PREEMPTED (not a failure), and, continued, end bit
for bit like the run that was never preempted, each iteration once and nothing redone
beyond the step in flight.

Real worker processes: 2 ranks on gloo (DDP), `exact_loop` with a TrainState (just-in-time
checkpoints are on by default), a periodic checkpoint every 4 steps.
"""

import contextlib
import http.server
import io
import json
import os
import signal
import threading
import time

import pytest

from conftest import read_until, run_json, run_script, start_script
from test_exact_resume import BASE, assert_same_run
from test_exact_resume import fit as fit_uninterrupted
from unbroken.cli import commands as cli
from unbroken.execution.notices import MetadataWatch
from unbroken.store import commit
from unbroken.store.storage import Storage
from unbroken.train import FailureConfig, Result

DRIVER = """
import json, sys
from loops import exact_loop
from unbroken.train import FailureConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer

config = json.loads(sys.argv[3])
TorchTrainer(exact_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
             run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1],
                                  failure_config=FailureConfig(sigterm_grace_s=float(sys.argv[4])))).fit()
print("FINISHED", flush=True)
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run that was never preempted (the local engine's default recovery arms TrainState)."""
    return fit_uninterrupted(str(tmp_path_factory.mktemp("never-preempted")), "reference", jit=True)


def rows(path: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(path, "result.json"))]


def check_continued(path: str, storage: str, name: str, config: dict, reference, last: int) -> None:
    """Run the script again by name: it resumes from checkpoint `last` and ends as the run
    that was never preempted, each iteration once."""
    out = run_script(DRIVER, storage, name, json.dumps(config), "30")
    assert "FINISHED" in out.stdout
    run = run_json(path)
    assert run["status"] == "FINISHED"
    assert run["attempts"][1]["resumed_from"] == commit.checkpoint_name(last)
    kept = [r["training_iteration"] for r in rows(path)]
    assert kept == sorted(set(kept)), "each iteration once"
    assert [r["training_iteration"] for r in rows(path) if r["attempt"] == 2][0] == last + 1, "nothing redone"
    assert_same_run(Result.from_path(path), reference, "continued after the preemption")


def test_sigterm_with_a_grace_shorter_than_the_step_saves_the_last_report_just_in_time(storage, reference):
    """SIGTERM to the driver with a 6 s grace while both ranks are in a 60 s step after report
    6: no report can come in time, so the ranks give the step up 4.5 s into the grace, rank 0
    saves report 6 just in time, and it is committed before the deadline."""
    name, grace = "sigterm-grace", 6.0
    path = os.path.join(storage, name)
    config = {**BASE, "jit": True, "echo": True, "slow_after": [6, 1, 60]}
    driver = start_script(DRIVER, storage, name, json.dumps(config), str(grace))
    read_until(driver, "SLOW 6")
    driver.send_signal(signal.SIGTERM)
    _, err = driver.communicate(timeout=60)
    assert driver.returncode != 0 and "TrainingInterruptedError" in err and "preemption notice" in err, err

    run = run_json(path)
    attempt = run["attempts"][0]
    assert run["status"] == "INTERRUPTED" and attempt["status"] == "PREEMPTED", attempt
    notice = attempt["preempted"]
    assert notice["source"] == "SIGTERM"
    assert notice["deadline"] == pytest.approx(notice["received_at"] + grace)
    assert attempt["jit_checkpoint"]["iteration"] == 6, attempt["jit_checkpoint"]
    marker = commit.read_marker(Storage.from_url(path), run["latest_checkpoint"])
    assert marker.iteration == 6 and marker.committed_at < notice["deadline"], (marker, notice)
    assert attempt["ended_at"] < notice["deadline"], "the ranks stopped before the deadline"
    assert "they give their step up" in err, err
    check_continued(path, storage, name, config, reference, 6)


class SpotEndpoint(http.server.BaseHTTPRequestHandler):
    """AWS's instance metadata on loopback: IMDSv2's token, and a spot notice once `armed`."""

    armed: threading.Event
    deadline: float

    def do_PUT(self):  # noqa: N802 - the handler's name is http.server's
        self._answer(200, "token-1") if self.path == "/latest/api/token" else self._answer(404, "")

    def do_GET(self):  # noqa: N802
        if self.path != "/latest/meta-data/spot/instance-action" or not self.armed.is_set():
            return self._answer(404, "")
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.deadline))
        self._answer(200, json.dumps({"action": "terminate", "time": when}))

    def _answer(self, code: int, body: str) -> None:
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def spot_endpoint():
    handler = type("Handler", (SpotEndpoint,), {"armed": threading.Event(), "deadline": 0.0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_spot_notice_from_the_metadata_endpoint_stops_the_run_at_its_next_report(
        storage, reference, spot_endpoint):
    """An AWS spot interruption notice (two minutes ahead, as AWS gives), polled only because
    the run asked for it: the ranks checkpoint at their next report and stop; the run
    continues from there exactly."""
    handler, url = spot_endpoint
    name, told = "spot", os.path.join(storage, "told.jsonl")
    path = os.path.join(storage, name)
    config = {**BASE, "jit": True, "echo": True, "step_s": 0.3, "preemption_log": told}
    driver = start_script(DRIVER, storage, name, json.dumps(config), "30",
                          UNBROKEN_PREEMPTION_NOTICES="aws", UNBROKEN_METADATA_URL=url)
    read_until(driver, "STEP 3")
    handler.deadline = int(time.time()) + 120
    handler.armed.set()
    _, err = driver.communicate(timeout=60)
    assert driver.returncode != 0 and "TrainingInterruptedError" in err, err

    run = run_json(path)
    attempt = run["attempts"][0]
    assert attempt["status"] == "PREEMPTED" and attempt["preempted"]["source"] == "aws spot terminate"
    assert attempt["preempted"]["deadline"] == handler.deadline
    last = rows(path)[-1]["training_iteration"]
    assert run["latest_checkpoint"] == commit.checkpoint_name(last), "the last report carried the checkpoint"
    assert "jit_checkpoint" not in attempt, "the report came in time: nothing was saved just in time"
    # The loop is told too, every rank at the same report: None before, the deadline after.
    seen = [json.loads(line) for line in open(told)]
    by_step = {step: [i for r, s, i in seen if s == step] for _, step, _ in seen}
    assert all(len(infos) == 2 and infos[0] == infos[1] for infos in by_step.values()), by_step
    told_then = [[handler.deadline * 1000, [0, 1]]] * 2
    assert by_step[1] == [None, None] and by_step[last - 1] == told_then, by_step
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        cli.main(["show", path])
    assert "preempted: aws spot terminate" in shown.getvalue(), shown.getvalue()
    os.remove(told)
    check_continued(path, storage, name, config, reference, last)


def test_notices_are_polled_only_when_asked_for(monkeypatch):
    monkeypatch.delenv("UNBROKEN_PREEMPTION_NOTICES", raising=False)
    watch = MetadataWatch(None)
    watch.start()
    assert watch._thread is None and watch.take() is None, "no metadata address is probed"
    with pytest.raises(ValueError, match="preemption_notices must be one of"):
        FailureConfig(preemption_notices="azure")
    with pytest.raises(ValueError, match="sigterm_grace_s must be > 0"):
        FailureConfig(sigterm_grace_s=0)
