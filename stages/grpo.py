"""GRPO (Shao et al. 2024): G samples per prompt, group-normalised advantages, no critic, k3 KL penalty
in the loss, clip (and clip-higher) with optional dual clip. The loop is rlhf/train/rl_loop.py."""

from __future__ import annotations

from rlhf.core.config import GRPOConfig
from rlhf.core.stage import StageContext, StageResult
from rlhf.train.rl_loop import run_rl


def run(cfg: GRPOConfig, ctx: StageContext) -> StageResult:
    return run_rl("grpo", cfg, ctx)
