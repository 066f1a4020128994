"""Experiment trackers: the curves where people look while a stage trains.

The store keeps every number anyway (each stage's metrics table, its manifest); a tracker mirrors them as
they are logged. One tracker per stage attempt, in the process that runs the stage (rank 0 of a
multi-process stage): the runner logs the config, content key and inputs when the stage starts and the
final metrics and output URLs when it ends; the Trainer stages log every Trainer log line
(rlhf/train/training.py), the RL loop every iteration (rlhf/train/rl_loop.py).

Backends (tracking.backends):
  tensorboard  event files written under the stage's scratch folder, uploaded to `<stage>/tensorboard/` in
               the store when the stage ends. A resumed stage finds its earlier attempt's event files in
               the same scratch folder (it is keyed by the content key) and continues their curves: one
               run per stage in TensorBoard, not two.
  mlflow       a run per pipeline run (tag rlhf.run) with a nested run per stage (tags rlhf.stage and
               rlhf.key), on the server at tracking.mlflow.uri. A resumed stage finds its run by those
               tags and continues it: one run per stage, not two. Records become params (`config.*`,
               `inputs.*`, ...; those already logged are kept, as MLflow params cannot change), outputs
               become tags. A server that stops answering mid-stage costs the curves, never the stage.
  trackio      a run per stage, named <run>.<stage>.<key prefix> and grouped by the pipeline run, in trackio's
               local SQLite (TRACKIO_DIR); the record becomes the run's config. A resumed stage continues
               its run (trackio's resume="allow" on that name).
  wandb        a run per stage (group: the pipeline run, job type: the stage), its id derived from run,
               stage and content key, so a resumed stage resumes that run (W&B's resume="allow"). Offline
               by default: the run files are written under the stage's scratch folder and uploaded to
               `<stage>/wandb/` in the store when the stage ends; `wandb sync` uploads them later (the
               attempts of a resumed stage are separate folders with one run id). No git, code, system
               metrics or machine metadata are captured: the stage record says what ran.

A multi-process stage logs from two processes: the runner (params, final metrics) and rank 0 of the
launched workers (every step). Backends that hold one writer per run (trackio, wandb) are closed by the
runner while the workers run and reopened after (Tracker.handoff).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import netrc
import logging
import math
import os
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf.core.config import TrackingConfig
from rlhf.core.net import http_status, shown

log = logging.getLogger("rlhf.tracking")
# backend -> the module it needs, and how to get it
NEEDS = {"tensorboard": ("tensorboard", "pip install tensorboard (or the [tracking] extra)"),
         "mlflow": ("mlflow", "pip install mlflow-skinny==3.17.2 (or the [tracking] extra)"),
         "trackio": ("trackio", "pip install trackio==0.43.0 (or the [tracking] extra)"),
         "wandb": ("wandb", "pip install wandb==0.31.0 (or the [tracking] extra)")}
# backends that write files under the stage's scratch folder; the runner uploads them to <stage>/<folder>/
FOLDERS = {"tensorboard": "tensorboard", "wandb": "wandb"}
WANDB_URL = "https://api.wandb.ai"


def server_problem(uri: str, timeout: float = 3.0) -> str | None:
    """Why the MLflow server at `uri` cannot be used, or None when its /health answers 200."""
    status, why = http_status(f"{uri}/health", timeout)
    return why if why else None if status == 200 else f"/health answered HTTP {status}"


def wandb_base(env: dict | None = None) -> str:
    return (os.environ if env is None else env).get("WANDB_BASE_URL", WANDB_URL).rstrip("/")


def wandb_key_problem(env: dict | None = None) -> str | None:
    """Why online W&B has no API key here (WANDB_API_KEY, or `wandb login`'s ~/.netrc entry), or None.
    Neither the key nor credentials in WANDB_BASE_URL reach the message."""
    env = os.environ if env is None else env
    base = wandb_base(env)
    if env.get("WANDB_API_KEY"):
        return None
    try:
        if netrc.netrc().authenticators(urllib.parse.urlsplit(base).hostname or "") is not None:
            return None
    except (OSError, ValueError, netrc.NetrcParseError):
        pass
    return f"no W&B API key: set WANDB_API_KEY or run `wandb login` (server {shown(base)})"


def wandb_server_problem(env: dict | None = None, timeout: float = 3.0) -> str | None:
    """Why W&B's server does not answer within `timeout` s (any HTTP status counts as an answer), or None."""
    base = wandb_base(env)
    if (why := http_status(base, timeout)[1]) is not None:
        return f"no W&B server answers at {shown(base)} ({why}); set WANDB_BASE_URL, or use tracking.wandb.mode: offline"
    return None


def backend_problems(cfg: TrackingConfig) -> list[str]:
    """'tracking...' lines for backends whose package is not installed (load time: no network)."""
    out = []
    for name in cfg.backends:
        module, how = NEEDS[name]
        if importlib.util.find_spec(module) is None:
            out.append(f"tracking.backends: {name!r} needs the {module} package, which is not installed: {how}")
        elif name == "wandb" and cfg.wandb.mode == "online" and (why := wandb_key_problem()):
            out.append(f"tracking.wandb.mode: online, but {why}")
    return out


def network_problems(cfg: TrackingConfig, timeout: float = 3.0) -> list[str]:
    """'tracking...' lines for tracking servers that do not answer within `timeout` s (preflight)."""
    out = []
    if "mlflow" in cfg.backends and (why := server_problem(cfg.mlflow.uri, timeout)):
        out.append(f"tracking.mlflow.uri: no MLflow server answers at {cfg.mlflow.uri} ({why}); `rlhf up` "
                   "starts one for a 127.0.0.1 or localhost URI, or point tracking.mlflow.uri at yours")
    if "wandb" in cfg.backends and cfg.wandb.mode == "online" and (why := wandb_server_problem(timeout=timeout)):
        out.append(f"tracking.wandb.mode: online, but {why}")
    return out


def flatten(record: dict, prefix: str = "") -> dict[str, str]:
    """{'config': {'lr': 1e-3}} -> {'config.lr': '0.001'}; lists and scalars as JSON text."""
    out = {}
    for k, v in record.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{name}."))
        else:
            out[name] = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return out


def finite(metrics: dict) -> dict[str, float]:
    """The values that are finite numbers (NaN has no curve; booleans are not metrics)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def record_text(value: dict) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


class FinalAtZero:
    """Final metrics as `final/<name>` at step 0, for backends whose steps may go back (W&B's may not)."""

    def final(self, metrics: dict[str, float]) -> None:
        self.log(0, {f"final/{k}": v for k, v in metrics.items()})


class TensorBoard(FinalAtZero):
    def __init__(self, logdir: Path):
        from torch.utils.tensorboard import SummaryWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(logdir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def text(self, tag: str, value: dict) -> None:
        self.writer.add_text(tag, "```\n" + record_text(value) + "\n```")
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class MLflow(FinalAtZero):
    """A nested run per stage under the pipeline run's run, found again by tags on resume."""

    PARAM_LIMIT = 6000  # MLflow's longest param value; longer ones are cut (the manifest has them whole)

    def __init__(self, cfg: TrackingConfig, run: str, stage: str, key: str):
        # a server that stops answering must not hold a stage for minutes of the client's own retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(cfg.mlflow.uri)
        exp = self.client.get_experiment_by_name(cfg.mlflow.experiment)
        self.exp = exp.experiment_id if exp else self.client.create_experiment(cfg.mlflow.experiment)
        self.parent = self._find_or_create({"rlhf.run": run, "rlhf.role": "pipeline"}, run)
        self.run_id = self._find_or_create({"rlhf.run": run, "rlhf.stage": stage, "rlhf.key": key}, stage,
                                           {"mlflow.parentRunId": self.parent})
        self.params = set(self.client.get_run(self.run_id).data.params)  # logged by an earlier attempt

    def _find_or_create(self, tags: dict[str, str], name: str, extra: dict | None = None) -> str:
        # tag values are run/stage names (checked: [A-Za-z0-9._-]) and hex keys; quotes escaped regardless
        query = " AND ".join(f"tags.`{k}` = '{v.replace(chr(39), chr(39) * 2)}'" for k, v in tags.items())
        found = self.client.search_runs([self.exp], filter_string=query, max_results=1, order_by=["attributes.start_time ASC"])
        if found:
            self.client.update_run(found[0].info.run_id, status="RUNNING")
            return found[0].info.run_id
        return self.client.create_run(self.exp, run_name=name, tags={**tags, **(extra or {})}).info.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(name, value, now, step) for name, value in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow's log_batch limit
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def text(self, tag: str, value: dict) -> None:
        from mlflow.entities import Param, RunTag

        kind = tag.rsplit("/", 1)[-1]
        flat = flatten(value)
        if kind == "outputs":  # outputs can change between attempts: tags, which may
            tags = [RunTag(f"output.{k}", v[: self.PARAM_LIMIT]) for k, v in flat.items()]
            self.client.log_batch(self.run_id, tags=tags)
            return
        new = [Param(k[:250], v[: self.PARAM_LIMIT]) for k, v in flat.items() if k[:250] not in self.params]
        for i in range(0, len(new), 100):  # MLflow's params-per-batch limit
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        self.params.update(p.key for p in new)

    def close(self, failed: bool) -> None:
        status = "FAILED" if failed else "FINISHED"
        self.client.set_terminated(self.run_id, status)
        self.client.set_terminated(self.parent, status)  # the pipeline run shows its latest stage's status


class Trackio(FinalAtZero):
    """A run per stage in trackio's local store, grouped by the pipeline run; the record is its config."""

    def __init__(self, cfg: TrackingConfig, run: str, stage: str, key: str):
        self.args = {"project": cfg.trackio.project, "name": f"{run}.{stage}.{key[:12]}", "group": run}
        self.config: dict[str, str] = {}
        self.step = 0
        self._open()

    def _open(self) -> None:
        import trackio

        # no CPU/GPU sampling thread: the ledger measures the stage; no notebook embedding
        self.run = trackio.init(**self.args, config=dict(self.config) or None, resume="allow", embed=False,
                                auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)
        self.step = max(self.step, step)

    def text(self, tag: str, value: dict) -> None:
        import trackio

        if tag.rsplit("/", 1)[-1] == "params":  # the runner's first call: the config goes out with the first log
            self.config.update(flatten(value))
            self.run.config.update(flatten(value))
        else:
            self.run.log({tag: trackio.Markdown(f"```json\n{record_text(value)}\n```")}, step=self.step)

    def pause(self) -> None:
        self.run.finish()

    def resume(self) -> None:
        self._open()

    def close(self, failed: bool) -> None:
        self.run.finish()


def wandb_run_id(run: str, stage: str, key: str) -> str:
    """One W&B run id per (run, stage, content key): a resumed stage finds its run, a changed stage starts
    another. Hashed because W&B ids are short and exclude some characters."""
    return hashlib.sha256(f"{run}\0{stage}\0{key}".encode()).hexdigest()[:20]


class Wandb:
    """A W&B run per stage (group: the pipeline run; job type: the stage), offline unless configured."""

    def __init__(self, cfg: TrackingConfig, workdir: Path, run: str, stage: str, key: str):
        workdir.mkdir(parents=True, exist_ok=True)
        self.args = {"project": cfg.wandb.project, "entity": cfg.wandb.entity, "id": wandb_run_id(run, stage, key),
                     "name": f"{run}/{stage}", "group": run, "job_type": stage, "mode": cfg.wandb.mode,
                     "dir": str(workdir), "resume": "allow"}
        self._open()

    def _open(self) -> None:
        import wandb

        # nothing captured beyond what the stage logs: no git state, code, console, system metrics or host
        # metadata (the manifest records what ran; a remote URL may carry a token)
        settings = wandb.Settings(silent=True, console="off", disable_git=True, save_code=False,
                                  x_disable_stats=True, x_disable_meta=True, x_save_requirements=False)
        self.run = wandb.init(**self.args, settings=settings, reinit="create_new")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def final(self, metrics: dict[str, float]) -> None:
        # W&B steps only grow: final figures go to the run's summary, not to a step 0 after the curve
        self.run.summary.update({f"final/{k}": v for k, v in metrics.items()})

    def text(self, tag: str, value: dict) -> None:
        if tag.rsplit("/", 1)[-1] == "params":
            self.run.config.update(flatten(value), allow_val_change=True)
        else:
            self.run.summary.update({f"output.{k}": v for k, v in flatten(value).items()})

    def pause(self) -> None:
        self.run.finish()

    def resume(self) -> None:
        self._open()

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Tracker:
    """Writes to every configured backend; with none, every call does nothing. A backend that raises is
    dropped for the rest of the stage with one warning: the store keeps the numbers either way."""

    def __init__(self, backends: list):
        self.backends = backends

    @classmethod
    def open(cls, cfg: TrackingConfig, workdir: Path, run: str = "", stage: str = "", key: str = "") -> Tracker:
        """`workdir`: the stage attempt's scratch folder; file-writing backends write under FOLDERS there."""
        backends = []
        if "tensorboard" in cfg.backends:
            backends.append(TensorBoard(workdir / FOLDERS["tensorboard"]))
        remote = {"mlflow": lambda: MLflow(cfg, run, stage, key), "trackio": lambda: Trackio(cfg, run, stage, key),
                  "wandb": lambda: Wandb(cfg, workdir, run, stage, key)}
        for name, make in remote.items():
            if name in cfg.backends:
                try:
                    backends.append(make())
                except Exception as e:  # noqa: BLE001 (any client failure: the stage runs without it)
                    log.warning("%s: %s: %s; this stage logs without it", name, type(e).__name__, e)
        return cls(backends)

    def _call(self, backend, call: str, *args) -> None:
        try:
            getattr(backend, call)(*args)
        except Exception as e:  # noqa: BLE001
            log.warning("%s: %s: %s; this stage logs without it", type(backend).__name__.lower(), type(e).__name__, e)
            self.backends.remove(backend)

    def _each(self, call: str, *args) -> None:
        for backend in list(self.backends):
            self._call(backend, call, *args)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Scalars at one step; values that are not finite numbers are skipped (NaN has no curve)."""
        if self.backends and (values := finite(metrics)):
            self._each("log", step, values)

    def final(self, metrics: dict[str, float]) -> None:
        """The stage's final metrics (as `final/<name>`)."""
        if self.backends and (values := finite(metrics)):
            self._each("final", values)

    def text(self, tag: str, value: dict) -> None:
        """A record (config, keys, outputs)."""
        self._each("text", tag, value)

    @contextmanager
    def handoff(self) -> Iterator[None]:
        """Closes the single-writer backends' runs while another process (a launched stage's rank 0) logs to
        them, and reopens them after."""
        paused = [b for b in self.backends if hasattr(b, "pause")]
        for b in paused:
            self._call(b, "pause")
        try:
            yield
        finally:
            for b in paused:
                if b in self.backends:
                    self._call(b, "resume")

    def close(self, failed: bool = False) -> None:
        self._each("close", failed)


NULL = Tracker([])
_current: Tracker = NULL


def current() -> Tracker:
    """This process's tracker for the running stage (a no-op one outside a stage or on ranks > 0)."""
    return _current


@contextmanager
def stage_tracker(cfg: TrackingConfig, workdir: Path, run: str = "", stage: str = "", key: str = "") -> Iterator[Tracker]:
    """Makes a tracker this process's current one for the duration of a stage."""
    global _current
    tracker = Tracker.open(cfg, workdir, run, stage, key)
    previous, _current = _current, tracker
    failed = True
    try:
        yield tracker
        failed = False
    finally:
        _current = previous
        tracker.close(failed)
