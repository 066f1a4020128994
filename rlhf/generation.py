"""Batched greedy generation and verifier accuracy (used to measure SFT against the base model)."""

from __future__ import annotations

import torch

from rlhf.tasks import Problem, Task, user


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int = 16) -> list[str]:
    """Chat-templated, left-padded, KV-cached greedy decoding. prompts: conversations (message lists)."""
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only generation needs the prompt flush against the new tokens
    out: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts[i : i + batch_size]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            gen = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            out += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return out


def verifier_accuracy(model, tokenizer, task: Task, problems: list[Problem], max_new_tokens: int) -> float:
    """Share of problems whose greedy completion the task's verifier scores as fully correct."""
    if not problems:
        return float("nan")
    completions = greedy_completions(model, tokenizer, [[user(p.question)] for p in problems], max_new_tokens)
    return sum(task.score(c, p) >= 1.0 for c, p in zip(completions, problems)) / len(problems)
