"""Held-out verifier accuracy of a policy: greedy answers through the rollout engine, scored by the task."""

from __future__ import annotations

from rlhf.engines.engine import HFEngine, SamplingParams
from rlhf.data.tasks import Problem
from rlhf.data.sources import PromptSource


def verifier_accuracy(model, tokenizer, task: PromptSource, problems: list[Problem], max_new_tokens: int, batch_size: int = 16) -> float:
    """Share of problems whose greedy completion the task's verifier scores as fully correct."""
    if not problems:
        return float("nan")
    gens = HFEngine(model, tokenizer, batch_size).generate(
        [p.messages() for p in problems], SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    )
    return sum(task.score(g.text, problems[g.prompt_index]) >= 1.0 for g in gens) / len(problems)
