"""Runs on S3-compatible object storage (a real moto server on loopback, through s3fs).

Every driver runs in its own process: the async filesystem starts an event-loop thread, and
this test process forks workers for the other tests.
"""

import io
import json
import re
import signal
import uuid

import boto3
import pytest
import torch

from conftest import S3_CREDENTIALS, read_until, run_script, s3_env, start_script
from loops import final_weights, linear_loop
from unbroken.store.history import timeline
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer

pytestmark = pytest.mark.usefixtures("s3_endpoint")

DRIVER = """
import json, os, sys
os.chdir(os.environ["HOME"])
from loops import linear_loop
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
storage, name, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
result = TorchTrainer(linear_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(name=name, storage_path=storage)).fit()
print("DONE", result.metrics["training_iteration"], result.metrics["attempt"], flush=True)
"""

RESTORE = """
import os, sys
os.chdir(os.environ["HOME"])  # a fresh working directory when run as a fresh machine
from unbroken.train.torch import TorchTrainer
url = sys.argv[1]
assert TorchTrainer.can_restore(url), url
result = TorchTrainer.restore(url).fit()
print("DONE", result.metrics["training_iteration"], result.metrics["attempt"], flush=True)
"""

ITERATIONS = 10


def prefix() -> str:
    return f"s3://bucket/{uuid.uuid4().hex[:8]}"


def keys(endpoint: str, url: str) -> list[str]:
    bucket, _, key_prefix = url[len("s3://"):].partition("/")
    client = boto3.client("s3", endpoint_url=endpoint, **S3_CREDENTIALS)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix + "/")
    return sorted(o["Key"][len(key_prefix) + 1:] for page in pages for o in page.get("Contents", []))


def read(endpoint: str, url: str, rel: str) -> bytes:
    bucket, _, key = url[len("s3://"):].partition("/")
    client = boto3.client("s3", endpoint_url=endpoint, **S3_CREDENTIALS)
    return client.get_object(Bucket=bucket, Key=f"{key}/{rel}")["Body"].read()


def reference_weights(tmp_path) -> dict:
    result = TorchTrainer(linear_loop, train_loop_config={"iterations": ITERATIONS, "ckpt_every": 2},
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="reference", storage_path=str(tmp_path))).fit()
    return final_weights(result)


def fresh_machine(tmp_path, endpoint: str, name: str) -> dict:
    """Environment of a new machine: nothing local survives, only the bucket."""
    home = tmp_path / f"home-{name}"
    home.mkdir()
    return dict(s3_env(endpoint), HOME=str(home), TMPDIR=str(home), UNBROKEN_STORAGE=str(home / "nope"))


READER = """
import os, sys
from unbroken.errors import RunNotFoundError
from unbroken.train import Checkpoint, Result
from unbroken.train.torch import TorchTrainer
url = sys.argv[1]
result = Result.from_path(url)
print("CAN", TorchTrainer.can_restore(url), TorchTrainer.can_restore(url + "-missing"))
print("ROWS", list(result.metrics_dataframe["training_iteration"]), result.checkpoint.url)
# Ray's pair: a path on the filesystem, with no scheme, opens the same run and checkpoint again.
print("PATHS", result.path, result.checkpoint.path, result.url)
again = Result.from_path(result.path, storage_filesystem=result.filesystem)
same = Checkpoint(path=result.checkpoint.path, filesystem=result.checkpoint.filesystem)
print("AGAIN", len(again.rows), same == result.checkpoint, sorted(os.listdir(same.to_directory())))
try:
    Result.from_path(result.path)  # a path with no scheme and no filesystem is a local path
except RunNotFoundError as e:
    print("HINT", "result.url" in str(e) and "storage_filesystem=result.filesystem" in str(e))
"""


