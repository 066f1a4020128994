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
    """A broken reward: NaN for every sample (refused, naming the function)."""
    return [float("nan")] * len(completions)


def uniform_on_sums(prompts, completions, completion_ids, **kwargs):
    """0.5 for every answer to an addition problem (its GRPO group is uniform), else low_vocab_share."""
    shares = low_vocab_share(prompts, completions, completion_ids)
    return [0.5 if "+" in p else s for p, s in zip(prompts, shares)]


def constant(prompts, completions, **kwargs):
    """The same reward for every answer: every GRPO group is uniform (nothing to learn)."""
    return [1.0] * len(completions)


def target_scaled(prompts, completions, completion_ids, target, **kwargs):
    """The row's `target` column over 100, whatever the completion: proves the column reaches the function
    by name, aligned with each completion."""
    return [float(t) / 100 for t in target]


def long_answers(prompts, completions, completion_ids, **kwargs):
    """The answer's length in tokens over 8: a judge that only likes length (for open-ended prompts)."""
    return [min(len(ids), 8) / 8 for ids in completion_ids]


def wrong_length(prompts, completions, **kwargs):
    """One reward for any number of completions: refused."""
    return [0.0]


def needs_gold(prompts, completions, gold, **kwargs):
    """Reads a `gold` column the prompts do not have (its probe call fails)."""
    return [float(g) for g in gold]
