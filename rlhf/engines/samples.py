"""What every rollout engine takes and gives: sampling settings and one sampled answer. Apart from the
engines (rlhf/engines/engine.py) and free of torch, so that reading stored answers (the answers cache,
`rlhf leaderboard`) does not import a tensor library."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    max_new_tokens: int = 32
    n: int = 1  # samples per prompt
    seed: int = 0


@dataclass
class Generation:
    prompt_index: int
    sample_index: int
    token_ids: list[int]  # generated tokens only, up to and including EOS
    logprobs: list[float]  # log-prob of each generated token under the sampler's distribution
    text: str
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens reached)
    rewards: dict[str, float] = field(default_factory=dict)  # the RL loop's reward terms for this sample, by name
    # an episode's (rlhf/envs/episodes.py): 1 on the policy's tokens, 0 on the environment's (their logprobs
    # are 0 and no loss term sees them); None: every token is the policy's
    mask: list[int] | None = None
    error: str | None = None  # the environment's failure that ended the episode