def test_run_layout_on_s3_a_marker_less_upload_is_never_used_and_result_reads_it(s3_endpoint, tmp_path):
    storage, name = prefix(), "layout"
    url = f"{storage}/{name}"
    config = {"iterations": ITERATIONS, "ckpt_every": 2}
    # The driver dies just before writing the marker of its third checkpoint (files uploaded).
    out = run_script(DRIVER, storage, name, json.dumps(config), check=False,
                     UNBROKEN_FAULT="before_marker:3", **s3_env(s3_endpoint))
    assert out.returncode == -signal.SIGKILL, out.stderr
    stored = keys(s3_endpoint, url)
    assert "checkpoint_000006/state.pt" in stored and "checkpoint_000006/.checkpoint.json" not in stored
    assert "checkpoint_000004/.checkpoint.json" in stored

    out = run_script(RESTORE, url, **s3_env(s3_endpoint))
    assert f"DONE {ITERATIONS} 2" in out.stdout
    run = json.loads(read(s3_endpoint, url, ".unbroken/run.json"))
    assert run["attempts"][1]["resumed_from"] == "checkpoint_000004", "the unmarked upload was not used"
    stored = keys(s3_endpoint, url)
    for expected in (".unbroken/run.json", ".unbroken/run.prev.json", "params.json",
                     "result.json", "progress.csv", "checkpoint_000010/.checkpoint.json",
                     "checkpoint_000010/state.pt"):
        assert expected in stored, stored
    assert ".unbroken/lease.json" not in stored, "released at the end"
    marker = json.loads(read(s3_endpoint, url, "checkpoint_000010/.checkpoint.json"))
    assert [f["path"] for f in marker["files"]] == ["state.pt"] and marker["iteration"] == 10
    rows = [json.loads(line) for line in read(s3_endpoint, url, "result.json").decode().splitlines()]
    assert [r["training_iteration"] for r in rows if r["attempt"] == 2] == list(range(5, ITERATIONS + 1))

    # Result, can_restore and Checkpoint read the finished run from another process.
    out = run_script(READER, url, **s3_env(s3_endpoint)).stdout
    assert "CAN True False" in out
    last = f"{url}/checkpoint_{ITERATIONS:06d}"
    assert f"ROWS {list(range(1, ITERATIONS + 1))} {last}" in out
    bare = url[len("s3://"):]
    assert f"PATHS {bare} {last[len('s3://'):]} {url}" in out
    assert "AGAIN 10 True ['state.pt']" in out and "HINT True" in out


@pytest.mark.slow  # 24 s; driver kills and restores on S3 are in the crash harness's --s3 trial
def test_killed_driver_is_restored_on_a_fresh_machine(s3_endpoint, tmp_path):
    storage, name = prefix(), "fresh-machine"
    url = f"{storage}/{name}"
    config = {"iterations": ITERATIONS, "ckpt_every": 2, "echo": True}
    driver = start_script(DRIVER, storage, name, json.dumps(config), **s3_env(s3_endpoint))
    read_until(driver, "REPORTED 5")
    driver.kill()
    driver.wait()

    # The same script again on another machine resumes by name; kill that one too.
    elsewhere = fresh_machine(tmp_path, s3_endpoint, "a")
    rerun = start_script(DRIVER, storage, name, json.dumps(config), **elsewhere)
    read_until(rerun, "REPORTED 7")
    rerun.kill()
    rerun.wait()
    run = json.loads(read(s3_endpoint, url, ".unbroken/run.json"))
    assert run["attempts"][1]["resumed_from"] is not None, "auto-resumed by name"

    out = run_script(RESTORE, url, **fresh_machine(tmp_path, s3_endpoint, "b"))
    assert f"DONE {ITERATIONS} 3" in out.stdout, out.stderr
    rows = [json.loads(line) for line in read(s3_endpoint, url, "result.json").decode().splitlines()]
    assert [r["training_iteration"] for r in timeline(rows)] == list(range(1, ITERATIONS + 1))
    state = torch.load(io.BytesIO(read(s3_endpoint, url, "checkpoint_000010/state.pt")),
                       weights_only=True)
    expected = reference_weights(tmp_path)
    for key, value in state["model"].items():
        assert torch.equal(value, expected[key])


def test_transient_outage_is_retried_and_training_continues(s3_endpoint, faulty_proxy):
    endpoint, refuse = faulty_proxy
    storage, name = prefix(), "outage"
    config = {"iterations": 30, "ckpt_every": 1, "echo": True}
    # No retries inside botocore, so that unbroken's own retry is what absorbs the outage.
    driver = start_script(DRIVER, storage, name, json.dumps(config), AWS_MAX_ATTEMPTS="1", **s3_env(endpoint))
    read_until(driver, "REPORTED 3")
    refuse(3)  # the server drops every request for three seconds
    out, err = driver.communicate(timeout=240)
    assert "DONE 30 1" in out, err
    assert "retrying with backoff" in err, err
    run = json.loads(read(s3_endpoint, f"{storage}/{name}", ".unbroken/run.json"))
    assert run["status"] == "FINISHED" and len(run["attempts"]) == 1, "no failure: the outage was absorbed"


