"""PPO for language models (Ziegler et al. 2019; Ouyang et al. 2022): KL-penalised token rewards, a
critic, GAE, clipped policy and value losses, fixed or adaptive KL coefficient. The loop is rlhf/train/rl_loop.py."""

from __future__ import annotations

from rlhf.core.config import PPOConfig
from rlhf.core.stage import StageContext, StageResult
from rlhf.train import rl_loop


def run(cfg: PPOConfig, ctx: StageContext) -> StageResult:
    return rl_loop.run_rl("ppo", cfg, ctx)


def engine_host(cfg: PPOConfig, ctx: StageContext):
    """The rollout engine's own actor under launch.ray.engine: own (rlhf/pipeline/ray_launch.py)."""
    return rl_loop.engine_host(cfg, ctx)


def scorer_host(cfg: PPOConfig, ctx: StageContext):
    """The frozen models' own actor under launch.ray.scorers: own (rlhf/pipeline/ray_launch.py)."""
    return rl_loop.LocalScorers(cfg, ctx)
