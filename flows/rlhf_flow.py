"""The `rlhf` flow: runs the enabled stages in DAG order, one Prefect task per stage.

Tasks receive the resolved config (a small dict) and pass artifact references, never tensors or
models, so a task can run in another process or on another work pool and read the same artifacts from
the store. Skips, resumes and runs are decided by rlhf.pipeline.runner.execute_stage.

Not `flows/rlhf.py`: Prefect loads a deployment's entrypoint as a module named after its file, so a file
named rlhf.py would replace the `rlhf` package in the flow-run process (tests/test_layers.py checks).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.settings import PREFECT_API_URL

from rlhf.core import progress

from rlhf.pipeline import liveruns, preflight
from rlhf.core.loader import ConfigError, load_config, validate
from rlhf.pipeline.lock import RunLock
from rlhf.core.registry import plan
from rlhf.pipeline.runner import execute_stage, stage_identity
from rlhf.core.manifest import ManifestError
from rlhf.core.store import ArtifactMissing, ArtifactStore


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


SUMMARY = ("stage", "status", "key", "outputs", "metrics", "resumed_from_step")


class ProgressArtifact:
    """Keeps one Prefect progress artifact per stage run up to date (at most every few seconds), so the
    UI shows how far the stage is; fed by rlhf.core.progress, which the stage loops report to."""

    def __init__(self, min_interval: float = 3.0):
        self.id, self.last, self.min_interval, self.failed = None, 0.0, min_interval, False

    def __call__(self, stage: str, fraction: float) -> None:
        import time

        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        now = time.monotonic()
        try:
            if self.id is None:
                self.id = create_progress_artifact(progress=100 * fraction, description=f"stage {stage}")
            elif fraction >= 1.0 or now - self.last >= self.min_interval:
                update_progress_artifact(artifact_id=self.id, progress=100 * fraction)
            else:
                return
        except Exception as e:  # a progress bar never fails a stage (an API that went away is watched elsewhere)
            if not self.failed:
                logging.getLogger("rlhf.progress").warning("%s: progress not shown in the UI: %s: %s", stage,
                                                           type(e).__name__, e)
            self.failed = True
        self.last = now


def _run_stage(config: dict, stage: str) -> dict:
    cfg = validate(config, f"resolved config of stage {stage}")
    with stage_logs_to_prefect(), progress.listening(ProgressArtifact(), stage):
        manifest = execute_stage(cfg, stage)
    return {k: manifest[k] for k in SUMMARY}


@task(cache_policy=NO_CACHE)
def stage_task(config: dict, stage: str) -> dict:
    """In-process stage (`rlhf run`)."""
    return _run_stage(config, stage)


@flow(name="rlhf-stage")
def rlhf_stage(config: dict, stage: str) -> dict:
    """One stage as its own flow run, deployed as `rlhf-stage/<stage>` on that stage's work pool."""
    return _run_stage(config, stage)


def complete_key(store: ArtifactStore, cfg, stage: str, manifest: dict | None) -> str | None:
    """The stage's content key when its manifest in the store already carries it (the stage is complete),
    else None. Computed here as the stage run would (same config, same code), so a complete stage costs no
    flow run on its pool: on a cluster that is a pod, or a GPU node's start-up, for nothing."""
    if manifest is None:
        return None
    try:
        _, key = stage_identity(cfg, stage, store)
    except (ArtifactMissing, ManifestError):  # an input is incomplete or unreadable: the stage run reports it
        return None
    return key if manifest["key"] == key else None