@pytest.mark.slow  # 32 s; the transient outage test covers the retry path
def test_outage_beyond_the_retry_budget_fails_clearly_and_keeps_the_checkpoint(s3_endpoint, faulty_proxy):
    endpoint, refuse = faulty_proxy
    storage, name = prefix(), "long-outage"
    url = f"{storage}/{name}"
    config = {"iterations": 30, "ckpt_every": 2, "echo": True}
    env = dict(s3_env(endpoint), UNBROKEN_STORAGE_RETRY_S="2", AWS_MAX_ATTEMPTS="1")
    driver = start_script(DRIVER, storage, name, json.dumps(config), **env)
    read_until(driver, "REPORTED 5")
    refuse(600)
    out, err = driver.communicate(timeout=240)
    assert driver.returncode != 0
    # The seconds count from the first try, which may itself hang until the connection drops.
    assert "StorageError" in err and re.search(r"kept failing for \d+ s", err) and "Hint" in err, err
    refuse(0)
    stored = keys(s3_endpoint, url)
    latest = max(k.split("/")[0] for k in stored if k.endswith("/.checkpoint.json"))
    out = run_script(RESTORE, url, **s3_env(s3_endpoint))
    assert "DONE 30" in out.stdout
    run = json.loads(read(s3_endpoint, url, ".unbroken/run.json"))
    assert run["attempts"][-1]["resumed_from"] == latest, "the last committed checkpoint was intact"


LEASE = """
import json, os, sys
from unbroken.errors import LeaseHeldError, LeaseLostError
from unbroken.store.lease import LEASE_JSON, Lease
from unbroken.store.storage import Storage
storage = Storage.from_url(sys.argv[1])
first, second = Lease(storage), Lease(storage)
first.acquire()
try:
    second.acquire()
    print("SECOND ACQUIRED")
except LeaseHeldError as e:
    print("REFUSED", e)
# The first driver's heartbeat goes stale (its record says so): the second takes over.
record = json.loads(storage.read_bytes(LEASE_JSON))
record.update(host="elsewhere", heartbeat=0)
first._version = storage.write_conditional(LEASE_JSON, json.dumps(record).encode(), first._version)
second.acquire()
print("TAKEN OVER")
try:
    first.beat(force=True)
    print("FIRST STILL BEATS")
except LeaseLostError as e:
    print("LOST", e)
print("HOLDER", json.loads(storage.read_bytes(LEASE_JSON))["token"] == second.token)
"""


def test_lease_on_s3_uses_conditional_writes(s3_endpoint):
    out = run_script(LEASE, f"{prefix()}/leased", **s3_env(s3_endpoint)).stdout
    assert "REFUSED" in out and "SECOND ACQUIRED" not in out
    assert "TAKEN OVER" in out
    assert "LOST" in out and "taken over by another driver" in out and "FIRST STILL BEATS" not in out
    assert "HOLDER True" in out


STALE = """
import os, sys, tempfile
import s3fs
from unbroken.core.config import CheckpointConfig
from unbroken.store import commit, history, lease
from unbroken.store.checkpoint_manager import CheckpointManager
from unbroken.store import manifest as mf
from unbroken.store.storage import Storage

root = sys.argv[1][len("s3://"):]
# Two processes, as two filesystem instances: the reader caches listings, the writer writes.
reader, writer = (Storage(s3fs.S3FileSystem(skip_instance_cache=True), root) for _ in range(2))
writer.write_atomic("params.json", b"{}")
# The reader lists the run directory (as can_restore's isdir does) before the run writes more.
assert reader.isdir() and reader.listdir() == ["params.json"]
assert reader.fs.dircache, "the reader caches the listing"

holder = lease.Lease(writer)
holder.acquire()
rows = history.History(writer)
rows.open()
rows.append({"training_iteration": 1})
rows.sync()
mf.save(writer, mf.RunManifest(name="run", trainer_class="t:T", trainer_mro=["t:T"]), None)
with tempfile.TemporaryDirectory() as d:
    open(os.path.join(d, "w.bin"), "wb").write(b"weights")
    files = commit.write_rank_files(writer, "checkpoint_000001.tmp-1", d, 0)
commit.commit(writer, "checkpoint_000001.tmp-1", commit.Marker("checkpoint_000001", 1, 1, files))

def seen(what, read):
    try:
        print(what, read())
    except Exception as e:
        print(what, "MISSED", type(e).__name__)

seen("ROWS", lambda: len(history.read_rows(reader)))
seen("HOLDER", lambda: lease.live_holder(reader) is not None)
seen("VERSIONED", lambda: lease.Lease(reader)._read()[0] is not None)
seen("MANIFEST", lambda: mf.load(reader).name)
seen("MARKER", lambda: commit.verify(reader, "checkpoint_000001", full=True).iteration)
seen("CRC", lambda: reader.crc32("checkpoint_000001/w.bin") == files[0].crc32)
seen("LAST ROW", lambda: history.last_row(reader))
with tempfile.TemporaryDirectory() as d:
    seen("GET", lambda: reader.get_file("checkpoint_000001/w.bin", os.path.join(d, "w")) or
         open(os.path.join(d, "w"), "rb").read())
holder.release()
seen("RELEASED", lambda: lease.live_holder(reader) is None)

# A torn newer checkpoint (a file shorter than its marker says) is set aside on S3 too.
with tempfile.TemporaryDirectory() as d:
    open(os.path.join(d, "w.bin"), "wb").write(b"weights 2")
    files = commit.write_rank_files(writer, "checkpoint_000002", d, 0)
commit.commit(writer, "checkpoint_000002", commit.Marker("checkpoint_000002", 2, 1, files))
writer.write_atomic("checkpoint_000002/w.bin", b"torn")
resume = CheckpointManager(writer, CheckpointConfig()).recover()
print("RESUME", resume.name, reader.listdir())
"""


