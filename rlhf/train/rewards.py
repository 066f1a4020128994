"""Reward sources: the task verifier, a trained reward model, or a user function `module:function`
with TRL's reward-function signature (prompts, completions, **columns) -> list[float]."""

from __future__ import annotations

import importlib
import math
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



class RewardFunctionError(ValueError):
    """A user reward function that returned something other than one finite number per completion."""


def trl_prompts(problems) -> list:
    """The prompts as TRL's reward functions receive them: the text, or a conversational prompt's messages."""
    return [p.messages() if p.turns else p.question for p in problems]


def function_scores(fn: Callable, problems, texts: list[str], completion_ids: list[list[int]], name: str = "") -> list[float]:
    """A user reward function called with TRL's signature: prompts, completions, completion_ids, and every
    other column of the prompt rows by name (as lists aligned with the completions). Its answer must be
    one finite number per completion."""
    columns: dict[str, list] = {}
    for i, p in enumerate(problems):
        for k, v in p.columns().items():
            columns.setdefault(k, [None] * len(problems))[i] = v
    out = fn(prompts=trl_prompts(problems), completions=texts, completion_ids=completion_ids, **columns)
    what = f"reward function {name or getattr(fn, '__name__', fn)}"
    try:
        values = [float(x) for x in out]
    except (TypeError, ValueError):
        raise RewardFunctionError(f"{what}: must return a list of numbers, one per completion; got "
                                  f"{type(out).__name__}") from None
    if len(values) != len(texts):
        raise RewardFunctionError(f"{what}: returned {len(values)} values for {len(texts)} completions")
    if bad := [i for i, v in enumerate(values) if not math.isfinite(v)]:
        raise RewardFunctionError(f"{what}: returned {values[bad[0]]} for completion {bad[0]}: rewards must be finite")
    return values


def reward_terms(specs, task, rm_scores) -> list[tuple[str, float, Callable]]:
    """(name, weight, score(problems, texts, ids) -> one value per completion) of each reward term
    (rlhf/core/config.py RewardSpec); rm_scores scores conversations with the trained reward model."""
    from rlhf.data.tasks import assistant
    from rlhf.data.verifiers import math_verify

    def column(problems, name: str) -> list[str]:
        missing = [p.id for p in problems if p.columns().get(name) is None]
        if missing:
            raise ValueError(f"reward math_verify: prompt {missing[0]} has no {name!r} column")
        return [str(p.columns()[name]) for p in problems]

    terms = []
    for spec in specs:
        if spec.kind == "verifier":
            score = lambda problems, texts, ids: [task.score(t, p) for p, t in zip(problems, texts)]  # noqa: E731
        elif spec.kind == "math_verify":
            score = lambda problems, texts, ids, c=spec.column: [math_verify(a, t) for a, t in zip(column(problems, c), texts)]  # noqa: E731
        elif spec.kind == "reward_model":
            score = lambda problems, texts, ids: rm_scores([p.messages() + [assistant(t)] for p, t in zip(problems, texts)])  # noqa: E731
        else:
            fn = import_reward_function(spec.function)
            score = lambda problems, texts, ids, fn=fn, f=spec.function: function_scores(fn, problems, texts, ids, f)  # noqa: E731
        terms.append((spec.label(), spec.weight, score))
    return terms


def weighted_rewards(terms, problems, texts: list[str], ids: list[list[int]]) -> tuple[list[float], dict[str, list[float]]]:
    """The reward of each completion, sum_k weight_k x term_k (TRL's reward_weights), and each term's values."""
    parts = {name: score(problems, texts, ids) for name, _, score in terms}
    total = [sum(w * parts[name][i] for name, w, _ in terms) for i in range(len(texts))]
    return total, parts


def low_vocab_share(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """The share of response tokens whose id lies in the lower third of the vocabulary (TRL's signature).
    Meaningless as a quality judge; it exists for random-init models (the tiny profile, tests): their
    answers never verify, so every verifier score ties, while this share starts near 1/3 with real
    variance between samples and can be pushed up within seconds: a learning signal on the real code path."""
    return [sum(t < 16384 for t in ids) / max(len(ids), 1) for ids in completion_ids]
