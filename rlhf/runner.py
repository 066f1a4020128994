"""Plain-Python stage execution: the DAG, content keys, skip/resume decisions and manifests.

The Prefect flow calls `execute_stage` once per stage; tests and the REPL can call it directly.
A stage module exposes `run(stage_cfg, ctx) -> StageResult` and never sees the skip logic.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import platform
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from rlhf import codehash
from rlhf.config import PipelineConfig
from rlhf.loader import ConfigError
from rlhf.models import home, model_identity
from rlhf.ledger import Meter
from rlhf.resources import PeakRSS
from rlhf.store import ATTEMPT, CHECKPOINTS, ArtifactStore, StorageError

log = logging.getLogger("rlhf.runner")

# stage -> module. Stages of later issues join this table as they land.
STAGE_MODULES = {
    "sft": "stages.sft",
    "preferences": "stages.preferences",
    "reward_model": "stages.reward_model",
    "ref_logprobs": "stages.ref_logprobs",
    "dpo": "stages.dpo",
    "kto": "stages.kto",
    "rollout": "stages.rollout",
    "ppo": "stages.ppo",
    "grpo": "stages.grpo",
    "eval": "stages.eval",
}
# Config sections besides its own that change a stage's outputs (part of its content key).
SHARED_CONFIG = {"ppo": ("rollout",), "grpo": ("rollout",)}
PLACEMENT = {"work_pool", "job_variables", "enabled"}  # where a stage runs: not part of its key
DAG_ORDER = ("sft", "preferences", "reward_model", "ref_logprobs", "dpo", "kto", "ppo", "grpo", "rollout", "eval")
PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "pyarrow", "rlhf-pipeline")


@dataclass
class StageResult:
    outputs: dict[str, str]  # artifact name -> path relative to the stage prefix
    rows: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    resumed_from_step: int | None = None


@dataclass(frozen=True)
class StageContext:
    cfg: PipelineConfig
    store: ArtifactStore
    stage: str
    key: str
    inputs: dict[str, dict]  # input stage -> its manifest
    workdir: Path  # local scratch, keyed by content key; safe to delete
    log: logging.Logger

    def path(self, *rest: str) -> str:
        return self.store.stage_path(self.cfg.run.name, self.stage, *rest)

    def input_path(self, stage: str, output: str) -> str:
        return self.store.stage_path(self.cfg.run.name, stage, self.inputs[stage]["outputs"][output])


def stage_inputs(cfg: PipelineConfig, stage: str) -> list[str]:
    """The stages whose outputs `stage` reads (their keys are part of its content key)."""
    sft = ["sft"] if cfg.sft.enabled else []
    # the pair-trained stages read the on-policy pairs when that stage runs (else the task's or the user's)
    pairs = ["preferences"] if cfg.preferences.enabled else []
    if stage == "preferences":
        return [] if cfg.preferences.policy == "base" else ["sft"]
    if stage == "reward_model":
        return [*(["sft"] if cfg.reward_model.init_from == "sft" else []), *pairs]
    if stage == "ref_logprobs":
        return [*sft, *pairs]  # the reference is the policy DPO starts from: SFT when it runs, else the base model
    if stage == "dpo":
        return [*sft, *pairs, "ref_logprobs"]
    if stage == "kto":
        return [*sft, *pairs]  # KTO keeps its own reference cache (stages/kto.py says why)
    if stage == "rollout":
        return [] if cfg.rollout.policy == "base" else [cfg.rollout.policy]
    if stage in ("ppo", "grpo"):
        rl = cfg.stage(stage)
        rm = rl.reward_source in ("reward_model", "sum") or getattr(rl, "critic_init", "") == "reward_model"
        return [*sft, *(["reward_model"] if rm else [])]
    if stage == "eval":
        policies = [p for p in cfg.eval.policies if p != "base"]
        judge = ["reward_model"] if cfg.reward_model.enabled else []  # scores samples even as a metric only
        return sorted({*policies, *sft, *judge}, key=DAG_ORDER.index)
    return []


def plan(cfg: PipelineConfig) -> list[str]:
    """Enabled stages in DAG order. Refuses stages that this version cannot run, before any work."""
    enabled = [s for s in DAG_ORDER if cfg.stage(s).enabled]
    missing = [s for s in enabled if s not in STAGE_MODULES]
    if missing:
        raise ConfigError(
            "pipeline", [f"{s}.enabled: stage {s!r} is not available in this version; set it to false" for s in missing]
        )
    return enabled


def code_version(stage: str) -> str:
    """Hash of the project files the stage's module and the runner import (rlhf/codehash.py)."""
    return codehash.code_version(STAGE_MODULES[stage].replace(".", "/") + ".py")


