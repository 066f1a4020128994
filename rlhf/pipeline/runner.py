"""Plain-Python stage execution: content keys, skip/resume decisions and manifests (the DAG: rlhf/core/registry.py).

The Prefect flow calls `execute_stage` once per stage; tests and the REPL can call it directly.
A stage module exposes `run(stage_cfg, ctx) -> StageResult` and never sees the skip logic.
"""

from __future__ import annotations

import importlib
import logging
import platform
import shutil
import time
from pathlib import Path
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version

from rlhf.core import codehash, tracking
from rlhf.core.config import PipelineConfig
from rlhf.core.models import home
from rlhf.core.registry import SPECS, locate, output_path, role_stages
from rlhf.core.stage import Inputs, StageContext, StageResult
from rlhf.core.ledger import Meter
from rlhf.core.resources import PeakRSS
from rlhf.core.manifest import Manifest, ManifestError
from rlhf.core.store import ATTEMPT, CHECKPOINTS, MANIFEST, ArtifactStore, StorageError
from rlhf.pipeline.identity import identity, key_of
from rlhf.pipeline.launch import run_stage

log = logging.getLogger("rlhf.pipeline.runner")

PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "pyarrow", "rlhf-pipeline")


def content_key(cfg: PipelineConfig, stage: str, input_keys: dict[str, str]) -> str:
    """Hash of everything that determines the stage's outputs (rlhf/pipeline/identity.py): not where it
    runs, not the run name."""
    return key_of(identity(cfg, stage, input_keys))


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def stage_identity(cfg: PipelineConfig, stage: str, store: ArtifactStore) -> tuple[Inputs, str]:
    """The stage's inputs (each manifest must be complete) and its content key."""
    inputs, ident = inputs_and_identity(cfg, stage, store)
    return inputs, key_of(ident)


def inputs_and_identity(cfg: PipelineConfig, stage: str, store: ArtifactStore) -> tuple[Inputs, dict]:
    """The stage's inputs by role, as it receives them, and the identity its key hashes (their keys in it)."""
    roles = SPECS[stage].inputs(cfg)
    inputs = Inputs.build(roles, {s: input_manifest(cfg, store, s) for s in role_stages(roles)})
    return inputs, identity(cfg, stage, inputs.keys())


def input_manifest(cfg: PipelineConfig, store: ArtifactStore, stage: str) -> Manifest:
    """An input stage's complete manifest, with every output its spec requires (one read back from a shared
    store, or written by an older version, may lack one: named here, not a KeyError inside the stage)."""
    run, name = locate(cfg.run.name, stage)
    manifest = store.require_manifest(run, name)
    missing = [p for p in SPECS[name].output_problems(manifest["outputs"]) if p.endswith("is missing")]
    if missing:
        raise ManifestError(f"{store.url(store.stage_path(run, name, MANIFEST))}: {'; '.join(missing)} "
                            f"(stage {name!r} of run {run!r} declares it); rerun that stage")
    return manifest


def stage_workdir(cfg: PipelineConfig, stage: str, key: str) -> Path:
    """The stage attempt's local scratch, keyed by the content key (a resumed attempt finds its files)."""
    return home() / "work" / cfg.run.name / f"{stage}-{key[:16]}"


def execute_stage(cfg: PipelineConfig, stage: str, store: ArtifactStore | None = None) -> Manifest:
    """Run one stage unless a complete manifest with the same content key exists.

    Returns the manifest plus a `status` of skipped / ran / resumed. A missing or different manifest
    with a leftover attempt under the same key keeps the checkpoints (resume); a changed key clears the
    prefix first (a changed key rewrites the prefix).
    """
    store = store or ArtifactStore(cfg.storage)
    run = cfg.run.name
    inputs, ident = inputs_and_identity(cfg, stage, store)
    key = key_of(ident)
    try:
        existing, invalid = store.read_manifest(run, stage), False
    except ManifestError as e:  # not a completion this code can trust: the stage runs again
        log.warning("%s: %s; running the stage again", stage, e)
        existing, invalid = None, True
    if existing is not None and existing["key"] == key:
        log.info("%s: skipped, complete with key %s", stage, key[:12])
        return {**existing, "status": "skipped"}
    attempt = store.read_json(store.stage_path(run, stage, ATTEMPT))
    if existing is not None or invalid or (attempt is not None and attempt.get("key") != key):
        log.info("%s: content key changed to %s; clearing %s", stage, key[:12], store.url(store.stage_path(run, stage)))
        store.clear_stage(run, stage)
    store.write_json(store.stage_path(run, stage, ATTEMPT), {"key": key, "started": _now()})

    module = importlib.import_module(SPECS[stage].module)
    stage_log = logging.getLogger(f"rlhf.{stage}")
    workdir = stage_workdir(cfg, stage, key)
    ctx = StageContext(cfg, store, stage, key, inputs, workdir, stage_log)
    started, t0 = _now(), time.perf_counter()

    # the identity the key hashes, and the stage's whole config section (placement too) for the record
    record = {"key": key, **{k: v for k, v in ident.items() if k != "stage"}, "config": cfg.stage(stage).model_dump(mode="json"),
              "code_version": codehash.version_of(ident["code"])}
    try:
        with PeakRSS() as rss, Meter() as meter, tracking.stage_tracker(cfg.tracking, workdir, run, stage, key) as tracker:
            tracker.text(f"{stage}/params", record)
            result: StageResult = run_stage(module, cfg.stage(stage), ctx)
            if problems := SPECS[stage].output_problems(result.outputs):  # the registry's declaration is the contract
                raise RuntimeError(f"stage {stage!r}: {'; '.join(problems)} (rlhf/core/registry.py declares its outputs)")
            tracker.final(result.metrics)
            tracker.text(f"{stage}/outputs", {n: store.url(output_path(store, run, stage, n, rel)) for n, rel in result.outputs.items()})
        for backend, folder in tracking.FOLDERS.items():  # before the manifest: a stage without one is incomplete
            if backend in cfg.tracking.backends and (workdir / folder).is_dir():
                store.put_dir(workdir / folder, ctx.path(folder))
    except StorageError as e:  # name the stage; the URL (never credentials) is in the message already
        raise StorageError(f"stage {stage!r} of run {run!r}: {e}") from e
    seconds = time.perf_counter() - t0
    manifest = {
        "schema_version": 1,
        "run": run,
        "stage": stage,
        **record,  # key, inputs, config, the other parts of its key (rlhf validate and diff explain a key from them)
        "environment": package_versions(),
        "outputs": result.outputs,
        "rows": result.rows,
        "metrics": result.metrics,
        "resumed_from_step": result.resumed_from_step,
        "timings": {"started": started, "finished": _now(), "seconds": round(seconds, 3), **rss.figures()},
        "ledger": meter.figures(),  # CPU seconds, peak GPU memory, device, package-set hash (rlhf/core/ledger.py)
    }
    store.write_manifest(run, stage, manifest)  # last: from here on the stage counts as complete
    # Checkpoints only serve to resume an incomplete stage; a complete one drops them (they hold the
    # optimizer state, several times the model's size).
    store.remove(store.stage_path(run, stage, CHECKPOINTS))
    # The local scratch (trainer output, downloaded inputs, copies on their way to the store) is worth
    # nothing once the store holds the result; left behind it grows without bound on a long-lived worker.
    shutil.rmtree(workdir, ignore_errors=True)
    status = "resumed" if result.resumed_from_step else "ran"
    log.info("%s: %s in %.1f s (key %s)", stage, status, seconds, key[:12])
    return {**manifest, "status": status}
