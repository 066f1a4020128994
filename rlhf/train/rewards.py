"""Reward sources: the task verifier, a trained reward model, or a user function `module:function`
with TRL's reward-function signature (prompts, completions, **columns) -> list[float]."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from trl.data_utils import common_prefix_length

from rlhf.engines import prefix
from rlhf.engines.engine import chat_ids
from rlhf.engines.logprobs import response_logps


def load_reward_model(path: str, dtype: str):
    """(model, tokenizer) of a reward-model folder, told apart by its config's architectures: a sequence
    classifier (a scalar head, reward_model.kind: classifier) or a causal LM (reward_model.kind: implicit).
    Anything else is refused: loading it as a classifier would add a random head and score noise."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf.core.models import load_tokenizer, torch_dtype

    archs = AutoConfig.from_pretrained(path).architectures or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        cls = AutoModelForSequenceClassification
    elif any(a.endswith("ForCausalLM") for a in archs):
        cls = AutoModelForCausalLM
    else:
        raise ValueError(f"reward model {path}: config.json names architectures {archs}, neither a sequence "
                         "classifier (a scalar reward head) nor a causal LM (an implicit reward model)")
    return cls.from_pretrained(path, dtype=torch_dtype(dtype)), load_tokenizer(path)


def is_classifier(model) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")  # also PEFT's PeftModelForSequenceClassification


@torch.no_grad()
def reward_model_scores(model, tokenizer, conversations: list[list[dict]], batch_size: int = 16) -> list[float]:
    """Rewards of full conversations (prompt + assistant reply): a classifier's scalar head, or for an
    implicit reward model (a causal LM) the summed log-probs of the reply's tokens given the prompt."""
    if not is_classifier(model):
        return implicit_rewards(model, tokenizer, conversations, batch_size)
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


def implicit_rewards(model, tokenizer, conversations: list[list[dict]], batch_size: int = 16) -> list[float]:
    """r(x, y) = sum_t log pi(y_t | x, y_<t) over the reply's tokens, tokenised as DPO's trainer does (the
    reply starts where the prompt's ids with the assistant turn opened and the whole conversation's part):
    the quantity the implicit reward model was fit on. Rafailov et al. 2023, sec. 5, with no reference."""
    prompts, replies = [], []
    for c in conversations:
        opened = chat_ids(tokenizer, c[:-1], generation_prompt=True)
        full = chat_ids(tokenizer, c, generation_prompt=False)
        n = common_prefix_length(opened, full)
        prompts.append(full[:n])
        replies.append(full[n:])
    return [float(sum(lp)) for lp in response_logps(model, prompts, replies, tokenizer.pad_token_id, batch_size)]


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
