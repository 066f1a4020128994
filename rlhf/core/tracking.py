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
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf.core.config import TrackingConfig

log = logging.getLogger("rlhf.tracking")
# backend -> the module it needs, and how to get it
NEEDS = {"tensorboard": ("tensorboard", "pip install tensorboard (or the [tracking] extra)"),
         "mlflow": ("mlflow", "pip install mlflow-skinny==3.17.2 (or the [tracking] extra)")}
FOLDER = "tensorboard"


def server_problem(uri: str, timeout: float = 3.0) -> str | None:
    """Why the MLflow server at `uri` cannot be used, or None when its /health answers 200."""
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=timeout) as r:
            return None if r.status == 200 else f"/health answered HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return f"/health answered HTTP {e.code}"
    except (OSError, ValueError) as e:
        return str(getattr(e, "reason", e))


def backend_problems(cfg: TrackingConfig, reachability: bool = True) -> list[str]:
    """'tracking...' lines for backends this environment cannot run (checked before any work)."""
    out = []
    for name in cfg.backends:
        module, how = NEEDS[name]
        if importlib.util.find_spec(module) is None:
            out.append(f"tracking.backends: {name!r} needs the {module} package, which is not installed: {how}")
        elif name == "mlflow" and reachability and (why := server_problem(cfg.mlflow.uri)):
            out.append(f"tracking.mlflow.uri: no MLflow server answers at {cfg.mlflow.uri} ({why}); `rlhf up` "
                       "starts one for a 127.0.0.1 or localhost URI, or point tracking.mlflow.uri at yours")
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


class TensorBoard:
    def __init__(self, logdir: Path):
        from torch.utils.tensorboard import SummaryWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(logdir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def text(self, tag: str, value: dict) -> None:
        self.writer.add_text(tag, "```\n" + json.dumps(value, indent=2, sort_keys=True, default=str) + "\n```")
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class MLflow:
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


class Tracker:
    """Writes to every configured backend; with none, every call does nothing. A backend that raises is
    dropped for the rest of the stage with one warning: the store keeps the numbers either way."""

    def __init__(self, backends: list):
        self.backends = backends

    @classmethod
    def open(cls, cfg: TrackingConfig, logdir: Path, run: str = "", stage: str = "", key: str = "") -> Tracker:
        backends = []
        if "tensorboard" in cfg.backends:
            backends.append(TensorBoard(logdir))
        if "mlflow" in cfg.backends:
            try:
                backends.append(MLflow(cfg, run, stage, key))
            except Exception as e:  # noqa: BLE001 (any client failure: the stage runs without it)
                log.warning("mlflow: %s at %s: %s; this stage logs without it", type(e).__name__, cfg.mlflow.uri, e)
        return cls(backends)

    def _each(self, call: str, *args) -> None:
        for backend in list(self.backends):
            try:
                getattr(backend, call)(*args)
            except Exception as e:  # noqa: BLE001
                log.warning("%s: %s: %s; this stage logs without it", type(backend).__name__.lower(), type(e).__name__, e)
                self.backends.remove(backend)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Scalars at one step; values that are not finite numbers are skipped (NaN has no curve)."""
        if self.backends and (values := finite(metrics)):
            self._each("log", step, values)

    def text(self, tag: str, value: dict) -> None:
        """A record (config, keys, outputs)."""
        self._each("text", tag, value)

    def close(self, failed: bool = False) -> None:
        self._each("close", failed)


NULL = Tracker([])
_current: Tracker = NULL


def current() -> Tracker:
    """This process's tracker for the running stage (a no-op one outside a stage or on ranks > 0)."""
    return _current


@contextmanager
def stage_tracker(cfg: TrackingConfig, logdir: Path, run: str = "", stage: str = "", key: str = "") -> Iterator[Tracker]:
    """Makes a tracker this process's current one for the duration of a stage."""
    global _current
    tracker = Tracker.open(cfg, logdir, run, stage, key)
    previous, _current = _current, tracker
    failed = True
    try:
        yield tracker
        failed = False
    finally:
        _current = previous
        tracker.close(failed)
