"""Reference log-probs of preference completions, computed exactly as TRL's DPOTrainer sees them.

The cached numbers must equal what DPOTrainer would compute on the fly, so tokenisation mirrors
TRL 1.16's `DPOTrainer._prepare_dataset` (chat template; the completion starts where prompt and
prompt+completion token ids diverge) and batching uses TRL's own `DataCollatorForPreference`.
tests/test_ref_cache.py checks both against TRL, so a TRL upgrade that changes either fails loudly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import trl.trainer.utils as trl_utils
from trl.data_utils import common_prefix_length, extract_prompt, is_conversational
from trl.trainer.dpo_trainer import DataCollatorForPreference

from rlhf.engines.engine import chat_ids
from rlhf.engines import prefix
from rlhf.engines.prefix import last_logits_only


@contextlib.contextmanager
def completion_only_scoring():
    """Make TRL's fused LM head project only the scored (label != -100) positions on the CPU too.

    TRL 1.16's fused head (`add_fused_lm_head`) gathers the completion positions before the vocabulary
    projection on CUDA/XPU, but on every other device projects every position and masks afterwards, so
    compiled backends (Neuron) keep fixed tile shapes. On an eager CPU that spends the 49k-way projection,
    softmax and entropy on prompt tokens whose scores are thrown away: about 90% of the rows for the
    arithmetic pairs (48 prompt tokens, 5 completion tokens). The decision is TRL's private
    `trl.trainer.utils._use_triton` (used there for nothing else); it is swapped for the CPU only, for the
    duration, and restored. The numbers are the same rows of the same projection (tests/test_dpo.py).
    """
    original = trl_utils._use_triton
    trl_utils._use_triton = lambda device: device.type == "cpu" or original(device)
    try:
        yield
    finally:
        trl_utils._use_triton = original


class CompletionOnlyScoring:
    """Trainer mixin: every loss computation (training and evaluation) runs under completion_only_scoring."""

    def compute_loss_context_manager(self):
        stack = super().compute_loss_context_manager()
        stack.enter_context(completion_only_scoring())
        return stack


@dataclass(frozen=True)
class TokenizedPair:
    pair_id: str
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


def _ids(tokenizer, value, generation_prompt: bool = False) -> list[int]:
    if isinstance(value, list):
        return chat_ids(tokenizer, value, generation_prompt)
    return list(tokenizer(text=value)["input_ids"])


def tokenize_pair(tokenizer, row: dict) -> TokenizedPair:
    """Token ids of one preference row, as TRL's DPOTrainer tokenises it (plain or conversational)."""
    if "prompt" not in row:
        row = {**row, **extract_prompt({"chosen": row["chosen"], "rejected": row["rejected"]})}
    if is_conversational(row):
        prompt = _ids(tokenizer, row["prompt"], generation_prompt=True)
        full_c = _ids(tokenizer, row["prompt"] + row["chosen"])
        full_r = _ids(tokenizer, row["prompt"] + row["rejected"])
    else:
        eos = tokenizer.eos_token
        chosen = row["chosen"] if row["chosen"].endswith(eos) else row["chosen"] + eos
        rejected = row["rejected"] if row["rejected"].endswith(eos) else row["rejected"] + eos
        prompt = _ids(tokenizer, row["prompt"])
        full_c, full_r = _ids(tokenizer, row["prompt"] + chosen), _ids(tokenizer, row["prompt"] + rejected)
    n = min(common_prefix_length(prompt, full_c), common_prefix_length(prompt, full_r))
    return TokenizedPair(row.get("pair_id", ""), prompt[:n], full_c[n:], full_r[n:])


def length_problem(pair: TokenizedPair, max_length: int) -> str | None:
    """Over-long pairs would be silently truncated by the collator (keep_start): report them instead."""
    if not pair.chosen_ids or not pair.rejected_ids:
        return "a completion is empty after tokenisation"
    longest = len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids))
    if longest > max_length:
        return f"prompt + completion is {longest} tokens, over max_length {max_length}"
    return None


@dataclass
class PairLogps:
    """Summed completion log-probs per pair. Shapes: [B]; per-token lists only when asked for."""

    chosen: torch.Tensor  # [B] float64
    rejected: torch.Tensor  # [B] float64
    chosen_tokens: torch.Tensor  # [B] int
    rejected_tokens: torch.Tensor  # [B] int
    chosen_per_token: list[list[float]] | None = None
    rejected_per_token: list[list[float]] | None = None


