"""Local bring-up: a Prefect server on 127.0.0.1, one process work pool and worker per pool named in
pipeline.yaml, and the deployments `rlhf/full` (the pipeline) and `rlhf-stage/<stage>` (one per stage,
on that stage's pool). `down` stops exactly what `up` started, by the PIDs it recorded.

With tracking.backends: [mlflow] and a 127.0.0.1/localhost tracking.mlflow.uri, `up` also starts an MLflow
tracking server there (from its own environment, ./setup-mlflow.sh: full mlflow pins pyarrow below ours),
bound to 127.0.0.1, SQLite backend and artifacts under `<state>/mlflow/`.

With `rlhf up --ray`, a one-node Ray head for development too (`ray start --head --block`, address
127.0.0.1:PORT, no dashboard, Ray's token authentication on); its address is in `<state>/ray_address` and,
with the token's file, in the workers' environment, so stages with `launch.backend: ray` and no
`launch.ray.address` run there. `--block` keeps one process that
owns the head: stopping it (SIGTERM) shuts down every Ray process the head started.

State lives in a folder (default `<RLHF_HOME>/services`): the server's SQLite database (its own
PREFECT_HOME), logs, PID files and `api_url`. `up` also sets PREFECT_API_URL in the caller's active
Prefect profile so that a plain `prefect deployment run rlhf/full --watch` reaches this server; `down`
unsets it again.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

from rlhf.core.config import PipelineConfig
from rlhf.core.models import home
from rlhf.core.tracking import server_problem

REPO = Path(__file__).resolve().parents[2]  # the checkout: rlhf/cli/services.py
BIN = Path(sys.executable).parent


def state_dir(path: str | None) -> Path:
    d = Path(path).expanduser() if path else home() / "services"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # a zombie child of ours counts as dead
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def _environ(pid: int) -> list[str]:
    """A process's environment as NAME=value entries (Linux /proc; empty where it cannot be read)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _healthy(api: str) -> bool:
    return server_problem(api, timeout=2) is None  # GET <api>/health answers 200


def _spawn(state: Path, name: str, argv: list[str], env: dict) -> int:
    log = open(state / f"{name}.log", "ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    (state / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def pools(cfg: PipelineConfig) -> list[str]:
    from rlhf.core.registry import NAMES as STAGES

    return sorted({cfg.run.work_pool, *(cfg.work_pool(s) for s in STAGES)})


def mlflow_python(configured: str | None = None) -> Path:
    """The MLflow server environment's interpreter: the config, else RLHF_MLFLOW_PYTHON, else .venv-mlflow/."""
    return Path(configured or os.environ.get("RLHF_MLFLOW_PYTHON") or REPO / ".venv-mlflow" / "bin" / "python")


def start_mlflow(cfg: PipelineConfig, state: Path, log=print) -> str | None:
    """Starts the MLflow server that tracking.mlflow.uri names when it is ours to start (mlflow backend,
    127.0.0.1/localhost) and nothing answers there yet; returns its URI, or None when there is none to start."""
    uri = cfg.tracking.mlflow.uri
    parts = urllib.parse.urlsplit(uri)
    if "mlflow" not in cfg.tracking.backends or parts.hostname not in ("127.0.0.1", "localhost"):
        return None
    if _healthy(uri):
        return uri
    if parts.scheme != "http" or parts.path:
        raise RuntimeError(f"tracking.mlflow.uri: `rlhf up` starts a server only at http://127.0.0.1:PORT (no path), "
                           f"got {uri}; start yours there or change the URI")
    python = mlflow_python(cfg.tracking.mlflow.server_python)
    if not python.exists():
        raise RuntimeError(f"tracking.mlflow.server_python: no MLflow server environment at {python}; build it with "
                           "./setup-mlflow.sh (or point tracking.mlflow.server_python / RLHF_MLFLOW_PYTHON at one)")
    folder = state / "mlflow"
    folder.mkdir(exist_ok=True)
    pid = _spawn(state, "mlflow", [str(python), "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
                                   str(parts.port or 80), "--workers", "1",
                                   "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
                                   "--artifacts-destination", str(folder / "artifacts")],
                 # The server's job runner (huey consumers, for MLflow's GenAI jobs) is off unless the caller's
                 # environment turns it on: experiment tracking never uses it, and it is eight more processes
                 # (2.3 GB RSS and 24 CPU-s in the first half minute against 0.5 GB and 5 CPU-s, measured here).
                 {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ, "MLFLOW_TRACKING_URI": ""})
    deadline = time.time() + 120
    while not _healthy(uri):
        if time.time() > deadline or not _alive(pid):
            raise RuntimeError(f"MLflow server did not become healthy at {uri}; see {state / 'mlflow.log'}")
        time.sleep(0.5)
    log(f"mlflow: {uri} (pid {pid})")
    return uri


def ray_address(state: Path) -> str | None:
    """host:port of the Ray head `up --ray` started and is still running, or None."""
    from rlhf.core.cluster import address_problem

    addr_file, pid_file = state / "ray_address", state / "ray.pid"
    if not (addr_file.exists() and pid_file.exists() and _alive(int(pid_file.read_text()))):
        return None
    addr = addr_file.read_text().strip()
    return addr if address_problem(addr, timeout=2) is None else None


def start_ray(state: Path, cpus: int | None = None, log=print) -> str:
    """A local Ray head on 127.0.0.1 (reused when the one recorded in `state` still answers); returns its
    address. Its temporary folder is Ray's default (/tmp/ray): its socket paths must stay short."""
    from rlhf.core.cluster import address_problem

    addr = ray_address(state)
    if addr:
        return addr
    if not (BIN / "ray").exists():
        raise RuntimeError(f"rlhf up --ray needs the ray package, which is not installed in {BIN.parent}: "
                           "pip install ray==2.60.0 (or this package's [ray] extra)")
    port = _free_port()
    addr = f"127.0.0.1:{port}"
    argv = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
            "--include-dashboard", "false", "--disable-usage-stats"]
    if cpus:
        argv += ["--num-cpus", str(cpus)]
    # Ray 2.60's GCS and raylet listen on every interface whatever --node-ip-address says (measured; no bind
    # option): a token is what keeps other machines from running code here. Ray's token authentication
    # refuses a client without it; this head's token lives in the state folder, readable by its owner only.
    token = state / "ray_auth_token"
    token.unlink(missing_ok=True)
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    # nice 0: ranks started here are the work, not background tasks (Ray's default worker niceness is 15).
    # No drain on SIGTERM: Ray 2.60's head then waits up to 30 s for its node to drain (for Serve proxies to
    # quiesce), and once a client had joined, `rlhf down` took 31.5 s against 5 s; our ranks resume from the store.
    # (A drain the user sets wins.)
    env = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **os.environ, **ray_client_env(state), "RAY_worker_niceness": "0"}
    pid = _spawn(state, "ray", argv, env)
    deadline = time.time() + 120
    while address_problem(addr, timeout=1) is not None:
        if time.time() > deadline or not _alive(pid):
            raise RuntimeError(f"Ray head did not start at {addr}; see {state / 'ray.log'}")
        time.sleep(0.5)
    (state / "ray_address").write_text(addr)
    log(f"ray: {addr} (pid {pid}); the workers started here have its address and token; elsewhere: "
        + " ".join(f"{k}={v}" for k, v in {"RAY_ADDRESS": addr, **ray_client_env(state)}.items()))
    return addr


