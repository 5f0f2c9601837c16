import os
import subprocess
import sys

import pytest

# DDP imports torch._dynamo on first use (seconds); importing it once here lets every
# worker group the tests fork inherit it instead of importing it again.
import torch._dynamo  # noqa: F401, E402

# Imported at collection, before any test runs torch ops in this process, so that workers
# can be forked from it (see unbroken.engine.local).
import unbroken.train.torch  # noqa: F401

TESTS = os.path.dirname(os.path.abspath(__file__))


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


def start_script(code: str, *args: str, start_new_session: bool = False, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-u", "-c", code, *args], env=driver_env(**env),
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