def test_a_listing_cached_earlier_never_hides_a_file_written_since(s3_endpoint):
    """Every read that decides something sees what is on storage now, whatever listing this
    process cached (s3fs answers a read of a file missing from a cached listing with
    FileNotFoundError): rows, the lease holder, the manifest, markers, checksums, downloads.
    And a torn checkpoint is set aside on S3 (a directory rename there is a copy)."""
    out = run_script(STALE, f"{prefix()}/run", **s3_env(s3_endpoint)).stdout
    assert "MISSED" not in out, out
    for line in ("ROWS 1", "HOLDER True", "VERSIONED True", "MANIFEST run", "MARKER 1", "CRC True",
                 "LAST ROW {'training_iteration': 1}", "GET b'weights'", "RELEASED True",
                 "RESUME checkpoint_000001 ['.unbroken', 'checkpoint_000001', 'checkpoint_000002.corrupt-0', "
                 "'params.json', 'result.json']"):
        assert line in out, out


SET_ASIDE = """
import os, sys, tempfile
from unbroken.core.config import CheckpointConfig
from unbroken.store import commit
from unbroken.store.checkpoint_manager import CheckpointManager
from unbroken.store.storage import Storage

storage = Storage.from_url(sys.argv[1])
if sys.argv[2] == "write":
    for i, files in ((1, {"a": b"one", "b": b"one"}), (2, {"a": b"two", "b": b"two", "c": b"two"})):
        with tempfile.TemporaryDirectory() as d:
            for name, data in files.items():
                open(os.path.join(d, name), "wb").write(data)
            written = commit.write_rank_files(storage, f"checkpoint_00000{i}", d, 0)
        commit.commit(storage, f"checkpoint_00000{i}", commit.Marker(f"checkpoint_00000{i}", i, 1, written))
    storage.write_atomic("checkpoint_000002/b", b"torn")
else:
    print("RESUME", CheckpointManager(storage, CheckpointConfig()).recover().name, storage.listdir())
"""


