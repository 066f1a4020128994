"""GRPO (Shao et al. 2024): G samples per prompt, group-normalised advantages, no critic, k3 KL penalty
in the loss, clip (and clip-higher) with optional dual clip. The loop is stages/rl.py."""

from __future__ import annotations

from rlhf.config import GRPOConfig
from rlhf.runner import StageContext, StageResult
from stages.rl import run_rl


def run(cfg: GRPOConfig, ctx: StageContext) -> StageResult:
    return run_rl("grpo", cfg, ctx)
