"""The `rlhf` flow: runs the enabled stages in DAG order, one Prefect task per stage.

Tasks receive the resolved config (a small dict) and pass artifact references, never tensors or
models, so a task can run in another process or on another work pool and read the same artifacts from
the store. Skips, resumes and runs are decided by rlhf.runner.execute_stage.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rlhf.loader import load_config, validate
from rlhf.runner import execute_stage, plan


class _ToRunLogger(logging.Handler):
    """Forwards the plain-Python stage loggers (`rlhf.*`) into the Prefect run's logs."""

    def __init__(self, target: logging.Logger | logging.LoggerAdapter):
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        self.target.log(record.levelno, record.getMessage())


@contextmanager
def stage_logs_to_prefect():
    handler = _ToRunLogger(get_run_logger())
    root = logging.getLogger("rlhf")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    propagate, root.propagate = root.propagate, False  # Prefect's run logger already prints to the console
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.propagate = propagate


@task(cache_policy=NO_CACHE)
def stage_task(config: dict, stage: str) -> dict:
    cfg = validate(config, f"resolved config of stage {stage}")
    with stage_logs_to_prefect():
        manifest = execute_stage(cfg, stage)
    return {k: manifest[k] for k in ("stage", "status", "key", "outputs", "metrics", "resumed_from_step")}


@flow(name="rlhf")
def rlhf(
    config_path: str = "pipeline.yaml",
    profile: str = "default",
    run_name: str | None = None,
    overrides: list[str] | None = None,
) -> list[dict]:
    overrides = list(overrides or []) + ([f"run.name={run_name}"] if run_name else [])
    cfg = load_config(config_path, profile, overrides)
    # Tasks get the resolved config (a small dict), not the file path: editing pipeline.yaml during a
    # run cannot change its later stages, and a worker elsewhere needs no copy of the file.
    resolved = cfg.model_dump(mode="json")
    logger = get_run_logger()
    logger.info("run %r, profile %r, stages: %s", cfg.run.name, profile, " -> ".join(plan(cfg)))
    results = []
    for stage in plan(cfg):
        summary = stage_task.with_options(name=stage, task_run_name=f"{stage}[{cfg.run.name}]")(resolved, stage)
        logger.info("%s: %s (key %s)", stage, summary["status"], summary["key"][:12])
        results.append(summary)
    if "eval" in plan(cfg):
        publish_leaderboard(cfg)
    return results


def publish_leaderboard(cfg) -> None:
    """The eval stage's leaderboard as Prefect table and markdown artifacts on the flow run."""
    import re

    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from rlhf.results import SCHEMAS
    from rlhf.store import ArtifactStore

    store = ArtifactStore(cfg.storage)
    run = cfg.run.name
    ratings = store.read_table(store.stage_path(run, "eval", "ratings.parquet"), SCHEMAS["ratings"]).to_pylist()
    markdown = store.fs.cat_file(store.stage_path(run, "eval", "leaderboard.md")).decode()
    key = re.sub(r"[^a-z0-9-]", "-", f"leaderboard-{run}".lower())
    create_table_artifact(ratings, key=key, description=f"Elo leaderboard of run {run}")
    create_markdown_artifact(
        f"# Leaderboard: run {run}\n\n{markdown}\n\nChart: {store.url(store.stage_path(run, 'eval', 'ratings.png'))}",
        key=f"{key}-md", description=f"Elo leaderboard of run {run}",
    )
