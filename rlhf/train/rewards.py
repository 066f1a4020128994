"""Reward sources: the task verifier, a trained reward model, or a user function `module:function`
with TRL's reward-function signature (prompts, completions, **columns) -> list[float]."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from rlhf.engines import prefix


@torch.no_grad()
def reward_model_scores(model, tokenizer, conversations: list[list[dict]], batch_size: int = 16) -> list[float]:
    """Scalar rewards of full conversations (prompt + assistant reply), right-padded batches."""
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "right"
    scores: list[float] = []
    try:
        for start in range(0, len(conversations), batch_size):
            texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations[start : start + batch_size]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out, _ = prefix.forward(model, enc["input_ids"], enc["attention_mask"])  # shared prompt prefix once
            scores += out.logits[:, 0].float().tolist()
    finally:
        tokenizer.padding_side = side
    return scores


def import_reward_function(spec: str) -> Callable:
    """'package.module:function' -> the callable; clear errors for the two ways this goes wrong."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward function {spec!r}: expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward function {spec!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {module_name!r} has no callable {attr!r}")
    return fn



def function_scores(fn: Callable, problems, texts: list[str], completion_ids: list[list[int]]) -> list[float]:
    """A user reward function called with TRL's columns for task problems: one float per completion."""
    out = fn(prompts=[p.question for p in problems], completions=texts, completion_ids=completion_ids,
             answer=[p.answer for p in problems])
    return [float(x) for x in out]


def low_vocab_share(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """The share of response tokens whose id lies in the lower third of the vocabulary (TRL's signature).
    Meaningless as a quality judge; it exists for random-init models (the tiny profile, tests): their
    answers never verify, so every verifier score ties, while this share starts near 1/3 with real
    variance between samples and can be pushed up within seconds: a learning signal on the real code path."""
    return [sum(t < 16384 for t in ids) / max(len(ids), 1) for ids in completion_ids]
