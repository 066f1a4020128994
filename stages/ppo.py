"""PPO for language models (Ziegler et al. 2019; Ouyang et al. 2022): KL-penalised token rewards, a
critic, GAE, clipped policy and value losses, fixed or adaptive KL coefficient. The loop is rlhf/train/rl_loop.py."""

from __future__ import annotations

from rlhf.core.config import PPOConfig
from rlhf.core.stage import StageContext, StageResult
from rlhf.train.rl_loop import run_rl


def run(cfg: PPOConfig, ctx: StageContext) -> StageResult:
    return run_rl("ppo", cfg, ctx)
