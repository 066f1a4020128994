"""Shared-prefix forward passes: the leading tokens that every row of a batch has in common run once.

Every task prompt starts with the same chat-template tokens (SmolLM2's system turn and reasoning-gym's
instruction: 37 of a 48-token chain_sum prompt), and the answers are about 3 tokens, so most of each
forward pass recomputes the same prefix for every row. Here the prefix runs as one row, its KV cache
is copied to every row, and the model continues with the rest of each row: the same logits (and the
same gradients, the prefix's summed over the rows that share it), for a fraction of the compute.
vLLM's automatic prefix caching does this inside its engine; transformers has no batch-level
equivalent, so it is written here, on transformers' own cache (DynamicCache).

Layouts: right-padded batches share their first columns as they are; left-padded prompts share
nothing, so `pad_after_prefix` writes the shared prefix first and pads between it and the rest of each
row (positions count real tokens, as for left padding: the same numbers for a causal model).
"""

from __future__ import annotations

import inspect

import torch


def last_logits_only(model, keep: int) -> dict:
    """Forward kwargs asking for logits of the last `keep` positions only, when the model (or, under PEFT,
    its base model) takes transformers' `logits_to_keep`; else none: full logits, same numbers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"logits_to_keep": keep} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}


def shared_columns(input_ids: torch.Tensor, attention_mask: torch.Tensor, limit: int) -> int:
    """How many leading columns hold the same real token in every row, at most `limit`.
    Hand-worked: rows [5, 6, 7, 1] and [5, 6, 8, 0] with masks [1, 1, 1, 1], [1, 1, 1, 0] -> 2."""
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)
    return min(int(same.int().cumprod(0).sum()), max(limit, 0))


def common_prefix(rows: list[list[int]]) -> int:
    """Length of the token prefix that all rows share, leaving every row at least one token of its own."""
    n = min(len(r) for r in rows) - 1
    for i in range(max(n, 0)):
        if any(r[i] != rows[0][i] for r in rows):
            return i
    return max(n, 0)


def pad_after_prefix(rows: list[list[int]], pad_id: int, share: bool = True) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompts laid out as [shared prefix | padding | rest of the row], all ending in the last column:
    ([N, W] ids, [N, W] attention mask, prefix length). With no shared prefix (or share False) this is
    left padding."""
    c = common_prefix(rows) if share and len(rows) > 1 else 0
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :c], attn[i, :c] = torch.tensor(r[:c], dtype=torch.long), 1
        if len(r) > c:
            ids[i, width - (len(r) - c) :], attn[i, width - (len(r) - c) :] = torch.tensor(r[c:], dtype=torch.long), 1
    return ids, attn, c


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only (padding anywhere in the row): [N, W]."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


def can_share(model) -> bool:
    """A plain module (or PEFT wrapper) on one process: DDP/FSDP expect one forward per backward, and
    gradient checkpointing recomputes blocks without a cache."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) or type(model).__name__.startswith(("FullyShardedDataParallel", "DeepSpeed")):
        return False
    return not any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None,
            keep_from: int | None = None, columns: dict[str, torch.Tensor] | None = None, **kwargs):
    """model(input_ids, attention_mask, position_ids, **columns, **kwargs), with the rows' shared leading
    columns run once. The output covers the columns from the prefix's end on: callers index it from the
    right, and `keep_from` (the first column whose output they read) bounds the prefix. `columns`: other
    per-column inputs ([N, W], e.g. labels), cut like input_ids. Returns (output, prefix length).
    Without position_ids the rows are taken to start at column 0 (right padding)."""
    from transformers import DynamicCache

    columns = columns or {}
    n, width = input_ids.shape
    limit = width - 1 if keep_from is None else keep_from
    c = shared_columns(input_ids, attention_mask, limit) if n > 1 and can_share(model) else 0
    if c > 0:
        pos = position_ids if position_ids is not None else torch.arange(width, device=input_ids.device).expand(n, width)
        head = model(input_ids=input_ids[:1, :c], attention_mask=attention_mask[:1, :c], position_ids=pos[:1, :c],
                     use_cache=True, **last_logits_only(model, 1))
        cache = getattr(head, "cache", None)
        if type(cache) is DynamicCache:  # another cache type (sliding window, state space): no sharing
            cache.batch_repeat_interleave(n)
            rest = {k: v[:, c:] for k, v in columns.items()}
            kwargs = {**kwargs, "use_cache": True}
            out = model(input_ids=input_ids[:, c:], attention_mask=attention_mask, position_ids=pos[:, c:], cache=cache,
                        **rest, **kwargs)
            return out, c
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **columns, **kwargs), 0


FUSED_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


class SharedPrefixModel:
    """A callable stand-in for a model inside a TRL trainer's compute_loss: `model(**inputs)` runs the
    batch's shared prefix once (`forward`). Two output shapes allow it:
    - TRL's fused LM head (`fused_lm_head=True` with labels: SFT, DPO) returns per-token fields for the
      positions with a label; the prefix ends before the first one, and the fields come back zero-padded
      to the full width, as TRL returns them for unlabelled positions;
    - a sequence classifier (the reward model) returns one pooled score per row.
    Anything else runs the plain forward. compute_loss touches nothing else of the model it is given."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, attention_mask=None, labels=None, fused_lm_head=False, **kwargs):
        model = self.model
        if fused_lm_head:
            kwargs["fused_lm_head"] = True
        if attention_mask is None:
            return model(input_ids=input_ids, labels=labels, **kwargs)
        if fused_lm_head and labels is not None:
            scored = (labels[:, 1:] != -100).any(0)  # target columns 1..W-1
            first = int(scored.int().argmax()) + 1 if bool(scored.any()) else input_ids.shape[1] - 1
            # the last prefix column must not predict a label: hidden state j scores the label at j + 1
            out, c = forward(model, input_ids, attention_mask, keep_from=first - 1, columns={"labels": labels}, **kwargs)
            for name in FUSED_FIELDS:
                value = getattr(out, name, None)
                if c and isinstance(value, torch.Tensor) and value.dim() == 2:
                    setattr(out, name, torch.cat([value.new_zeros(value.shape[0], c), value], 1))
            return out
        if type(model).__name__.endswith("ForSequenceClassification"):  # also PEFT's PeftModelForSequenceClassification
            return forward(model, input_ids, attention_mask, labels=labels, **kwargs)[0]
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)


class SharedPrefixLoss:
    """Trainer mixin: compute_loss sees the model through SharedPrefixModel (TRL's SFT, DPO and reward
    trainers: every row of a batch, and a pair's chosen and rejected rows, share the chat template's
    prefix). Equal losses and gradients: tests/test_prefix.py compares each with TRL's own."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        return super().compute_loss(SharedPrefixModel(model), inputs, *args, **kwargs)