def ray_client_env(state: Path) -> dict[str, str]:
    """What a client of the head `up --ray` started needs besides its address: token mode and the token's file."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(state / "ray_auth_token")}


def up(cfg: PipelineConfig, config_path: Path, state: Path, poll_seconds: int = 5, heartbeat_seconds: int = 30,
       log=print, ray: bool = False) -> str:
    """Idempotent: a healthy server recorded in `state` is reused, dead workers are restarted; pools,
    deployments and the crash-detection automation are upserted."""
    api_file = state / "api_url"
    api = api_file.read_text().strip() if api_file.exists() else ""
    if not (api and _healthy(api)):
        port = _free_port()
        api = f"http://127.0.0.1:{port}/api"
        env = {**os.environ, "PREFECT_HOME": str(state / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        _spawn(state, "server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port),
                                 "--analytics-off"], env)
        deadline = time.time() + 90
        while not _healthy(api):
            if time.time() > deadline:
                raise RuntimeError(f"Prefect server did not become healthy at {api}; see {state / 'server.log'}")
            time.sleep(0.5)
        api_file.write_text(api)
        log(f"server: {api} (pid {(state / 'server.pid').read_text()})")
    # Flow runs inherit the worker's environment: each sends a heartbeat every `heartbeat_seconds`
    # (Prefect's minimum is 30), which the crash-detection automation watches.
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_WORKER_QUERY_SECONDS": str(poll_seconds),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(heartbeat_seconds)}
    ray_addr = start_ray(state, log=log) if ray else ray_address(state)  # a head from an earlier `up --ray` too
    if ray_addr:
        env.update({"RAY_ADDRESS": ray_addr, **ray_client_env(state)})
    start_mlflow(cfg, state, log)
    # pools, deployments, the automation and the profile's API URL in one child process (each a `prefect` CLI
    # call before: 2-3 s apiece of imports); workers start after, once their pools exist
    names = pools(cfg)
    register_deployments(cfg, config_path, api, heartbeat_seconds, names)
    for pool in names:
        pid_file = state / f"worker-{pool}.pid"
        if pid_file.exists() and _alive(int(pid_file.read_text())):
            if ray_addr and f"RAY_ADDRESS={ray_addr}" not in _environ(int(pid_file.read_text())):
                log(f"worker: pool {pool!r} was started before the Ray head and does not see RAY_ADDRESS; set "
                    f"launch.ray.address: {ray_addr}, or `rlhf down` and `rlhf up --ray` (it may be running a flow)")
            continue
        pid = _spawn(state, f"worker-{pool}", [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process"], env)
        log(f"worker: pool {pool!r} (pid {pid})")
    (state / "pools.json").write_text(json.dumps(names))
    log("deployments: rlhf/full and rlhf-stage/<stage>; run: prefect deployment run rlhf/full --watch")
    return api


def register_deployments(cfg: PipelineConfig, config_path: Path, api: str, heartbeat_seconds: int,
                         process_pools: list[str]) -> None:
    """In a child process, so that PREFECT_API_URL applies from Prefect's first import: the process work pools
    (created, or updated in place), the deployments and the crash-detection automation, then `api` as the
    active profile's PREFECT_API_URL (as `prefect config set` does), so that `prefect` commands reach it."""
    code = (
        "import sys, json; from rlhf.cli.services import _register; "
        "_register(json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))"
    )
    env = {**os.environ, "PREFECT_API_URL": api}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(cfg.model_dump(mode="json")),
                           str(config_path.resolve()), str(heartbeat_seconds), json.dumps(process_pools)],
                          env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"registering the deployments on {api} failed:\n{done.stderr[-3000:]}")