def completion_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor):
    """Per-token log-probs of the completion tokens. Returns ([N, T-1] log-probs * mask, [N, T-1] mask).

    input_ids, attention_mask, completion_mask: [N, T], right-padded (TRL's collator layout).
    Token t is scored by the logits at t-1, so position 0 (always prompt) is never scored. Logits are
    computed only from the batch's first scored position on (the model's own `logits_to_keep`): the prompt
    rows before it would be projected onto the vocabulary just to be masked out.
    """
    n, width = input_ids.shape
    scored = completion_mask[:, 1:].bool()
    first = int(scored.any(0).int().argmax()) if bool(scored.any()) else width - 2  # index into the T-1 targets
    kw = last_logits_only(model, width - first)
    # the rows' shared prompt prefix (chat template, instruction) runs once: rlhf/engines/prefix.py
    logits = prefix.forward(model, input_ids, attention_mask, keep_from=first, use_cache=False, **kw)[0].logits
    logits = logits[:, -(width - first) : -1].float()  # predictions for targets first..T-2
    logp = input_ids.new_zeros((n, width - 1), dtype=logits.dtype)
    logp[:, first:] = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, first + 1 :].unsqueeze(-1)).squeeze(-1)
    mask = scored.to(logp.dtype)
    return logp * mask, mask


def sequence_logps(model, token_ids: list[int]) -> list[float]:
    """log p(token t | tokens < t) for t >= 1 of one sequence (what an engine reports as prompt log-probs)."""
    ids = torch.tensor([token_ids], device=model.device)
    ones = torch.ones_like(ids)
    return completion_logps(model, ids, ones, ones)[0][0].tolist()


@torch.no_grad()
def pair_logps(model, tokenizer, pairs: list[TokenizedPair], max_length: int, batch_size: int, per_token: bool = False,
               on_batch=None) -> PairLogps:
    """Batched, gradient-free, padding-aware reference pass over all pairs, in order."""
    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=max_length)
    model.eval()
    chosen, rejected, n_c, n_r, tok_c, tok_r = [], [], [], [], [], []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        batch = collator([{"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids, "rejected_ids": p.rejected_ids} for p in chunk])
        batch = {k: v.to(model.device) for k, v in batch.items()}
        logp, mask = completion_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        sums, counts = logp.sum(dim=1).double().cpu(), mask.sum(dim=1).long().cpu()
        b = len(chunk)
        chosen.append(sums[:b]), rejected.append(sums[b:]), n_c.append(counts[:b]), n_r.append(counts[b:])
        if per_token:
            for i in range(2 * b):
                row = logp[i][mask[i].bool()].tolist()
                (tok_c if i < b else tok_r).append(row)
        if on_batch is not None:
            on_batch(start + b, int(batch["attention_mask"].sum()))
    return PairLogps(
        torch.cat(chosen), torch.cat(rejected), torch.cat(n_c), torch.cat(n_r),
        tok_c if per_token else None, tok_r if per_token else None,
    )


@torch.no_grad()
def response_logps(model, prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
                   batch_size: int = 16) -> list[list[float]]:
    """Per-token log-probs of each response given its prompt (ragged lists out, one per response).

    Right-padded batches: position t of a response is scored by the logits at the token before it.
    """
    out: list[list[float]] = []
    model.eval()
    for start in range(0, len(prompt_ids), batch_size):
        ps, rs = prompt_ids[start : start + batch_size], response_ids[start : start + batch_size]
        width = max(len(p) + len(r) for p, r in zip(ps, rs))
        ids = torch.full((len(ps), width), pad_id, dtype=torch.long)
        attn, comp = torch.zeros_like(ids), torch.zeros_like(ids)
        for i, (p, r) in enumerate(zip(ps, rs)):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            attn[i, : len(p) + len(r)] = 1
            comp[i, len(p) : len(p) + len(r)] = 1
        dev = model.device
        logp, mask = completion_logps(model, ids.to(dev), attn.to(dev), comp.to(dev))
        for i, (p, r) in enumerate(zip(ps, rs)):
            out.append(logp[i, len(p) - 1 : len(p) - 1 + len(r)].tolist())
    return out