def dispatch_stage(cfg, resolved: dict, stage: str) -> dict:
    """Runs `rlhf-stage/<stage>` on the stage's pool and waits; the outcome is read back from the
    artifact store (flow results are not persisted, and the manifest is the source of truth). A stage
    that is already complete under its content key is skipped here, without a flow run."""
    from prefect.deployments import run_deployment

    store = ArtifactStore(cfg.storage)
    try:
        before = store.read_manifest(cfg.run.name, stage)
    except ManifestError:  # the stage run replaces it (and logs why)
        before = None
    if key := complete_key(store, cfg, stage, before):  # in the words a stage run uses (runner.execute_stage)
        get_run_logger().info("%s: skipped, complete with key %s; not sent to work pool %r", stage, key[:12],
                              cfg.work_pool(stage))
        return {**{k: before.get(k) for k in SUMMARY}, "status": "skipped"}
    placement = cfg.stage(stage)
    flow_run = run_deployment(
        f"rlhf-stage/{stage}", parameters={"config": resolved, "stage": stage},
        job_variables=dict(placement.job_variables), timeout=None, poll_interval=2, as_subflow=True,
    )
    if not flow_run.state.is_completed():  # Crashed too: a lost worker (see ensure_crash_detection)
        raise RuntimeError(
            f"stage {stage!r} on work pool {cfg.work_pool(stage)!r} ended {flow_run.state.name}: {flow_run.state.message}"
        )
    after = store.require_manifest(cfg.run.name, stage)
    skipped = before is not None and before["key"] == after["key"]
    status = "skipped" if skipped else ("resumed" if after.get("resumed_from_step") else "ran")
    return {**{k: after.get(k) for k in SUMMARY}, "status": status}


@flow(name="rlhf")
def rlhf(
    config_path: str = "pipeline.yaml",
    profile: str = "default",
    run_name: str | None = None,
    overrides: list[str] | None = None,
    dispatch: bool = False,
) -> list[dict]:
    """The pipeline. dispatch=False runs stages as tasks in this process (`rlhf run`); dispatch=True
    (the `rlhf/full` deployment) sends each stage to the work pool its config names."""
    overrides = list(overrides or []) + ([f"run.name={run_name}"] if run_name else [])
    cfg = load_config(config_path, profile, overrides)
    # `rlhf run` asked already; a deployment run asks here
    if problems := preflight.network_problems(cfg) or preflight.policy_problems(cfg, ArtifactStore(cfg.storage)):
        raise ConfigError(config_path, problems)
    # Tasks get the resolved config (a small dict), not the file path: editing pipeline.yaml during a
    # run cannot change its later stages, and a worker elsewhere needs no copy of the file.
    resolved = cfg.model_dump(mode="json")
    logger = get_run_logger()
    logger.info("run %r, profile %r, stages: %s", cfg.run.name, profile, " -> ".join(plan(cfg)))
    for line in preflight.check_data(cfg):  # a bad row fails the run here, before any stage starts
        logger.info("preflight: %s", line)
    for line in preflight.report(cfg, ArtifactStore(cfg.storage)):
        if line.startswith("WARNING "):
            logger.warning("preflight: %s", line.removeprefix("WARNING "))
        else:
            logger.info("preflight: %s", line)
    store = ArtifactStore(cfg.storage)
    api = PREFECT_API_URL.value()  # None: a temporary API of this process's own, which `rlhf down` cannot stop
    # the lock refuses a second live run of this name; the record tells `rlhf down` that this run uses its API
    with RunLock(store, cfg.run.name), liveruns.registered(api, cfg.run.name, store.url(store.root)) if api else nullcontext():
        results = run_plan(cfg, resolved, dispatch, logger)
    if "eval" in plan(cfg):
        publish_leaderboard(cfg)
    publish_report(cfg)
    return results


def run_plan(cfg, resolved: dict, dispatch: bool, logger) -> list[dict]:
    results = []
    for stage in plan(cfg):
        if dispatch:
            summary = dispatch_stage(cfg, resolved, stage)
        else:
            summary = stage_task.with_options(name=stage, task_run_name=f"{stage}[{cfg.run.name}]")(resolved, stage)
        how = f" from step {summary['resumed_from_step']}" if summary["status"] == "resumed" else ""
        logger.info("%s: %s%s (key %s)", stage, summary["status"], how, summary["key"][:12])
        results.append(summary)
    return results