def _register(config: dict, config_path: str, heartbeat_seconds: int, process_pools: list[str]) -> None:
    """register_deployments' child: PREFECT_API_URL in its environment names the server."""
    import prefect.settings
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    from flows.rlhf_flow import deploy

    with get_client(sync_client=True) as client:
        for pool in process_pools:  # `prefect work-pool create POOL --type process --overwrite`
            client.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                                   base_job_template=ProcessWorker.get_default_base_job_template()),
                                    overwrite=True)
    deploy(config, config_path, heartbeat_seconds)
    prefect.settings.update_current_profile({"PREFECT_API_URL": os.environ["PREFECT_API_URL"]})


def _stop(pid: int, first: int, then: int, grace: float, group: bool = True) -> None:
    """Prefect workers were measured to ignore the first SIGTERM for 15 s or more: escalate to SIGINT.
    `group`: signal the process group `pid` leads (what `_spawn` started), else the process alone."""
    for sig, wait in ((first, grace), (then, grace), (signal.SIGKILL, 5.0)):
        if not _alive(pid):
            return
        try:
            os.killpg(pid, sig) if group else os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline and _alive(pid):
            time.sleep(0.2)


class RunsLive(RuntimeError):
    """`down` was asked to stop a server that live runs report to."""


def live_runs(state: Path) -> list[dict]:
    """The runs on this host that report to the server `up` started (rlhf/pipeline/liveruns.py)."""
    from rlhf.pipeline import liveruns

    api_file = state / "api_url"
    return liveruns.live(api_file.read_text().strip()) if api_file.exists() else []


def stop_runs(runs: list[dict], log=print, wait: float = 40.0) -> None:
    """SIGTERM to each run's flow process, which stops it as Ctrl-C does (its stage stays resumable), while
    the server it reports to still answers; SIGKILL for one still alive after `wait` s (`rlhf run`'s parent
    process then releases its lock)."""
    for r in runs:
        log(f"stopping run {r['run']!r} (pid {r['pid']})")
        _stop(r["pid"], signal.SIGTERM, signal.SIGTERM, grace=wait / 2, group=False)


def down(state: Path, log=print, force: bool = False) -> None:
    """Stops what `up` started. Refuses (RunsLive) while runs report to its server, unless `force`, which
    stops those runs first."""
    if runs := live_runs(state):
        if not force:
            api = (state / "api_url").read_text().strip()
            named = "; ".join(f"run {r['run']!r} (pid {r['pid']}, store {r['store']})" for r in runs)
            raise RunsLive(f"refused: {named} reports to this Prefect server ({api}), and would fail with it. Let it "
                           f"finish, stop it (Ctrl-C in its shell, or kill -TERM {' '.join(str(r['pid']) for r in runs)}; "
                           "the same command resumes it), or `rlhf down --force` to stop it first")
        stop_runs(runs, log)
    for pid_file in [*sorted(state.glob("worker-*.pid")), state / "ray.pid", state / "mlflow.pid",
                     state / "server.pid"]:  # servers last
        if not pid_file.exists():
            continue
        pid = int(pid_file.read_text())
        _stop(pid, signal.SIGTERM, signal.SIGINT, grace=15.0)
        pid_file.unlink()
        log(f"stopped {pid_file.stem} (pid {pid})")
    (state / "api_url").unlink(missing_ok=True)
    (state / "ray_address").unlink(missing_ok=True)
    (state / "ray_auth_token").unlink(missing_ok=True)
    subprocess.run([str(BIN / "prefect"), "config", "unset", "PREFECT_API_URL"], capture_output=True)


def status(state: Path) -> dict:
    out = {"api_url": (state / "api_url").read_text().strip() if (state / "api_url").exists() else None}
    if (state / "ray_address").exists():
        out["ray_address"] = (state / "ray_address").read_text().strip()
    for pid_file in sorted(state.glob("*.pid")):
        pid = int(pid_file.read_text())
        out[pid_file.stem] = {"pid": pid, "alive": _alive(pid)}
    out["healthy"] = bool(out["api_url"]) and _healthy(out["api_url"])
    out["runs"] = [{k: r[k] for k in ("run", "pid", "store")} for r in live_runs(state)]
    return out
