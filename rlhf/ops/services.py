"""Local bring-up: a Prefect server on 127.0.0.1, one process work pool and worker per pool named in
pipeline.yaml, and the deployments `rlhf/full` (the pipeline) and `rlhf-stage/<stage>` (one per stage,
on that stage's pool). `down` stops exactly what `up` started, by the PIDs it recorded.

With tracking.backends: [mlflow] and a 127.0.0.1/localhost tracking.mlflow.uri, `up` also starts an MLflow
tracking server there (from its own environment, ./setup-mlflow.sh: full mlflow pins pyarrow below ours),
bound to 127.0.0.1, SQLite backend and artifacts under `<state>/mlflow/`.

State lives in a folder (default `<RLHF_HOME>/services`): the server's SQLite database (its own
PREFECT_HOME), logs, PID files and `api_url`. `up` also sets PREFECT_API_URL in the caller's active
Prefect profile so that a plain `prefect deployment run rlhf/full --watch` reaches this server; `down`
unsets it again.
"""

from __future__ import annotations

import json
import os
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

REPO = Path(__file__).resolve().parents[2]  # the checkout: rlhf/ops/services.py
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
                 {**os.environ, "MLFLOW_TRACKING_URI": ""})
    deadline = time.time() + 120
    while not _healthy(uri):
        if time.time() > deadline or not _alive(pid):
            raise RuntimeError(f"MLflow server did not become healthy at {uri}; see {state / 'mlflow.log'}")
        time.sleep(0.5)
    log(f"mlflow: {uri} (pid {pid})")
    return uri


def up(cfg: PipelineConfig, config_path: Path, state: Path, poll_seconds: int = 5, heartbeat_seconds: int = 30,
       log=print) -> str:
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
    for pool in pools(cfg):
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", pool, "--type", "process", "--overwrite"],
                       env=env, check=True, capture_output=True)
        pid_file = state / f"worker-{pool}.pid"
        if pid_file.exists() and _alive(int(pid_file.read_text())):
            continue
        pid = _spawn(state, f"worker-{pool}", [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process"], env)
        log(f"worker: pool {pool!r} (pid {pid})")
    start_mlflow(cfg, state, log)
    register_deployments(cfg, config_path, api, heartbeat_seconds)
    subprocess.run([str(BIN / "prefect"), "config", "set", f"PREFECT_API_URL={api}"], check=True, capture_output=True)
    (state / "pools.json").write_text(json.dumps(pools(cfg)))
    log("deployments: rlhf/full and rlhf-stage/<stage>; run: prefect deployment run rlhf/full --watch")
    return api


def register_deployments(cfg: PipelineConfig, config_path: Path, api: str, heartbeat_seconds: int) -> None:
    """Registered in a child process so that PREFECT_API_URL applies from Prefect's first import."""
    code = (
        "import sys, json; from flows.rlhf_flow import deploy; "
        "deploy(json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]))"
    )
    env = {**os.environ, "PREFECT_API_URL": api}
    subprocess.run([sys.executable, "-c", code, json.dumps(cfg.model_dump(mode="json")), str(config_path.resolve()),
                    str(heartbeat_seconds)], env=env, check=True, cwd=REPO)


def _stop(pid: int, first: int, then: int, grace: float) -> None:
    """Prefect workers were measured to ignore the first SIGTERM for 15 s or more: escalate to SIGINT."""
    for sig, wait in ((first, grace), (then, grace), (signal.SIGKILL, 5.0)):
        if not _alive(pid):
            return
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline and _alive(pid):
            time.sleep(0.2)


def down(state: Path, log=print) -> None:
    for pid_file in [*sorted(state.glob("worker-*.pid")), state / "mlflow.pid", state / "server.pid"]:  # servers last
        if not pid_file.exists():
            continue
        pid = int(pid_file.read_text())
        _stop(pid, signal.SIGTERM, signal.SIGINT, grace=15.0)
        pid_file.unlink()
        log(f"stopped {pid_file.stem} (pid {pid})")
    (state / "api_url").unlink(missing_ok=True)
    subprocess.run([str(BIN / "prefect"), "config", "unset", "PREFECT_API_URL"], capture_output=True)


def status(state: Path) -> dict:
    out = {"api_url": (state / "api_url").read_text().strip() if (state / "api_url").exists() else None}
    for pid_file in sorted(state.glob("*.pid")):
        pid = int(pid_file.read_text())
        out[pid_file.stem] = {"pid": pid, "alive": _alive(pid)}
    out["healthy"] = bool(out["api_url"]) and _healthy(out["api_url"])
    return out
