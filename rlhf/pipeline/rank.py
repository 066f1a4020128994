"""One rank of a launched stage, whichever launcher started it (torchrun: rlhf/pipeline/launch.py; Ray:
rlhf/pipeline/ray_launch.py)."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

from rlhf.core import tracking
from rlhf.core.config import PipelineConfig, TrackingConfig
from rlhf.core.models import resolve_model
from rlhf.core.registry import SPECS
from rlhf.core.stage import Inputs, StageContext
from rlhf.core.store import ArtifactStore


class LaunchError(RuntimeError):
    pass


def launch_spec(cfg: PipelineConfig, stage: str, key: str, inputs: Inputs) -> dict:
    """What every rank rebuilds its stage from (the launcher adds the rank's scratch folder)."""
    return {"config": cfg.model_dump(mode="json"), "stage": stage, "key": key, "inputs": inputs.to_json()}


def importable_path() -> str:
    """PYTHONPATH for ranks: they import what this process can (a reward function module found through its
    sys.path)."""
    return os.pathsep.join([*filter(None, [os.environ.get("PYTHONPATH")]), *(p for p in sys.path if p and Path(p).is_dir())])


def seeded_run(module, stage_cfg, ctx: StageContext):
    """The stage's `run()` after seeding Python, NumPy and torch with `run.seed` (transformers' set_seed).
    In `rlhf run` every stage shares one process: whatever a stage draws at random before anything seeds
    it (the RL loop's LoRA matrices from peft; TRL's trainers seed themselves first) would otherwise depend
    on the stages that ran before it, and the same content key could give another model in a fresh worker."""
    from transformers import set_seed

    set_seed(ctx.cfg.run.seed)
    return module.run(stage_cfg, ctx)


def rank_context(spec: dict) -> StageContext:
    """Config, store and stage context rebuilt from a launch spec (a rank's, or the Ray engine actor's)."""
    cfg = PipelineConfig.model_validate(spec["config"])
    stage = spec["stage"]
    return StageContext(cfg, ArtifactStore(cfg.storage), stage, spec["key"], Inputs.from_json(spec["inputs"]), Path(spec["workdir"]),
                        logging.getLogger(f"rlhf.{stage}"))


def rank_main(spec: dict) -> dict | None:
    """One rank of a launched stage: join the process group (torchrun's or the Ray launcher's environment),
    rebuild config, store and context from the spec, call the stage's own `run()`. Rank 0 returns the
    StageResult as a dict, the other ranks None."""
    import torch
    import torch.distributed as dist

    ctx = rank_context(spec)
    cfg, stage = ctx.cfg, ctx.stage
    # The base model's local copy (the embedded GGUF converted, or the tiny model) is found or built before
    # the process group exists: once it does, transformers' save_pretrained writes no weights on a rank
    # other than 0, and a Ray rank on a fresh node would publish a copy without them.
    resolve_model(cfg.model)
    cuda = torch.cuda.is_available()
    if cuda:  # Ray shows each rank only its node's reserved GPUs; LOCAL_RANK indexes them
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # A long timeout: rank 0 alone evaluates and publishes at the end while the others wait; a dead rank
    # ends the group through its launcher (torchrun, or the Ray launcher killing the other ranks).
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(hours=2))
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", stream=sys.stdout, force=True)
    # rank 0 logs to the trackers (beside the parent's params and final metrics, same folder)
    with tracking.stage_tracker(cfg.tracking if rank == 0 else TrackingConfig(), ctx.workdir, cfg.run.name, stage, spec["key"]):
        result = seeded_run(importlib.import_module(SPECS[stage].module), cfg.stage(stage), ctx)
    dist.barrier()
    dist.destroy_process_group()
    return asdict(result) if rank == 0 else None
