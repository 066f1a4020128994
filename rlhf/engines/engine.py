"""Rollout engines behind one small interface: token ids, sampler log-probs and finish reasons.

`HFEngine` wraps transformers' `generate` (batched, left-padded, KV cache). A vLLM engine can implement
the same `Engine` protocol; callers never see which one runs.
"""

from __future__ import annotations

from typing import Protocol

import torch

from rlhf.engines import prefix
from rlhf.engines.samples import Generation, SamplingParams  # torch-free, apart: stored answers are read without torch


def turn_end(tokenizer, toks: list[int], logps: list[float], stop: tuple[str, ...]) -> tuple[list[int], list[float], str]:
    """Where a generated turn ends, whichever engine sampled it: a stop string first ('tool': the shortest
    prefix whose text holds one; rows that stopped are padded after it, and the pad token may be the EOS
    token), then EOS ('stop', kept), else the budget ('length')."""
    eos = tokenizer.eos_token_id
    end = toks.index(eos) + 1 if eos in toks else len(toks)
    if stop:
        for k in range(1, end + 1):
            if any(s in tokenizer.decode(toks[:k]) for s in stop):
                return toks[:k], logps[:k], "tool"
    return toks[:end], logps[:end], "stop" if eos in toks[:end] else "length"


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation under the tokenizer's chat template; with generation_prompt the
    assistant turn is opened (what an engine continues from)."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                              return_dict=True)["input_ids"])


class Engine(Protocol):
    """What the RL loop samples through. `sync` brings the engine's weights to the policy's after an
    update (None when the engine shares the policy's weights: nothing to do); `close` frees it."""

    def generate(self, prompts: list[list[dict]], params: SamplingParams, shard: tuple[int, int] = (0, 1),
                 on_batch=None) -> list[Generation]: ...

    def sync(self, policy) -> float | None: ...

    def close(self) -> None: ...