def test_a_kill_while_a_torn_checkpoint_is_set_aside_on_s3_leaves_it_never_used(s3_endpoint):
    """On S3 setting a checkpoint aside copies it file by file (fault point during_copy_rename):
    killed midway, the torn checkpoint keeps failing verification and is set aside again."""
    url, env = f"{prefix()}/aside", s3_env(s3_endpoint)
    run_script(SET_ASIDE, url, "write", **env)
    killed = run_script(SET_ASIDE, url, "recover", check=False, UNBROKEN_FAULT="during_copy_rename:2", **env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    out = run_script(SET_ASIDE, url, "recover", **env).stdout
    assert "RESUME checkpoint_000001" in out, out
    assert "'checkpoint_000002'" not in out and "checkpoint_000002.corrupt-1" in out, out
    assert keys(s3_endpoint, url).count("checkpoint_000002.corrupt-1/b") == 1


def test_only_faults_are_retried_not_answers():
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError, ReadTimeoutError

    from unbroken.store.storage_errors import is_transient as _transient

    assert _transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert _transient(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert _transient(ConnectionResetError())
    assert not _transient(NoCredentialsError())
    assert not _transient(FileNotFoundError("no such key"))
    assert not _transient(PermissionError("access denied"))


PARTS = """
import json, sys
from unbroken.store.history import History, last_row, read_rows
from unbroken.store.storage import Storage
store = Storage.from_url(sys.argv[1])
store.makedirs()
puts = []
write = store.write_atomic
store.write_atomic = lambda rel, data: (puts.append((rel, len(data))), write(rel, data))[1]
history = History(store)
history.open()
for i in range(1, 201):
    history.append({"training_iteration": i, "attempt": 1, "timestamp": float(i)})
    if i % 10 == 0:
        history.sync()
rows = read_rows(store)  # the driver is "killed" here: it never closes
print("KILLED", [r["training_iteration"] for r in rows] == list(range(1, 201)),
      last_row(store)["training_iteration"])
whole = sum(n for rel, n in puts if rel.startswith(".unbroken/parts/"))  # every row goes out in one part
print("PUT", sum(n for rel, n in puts if rel == "result.json") / whole,
      max(n for rel, n in puts if rel != "result.json"))
write(".unbroken/parts/result.json/0000000000000000-0000000000000007.part", b"stale\\n")  # a cut-short fold's
history = History(store)
history.open()
history.append({"training_iteration": 201, "attempt": 2, "timestamp": 201.0})
history.close()
print("CLOSED", [r["training_iteration"] for r in read_rows(store)] == list(range(1, 202)),
      store.listdir(".unbroken/parts/result.json"), store.read_bytes("result.json").count(b"\\n"))
"""


def test_the_history_on_s3_is_put_in_parts_and_folded_now_and_then(s3_endpoint):
    """Object stores cannot append: a sync puts only its own rows (a part), and the parts are
    folded into result.json when they add up to as much as it (and at close), so the bytes put
    grow linearly with the history. Rewriting result.json at each of the 20 syncs put 10.5
    times the history; a driver killed before it closes leaves parts that readers include."""
    out = run_script(PARTS, f"{prefix()}/parts", **s3_env(s3_endpoint)).stdout
    assert "KILLED True 200" in out, out
    ratio, biggest_part = out.split("PUT ", 1)[1].split()[:2]
    assert float(ratio) <= 2.0, out  # result.json itself: folds at doubling sizes
    assert int(biggest_part) < 1000, out  # a part holds one sync's 10 rows
    assert "CLOSED True [] 201" in out, out


FOLD_KILLED = """
import sys
from unbroken.store.history import History
from unbroken.store.storage import Storage
store = Storage.from_url(sys.argv[1])
store.makedirs()
history = History(store)
history.open()
for i in range(1, 101):
    history.append({"training_iteration": i, "attempt": 1, "timestamp": float(i)})
    if i % 10 == 0:
        history.sync()  # UNBROKEN_FAULT=after_fold:3 kills this process inside the third fold
print("NOT KILLED")
"""

AFTER_FOLD = """
import sys
from unbroken.store.history import History, read_rows
from unbroken.store.storage import Storage
store = Storage.from_url(sys.argv[1])
print("SEEN", [r["training_iteration"] for r in read_rows(store)])
print("LEFT", len(store.listdir(".unbroken/parts/result.json")))
history = History(store)
history.open()
history.append({"training_iteration": 999, "attempt": 2, "timestamp": 999.0})
history.close()
print("AFTER", [r["training_iteration"] for r in read_rows(store)][-3:],
      store.listdir(".unbroken/parts/result.json"))
"""


def test_a_fold_killed_between_its_put_and_removing_the_parts_shows_each_row_once(s3_endpoint):
    url = f"{prefix()}/fold"
    killed = run_script(FOLD_KILLED, url, check=False, UNBROKEN_FAULT="after_fold:3", **s3_env(s3_endpoint))
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    out = run_script(AFTER_FOLD, url, **s3_env(s3_endpoint)).stdout
    seen = json.loads(out.split("SEEN ", 1)[1].splitlines()[0])
    assert seen == list(range(1, len(seen) + 1)) and len(seen) >= 30, out  # once each, none lost
    assert int(out.split("LEFT ", 1)[1].split()[0]) >= 1, "the killed fold left its parts behind"
    assert f"AFTER [{seen[-2]}, {seen[-1]}, 999] []" in out, out
