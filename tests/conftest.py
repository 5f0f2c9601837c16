import json
import os
import signal
import subprocess
import sys

import pytest

# DDP imports torch._dynamo on first use (seconds); importing it once here lets every
# worker group the tests fork inherit it instead of importing it again.
import torch._dynamo  # noqa: F401, E402

# Imported at collection, before any test runs torch ops in this process, so that workers
# can be forked from it (see unbroken.execution.engine.local).
import unbroken.train.torch  # noqa: F401

TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    """The Ray engine's tests run last: they attach this process to a Ray cluster, whose threads
    would make every later local-engine test start its workers from a forkserver (slower)."""
    items.sort(key=lambda item: item.get_closest_marker("ray") is not None)


@pytest.fixture
def storage(tmp_path):
    return str(tmp_path / "results")


def driver_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TESTS, env.get("PYTHONPATH", "")])
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_script(code: str, *args: str, check: bool = True, **env) -> subprocess.CompletedProcess:
    """Run a driver script in a fresh Python process."""
    proc = subprocess.run([sys.executable, "-c", code, *args], env=driver_env(**env),
                          capture_output=True, text=True, timeout=240)
    if check and proc.returncode != 0:
        raise AssertionError(f"driver failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


# -- reading run and sweep manifests in tests ----------------------------------------------------
def sweep_json(path: str) -> dict:
    return json.load(open(os.path.join(path, ".unbroken", "sweep.json")))


def run_json(path: str) -> dict:
    return json.load(open(os.path.join(path, ".unbroken", "run.json")))


def statuses(sweep_path: str) -> dict[str, str]:
    """Each trial's status as the sweep manifest has it."""
    return {t["name"]: t["status"] for t in sweep_json(sweep_path)["trials"]}


def attempts(run_path: str) -> list[str]:
    """The status of each attempt of a run."""
    return [a["status"] for a in run_json(run_path)["attempts"]]


def start_script(code: str, *args: str, start_new_session: bool = False, with_stdin: bool = False,
                 **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-u", "-c", code, *args], env=driver_env(**env),
                            stdin=subprocess.PIPE if with_stdin else None,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=start_new_session)


def read_until(proc: subprocess.Popen, needle: str) -> list[str]:
    """Read the driver's stdout line by line until a line contains `needle`."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"driver ended before printing {needle!r}:\n{''.join(lines)}\n"
                         f"{proc.stderr.read()}")


def _start(args: list[str], ready: str) -> tuple[subprocess.Popen, str]:
    """Start a helper process and wait for its `ready` line; returns (process, rest of that line)."""
    proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=driver_env())
    line = proc.stdout.readline()
    if not line.startswith(ready):
        proc.kill()
        raise RuntimeError(f"{args[0]} did not start: {line!r}")
    return proc, line.split()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible server (moto) on loopback for the whole session, with a bucket."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    proc, port = _start([os.path.join(TESTS, "..", "tools", "s3_server.py")], "S3 ")
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, **S3_CREDENTIALS).create_bucket(Bucket="bucket")
    yield endpoint
    proc.stdin.close()
    proc.wait(timeout=30)


S3_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing",
                  "region_name": "us-east-1"}


def s3_env(endpoint: str) -> dict[str, str]:
    """The usual AWS environment variables, pointing at `endpoint`."""
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}


@pytest.fixture
def faulty_proxy(s3_endpoint):
    """A proxy in front of the S3 server that refuses connections on command."""
    proc, port = _start([os.path.join(TESTS, "faulty_proxy.py"), s3_endpoint.rsplit(":", 1)[1]], "PROXY ")

    def refuse(seconds: float) -> None:
        proc.stdin.write(f"refuse {seconds}\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "OK"

    yield f"http://127.0.0.1:{port}", refuse
    proc.stdin.close()
    proc.wait(timeout=30)


# -- driving a sweep driver from a test ----------------------------------------------------------
def read_until_all(proc, needles):
    """Read a driver's stdout until every needle has appeared (in any order)."""
    lines, missing = [], set(needles)
    for line in proc.stdout:
        lines.append(line)
        missing = {n for n in missing if not any(n in seen for seen in lines)}
        if not missing:
            return lines
    raise AssertionError(f"driver ended before printing {sorted(missing)}:\n{''.join(lines)}\n"
                         f"{proc.stderr.read()}")


def kill_and_reap(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


def fifo(block_dir, trial):
    os.makedirs(block_dir, exist_ok=True)
    os.mkfifo(os.path.join(block_dir, trial))
