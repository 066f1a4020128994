"""Reward functions for tests, in TRL's signature (prompts, completions, **columns) -> list[float].

A random-init tiny model gives every token about the same probability, so a reward on one specific
token would almost never fire. The share of response tokens whose id lies in the lower third of the
vocabulary starts near 1/3 and can be pushed up within seconds: a real learning signal for tests.
"""

from rlhf.train.rewards import low_vocab_share  # noqa: F401  (the tests name it as reward_fns:low_vocab_share)


def brevity(prompts, completions, completion_ids, **kwargs):
    """1 for an empty reply, 0 for one that hits the 8-token limit: rewards stopping early (EOS)."""
    return [1.0 - min(len(ids), 8) / 8 for ids in completion_ids]


def nan_after_first(prompts, completions, **kwargs):
    """A broken reward: NaN for every sample (drives the NaN guard)."""
    return [float("nan")] * len(completions)


def uniform_on_sums(prompts, completions, completion_ids, **kwargs):
    """0.5 for every answer to an addition problem (its GRPO group is uniform), else low_vocab_share."""
    shares = low_vocab_share(prompts, completions, completion_ids)
    return [0.5 if "+" in p else s for p, s in zip(prompts, shares)]


def constant(prompts, completions, **kwargs):
    """The same reward for every answer: every GRPO group is uniform (nothing to learn)."""
    return [1.0] * len(completions)