def publish_leaderboard(cfg) -> None:
    """The eval stage's leaderboard as Prefect table and markdown artifacts on the flow run."""
    import re

    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from rlhf.core.tables import EVAL_SCHEMAS

    store = ArtifactStore(cfg.storage)
    run = cfg.run.name
    ratings = store.read_table(store.stage_path(run, "eval", "ratings.parquet"), EVAL_SCHEMAS["ratings"]).to_pylist()
    markdown = store.fs.cat_file(store.stage_path(run, "eval", "leaderboard.md")).decode()
    key = re.sub(r"[^a-z0-9-]", "-", f"leaderboard-{run}".lower())
    create_table_artifact(ratings, key=key, description=f"Elo leaderboard of run {run}")
    create_markdown_artifact(
        f"# Leaderboard: run {run}\n\n{markdown}\n\nChart: {store.url(store.stage_path(run, 'eval', 'ratings.png'))}",
        key=f"{key}-md", description=f"Elo leaderboard of run {run}",
    )


CRASH_AUTOMATION = "rlhf: crash flow runs whose heartbeat stopped"


def crash_window(heartbeat_seconds: int) -> int:
    """Seconds without a heartbeat before a run counts as lost: two missed beats plus slack, so one late
    beat on a busy machine never crashes a live run."""
    return 2 * heartbeat_seconds + 15


def ensure_crash_detection(heartbeat_seconds: int) -> None:
    """A SIGKILLed worker or a lost node leaves its flow run Running forever, and `rlhf/full` waiting on
    it. Prefect's own recipe (docs: "detect zombie flows"): deployment runs send a heartbeat event every
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (set on the workers by `rlhf up`), and this proactive
    automation marks a run Crashed when neither a heartbeat nor a final state follows in time. The
    parent's run_deployment then returns, and the pipeline run fails (and can be rerun or retried)."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    try:
        Automation.read(name=CRASH_AUTOMATION).delete()  # upsert: the window follows the heartbeat setting
    except ValueError:
        pass
    window = crash_window(heartbeat_seconds)
    final = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    Automation(
        name=CRASH_AUTOMATION,
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *final},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=window),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {window} s: its worker or node was lost")],
    ).create()


def publish_report(cfg) -> None:
    """The run report (rlhf/ops/report.py) into the store at `<run>/_report/`, and as a markdown artifact."""
    import re
    import tempfile
    from pathlib import Path

    from prefect.artifacts import create_markdown_artifact

    from rlhf.ops.report import build

    store = ArtifactStore(cfg.storage)
    with tempfile.TemporaryDirectory() as tmp:
        path = build(store, cfg.run.name, Path(tmp))
        store.put_dir(Path(tmp), store.path(cfg.run.name, "_report"))
        markdown = path.read_text()
    where = store.url(store.path(cfg.run.name, "_report"))
    key = re.sub(r"[^a-z0-9-]", "-", f"report-{cfg.run.name}".lower())
    create_markdown_artifact(f"{markdown}\n\nPlots: {where}", key=key, description=f"report of run {cfg.run.name}")


def deploy(config: dict, config_path: str, heartbeat_seconds: int = 30, source: str | None = None) -> None:
    """Registers `rlhf/full` and one `rlhf-stage/<stage>` per stage, each on its configured pool.
    Source is this checkout (a process pool runs the flow from here; no image, no network)."""
    from pathlib import Path

    from rlhf.core.registry import NAMES as STAGES

    cfg = validate(config, "deploy")
    repo = source or str(Path(__file__).resolve().parent.parent)  # a path the workers see, or a git URL
    rlhf.from_source(source=repo, entrypoint="flows/rlhf_flow.py:rlhf").deploy(
        name="full", work_pool_name=cfg.run.work_pool, parameters={"config_path": config_path, "dispatch": True},
        print_next_steps=False, ignore_warnings=True,  # not "use .serve for local development": pools are the point
    )
    for stage in STAGES:
        placement = cfg.stage(stage)
        rlhf_stage.from_source(source=repo, entrypoint="flows/rlhf_flow.py:rlhf_stage").deploy(
            name=stage, work_pool_name=cfg.work_pool(stage), job_variables=dict(placement.job_variables),
            print_next_steps=False, ignore_warnings=True,
        )
    ensure_crash_detection(heartbeat_seconds)
