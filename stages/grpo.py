"""GRPO (Shao et al. 2024): G samples per prompt, group-normalised advantages, no critic, k3 KL penalty
in the loss, clip (and clip-higher) with optional dual clip. The loop is rlhf/train/rl_loop.py."""

from __future__ import annotations

from rlhf.core.config import GRPOConfig
from rlhf.core.stage import StageContext, StageResult
from rlhf.train import rl_loop


def run(cfg: GRPOConfig, ctx: StageContext) -> StageResult:
    return rl_loop.run_rl("grpo", cfg, ctx)


def engine_host(cfg: GRPOConfig, ctx: StageContext):
    """The rollout engine's own actor under launch.ray.engine: own (rlhf/pipeline/ray_launch.py)."""
    return rl_loop.engine_host(cfg, ctx)


def scorer_host(cfg: GRPOConfig, ctx: StageContext):
    """The frozen models' own actor under launch.ray.scorers: own (rlhf/pipeline/ray_launch.py)."""
    return rl_loop.LocalScorers(cfg, ctx)