def shared_sections(cfg: PipelineConfig, stage: str) -> dict[str, dict]:
    """The other config sections in a stage's key, as the key hashes them and its manifest records them."""
    return {sec: cfg.stage(sec).model_dump(mode="json", exclude=PLACEMENT) for sec in SHARED_CONFIG.get(stage, ())}


def content_key(cfg: PipelineConfig, stage: str, input_keys: dict[str, str]) -> str:
    """Hash of everything that determines the stage's outputs (not where it runs, not the run name)."""
    payload = {
        "stage": stage,
        "config": cfg.stage(stage).model_dump(mode="json", exclude=PLACEMENT),
        # sections of other stages that this one reads (the RL loop samples with the rollout settings)
        "shared": shared_sections(cfg, stage),
        "model": model_identity(cfg.model),
        "data": cfg.data.model_dump(mode="json"),
        "seed": cfg.run.seed,
        "inputs": input_keys,
        "code": code_version(stage),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


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


def execute_stage(cfg: PipelineConfig, stage: str, store: ArtifactStore | None = None) -> dict[str, Any]:
    """Run one stage unless a complete manifest with the same content key exists.

    Returns the manifest plus a `status` of skipped / ran / resumed. A missing or different manifest
    with a leftover attempt under the same key keeps the checkpoints (resume); a changed key clears the
    prefix first (a changed key rewrites the prefix).
    """
    store = store or ArtifactStore(cfg.storage)
    run = cfg.run.name
    inputs = {s: store.require_manifest(run, s) for s in stage_inputs(cfg, stage)}
    key = content_key(cfg, stage, {s: m["key"] for s, m in inputs.items()})
    existing = store.read_manifest(run, stage)
    if existing is not None and existing["key"] == key:
        log.info("%s: skipped, complete with key %s", stage, key[:12])
        return {**existing, "status": "skipped"}
    attempt = store.read_json(store.stage_path(run, stage, ATTEMPT))
    if existing is not None or (attempt is not None and attempt.get("key") != key):
        log.info("%s: content key changed to %s; clearing %s", stage, key[:12], store.url(store.stage_path(run, stage)))
        store.clear_stage(run, stage)
    store.write_json(store.stage_path(run, stage, ATTEMPT), {"key": key, "started": _now()})

    module = importlib.import_module(STAGE_MODULES[stage])
    stage_log = logging.getLogger(f"rlhf.{stage}")
    workdir = home() / "work" / run / f"{stage}-{key[:16]}"
    ctx = StageContext(cfg, store, stage, key, inputs, workdir, stage_log)
    started, t0 = _now(), time.perf_counter()
    from rlhf.launch import run_stage  # imports this module

    try:
        with PeakRSS() as rss, Meter() as meter:
            result: StageResult = run_stage(module, cfg.stage(stage), ctx)
    except StorageError as e:  # name the stage; the URL (never credentials) is in the message already
        raise StorageError(f"stage {stage!r} of run {run!r}: {e}") from e
    seconds = time.perf_counter() - t0
    manifest = {
        "schema_version": 1,
        "run": run,
        "stage": stage,
        "key": key,
        "code_version": code_version(stage),
        "inputs": {s: m["key"] for s, m in inputs.items()},
        "config": cfg.stage(stage).model_dump(mode="json"),
        # the other sections in its key (rlhf diff explains a changed key from these parts)
        "shared": shared_sections(cfg, stage),
        "model": model_identity(cfg.model),
        "data": cfg.data.model_dump(mode="json"),
        "seed": cfg.run.seed,
        "packages": package_versions(),
        "outputs": result.outputs,
        "rows": result.rows,
        "metrics": result.metrics,
        "resumed_from_step": result.resumed_from_step,
        "timings": {"started": started, "finished": _now(), "seconds": round(seconds, 3), **rss.figures()},
        "ledger": meter.figures(),  # CPU seconds, peak GPU memory, device, package-set hash (rlhf/ledger.py)
    }
    store.write_manifest(run, stage, manifest)  # last: from here on the stage counts as complete
    # Checkpoints only serve to resume an incomplete stage; a complete one drops them (they hold the
    # optimizer state, several times the model's size).
    ckpt = store.stage_path(run, stage, CHECKPOINTS)
    if store.fs.exists(ckpt):
        store.fs.rm(ckpt, recursive=True)
    # The local scratch (trainer output, downloaded inputs, copies on their way to the store) is worth
    # nothing once the store holds the result; left behind it grows without bound on a long-lived worker.
    shutil.rmtree(workdir, ignore_errors=True)
    status = "resumed" if result.resumed_from_step else "ran"
    log.info("%s: %s in %.1f s (key %s)", stage, status, seconds, key[:12])
    return {**manifest, "status": status}