class HFEngine:
    """`share_prompts`: the prefill runs each distinct prompt of a batch once, and the prefix that all of
    them share (the chat template's system turn, the task's instruction) once for the batch; the KV cache
    is copied to every sample (rlhf/engines/prefix.py; vLLM's prefix caching does the same). Same logits,
    hence the same samples: for 8 samples of a 48-token prompt and a 3-token answer the prefill was most
    of the time."""

    def __init__(self, model, tokenizer, batch_size: int = 16, share_prompts: bool = True):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.share_prompts = share_prompts

    def sync(self, policy) -> None:
        """Nothing to sync: this engine generates with the policy module itself."""

    def close(self) -> None:
        """Nothing to free: the model belongs to the caller."""

    @torch.no_grad()
    def generate(self, prompts: list[list[dict]], params: SamplingParams, shard: tuple[int, int] = (0, 1),
                 on_batch=None) -> list[Generation]:
        """Generations ordered by (prompt, sample). Batches are seeded by (seed, batch index), so the same
        params reproduce the same samples whatever ran before, and torch's RNG is left as it was.
        `shard=(rank, world)` generates only the batches b with b % world == rank, each with its one-process
        seed: the union over ranks is exactly the one-process output."""
        tok, model = self.tokenizer, self.model
        was_training, side = model.training, tok.padding_side
        model.eval()
        tok.padding_side = "left"  # new tokens must follow the prompt directly
        jobs = [(i, s) for i in range(len(prompts)) for s in range(params.n)]
        out: list[Generation] = []
        # Batches are seeded through torch's global generator (HF's sampler draws from it), inside a fork of
        # it: what the caller draws next (LoRA adapters, a value head) does not depend on having sampled.
        with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
            try:
                for b, start in enumerate(range(0, len(jobs), self.batch_size)):
                    if b % shard[1] == shard[0]:
                        out += self._batch(prompts, jobs[start : start + self.batch_size], params, b)
                        if on_batch is not None:
                            on_batch(min(start + self.batch_size, len(jobs)), len(jobs))
            finally:
                tok.padding_side = side
                model.train(was_training)
        return out

    def _batch(self, prompts: list[list[dict]], chunk: list[tuple[int, int]], params: SamplingParams, b: int) -> list[Generation]:
        """Batch b: the (prompt, sample) jobs of `chunk`, its distinct prompts prefilled once."""
        tok, model = self.tokenizer, self.model
        unique = list(dict.fromkeys(i for i, _ in chunk))
        texts = [tok.apply_chat_template(prompts[i], tokenize=False, add_generation_prompt=True) for i in unique]
        ids, attn, _ = prefix.pad_after_prefix(tok(texts, add_special_tokens=False)["input_ids"], tok.pad_token_id,
                                               share=self.share_prompts)
        ids, attn = ids.to(model.device), attn.to(model.device)
        rows = torch.tensor([unique.index(i) for i, _ in chunk], device=model.device)
        enc = {"input_ids": ids[rows], "attention_mask": attn[rows]}
        if (cache := self._prefill(ids, attn)) is not None:
            cache.batch_select_indices(rows)
            enc["cache"] = cache
        torch.manual_seed(params.seed * 1_000_003 + b)
        greedy = params.temperature == 0
        gen = model.generate(
            **enc,
            max_new_tokens=params.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new = gen.sequences[:, enc["input_ids"].shape[1] :]
        # scores are the processed logits the sampler drew from (after temperature / top-p)
        logp = torch.stack(gen.scores, dim=1).float().log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        out = []
        for row, (i, s) in enumerate(chunk):
            toks = new[row].tolist()
            n = toks.index(tok.eos_token_id) + 1 if tok.eos_token_id in toks else len(toks)
            out.append(Generation(
                i, s, toks[:n], logp[row, :n].tolist(),
                tok.decode(toks[:n], skip_special_tokens=True),
                "stop" if n < len(toks) or (toks and toks[n - 1] == tok.eos_token_id) else "length",
            ))
        return out

    @torch.no_grad()
    def continue_ids(self, seqs: list[list[int]], params: SamplingParams, stop: tuple[str, ...], seed: int
                     ) -> list[tuple[list[int], list[float], str]]:
        """One more turn of each token sequence (an episode's transcript so far): (tokens, their sampler
        log-probs, why it ended): 'stop' at the end-of-sequence token (kept), 'tool' at the end of one of
        `stop` (the environment's turn), 'length' at params.max_new_tokens. Batch b is seeded by
        (seed, b), inside a fork of torch's RNG."""
        tok, model = self.tokenizer, self.model
        was_training, out = model.training, []
        model.eval()
        with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
            try:
                for b, start in enumerate(range(0, len(seqs), self.batch_size)):
                    chunk = seqs[start : start + self.batch_size]
                    width = max(len(s) for s in chunk)
                    ids = torch.tensor([[tok.pad_token_id] * (width - len(s)) + s for s in chunk], device=model.device)
                    attn = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in chunk], device=model.device)
                    torch.manual_seed(seed * 1_000_003 + b)
                    greedy = params.temperature == 0
                    gen = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=params.max_new_tokens,
                                         do_sample=not greedy, temperature=None if greedy else params.temperature,
                                         top_p=None if greedy else params.top_p, top_k=None,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                         stop_strings=list(stop) or None, tokenizer=tok if stop else None,
                                         output_scores=True, return_dict_in_generate=True)
                    new = gen.sequences[:, width:]
                    logp = torch.stack(gen.scores, 1).float().log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
                    out += [turn_end(tok, new[r].tolist(), logp[r].tolist(), stop) for r in range(len(chunk))]
            finally:
                model.train(was_training)
        return out

    def _prefill(self, ids: torch.Tensor, attn: torch.Tensor):
        """KV cache of the distinct prompts ([U, W], laid out by prefix.pad_after_prefix) but their last
        token, with their shared prefix run once; `generate` then runs only the last prompt token of each
        sample. None where sharing is off or does not apply (a one-token prompt, another cache type)."""
        from transformers import DynamicCache

        if not self.share_prompts or ids.shape[1] < 2:
            return None
        out, _ = prefix.forward(self.model, ids[:, :-1], attn[:, :-1], prefix.positions(attn)[:, :-1], use_cache=True,
                                **prefix.last_logits_only(self.model, 1))
        cache = getattr(out, "cache", None)
        return cache if type(cache) is DynamicCache else None
