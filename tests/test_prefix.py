"""Shared-prefix forward passes (rlhf/engines/prefix.py): the prompt prefix that every row shares runs
once, and the logits and gradients equal the plain forward's."""

from __future__ import annotations

import pytest
import torch

from rlhf.core.config import ModelConfig
from rlhf.core.models import load_causal_lm, resolve_model
from rlhf.engines import prefix

TINY = ModelConfig(name="tiny")


def test_layout_helpers_by_hand():
    ids = torch.tensor([[5, 6, 7, 1], [5, 6, 8, 0]])
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    assert prefix.shared_columns(ids, attn, limit=3) == 2
    assert prefix.shared_columns(ids, attn, limit=1) == 1
    assert prefix.shared_columns(ids, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]]), limit=3) == 0  # a pad is no prefix
    # every row keeps one token of its own, even when one row is the others' prefix
    assert prefix.common_prefix([[1, 2, 3], [1, 2, 3, 4], [1, 2, 9]]) == 2
    assert prefix.common_prefix([[1, 2], [1, 2, 3]]) == 1
    assert prefix.common_prefix([[4], [4, 5]]) == 0
    # [prefix | pad | rest]: rows [1, 2, 3, 4] and [1, 2, 9] share [1, 2]; pad 0 goes after the prefix
    ids, attn, c = prefix.pad_after_prefix([[1, 2, 3, 4], [1, 2, 9]], pad_id=0)
    assert c == 2 and ids.tolist() == [[1, 2, 3, 4], [1, 2, 0, 9]] and attn.tolist() == [[1, 1, 1, 1], [1, 1, 0, 1]]
    assert prefix.positions(attn).tolist() == [[0, 1, 2, 3], [0, 1, 1, 2]]
    left, _, c = prefix.pad_after_prefix([[1, 2, 3, 4], [1, 2, 9]], pad_id=0, share=False)
    assert c == 0 and left.tolist() == [[1, 2, 3, 4], [0, 1, 2, 9]]


def rows_with_a_shared_prefix(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(5, 1000, (11,), generator=g).tolist()
    return [head + torch.randint(5, 1000, (n,), generator=g).tolist() for n in (3, 6, 1, 4)]


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", ["right", "after_prefix"])
def test_shared_prefix_forward_equals_the_plain_forward_with_gradients(layout):
    """A causal LM over rows that share 11 leading tokens: the logits of every position past the prefix,
    and the gradients of a loss on them, equal one plain forward (right padding; or the prompt layout
    [prefix | padding | rest] with real-token positions)."""
    rows = rows_with_a_shared_prefix()
    if layout == "right":
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        pos = None
    else:
        ids, attn, c = prefix.pad_after_prefix(rows, pad_id=0)
        assert c == 11
        pos = prefix.positions(attn)
    model = load_causal_lm(resolve_model(TINY), TINY)
    plain = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    (plain[:, -3:] * attn[:, -3:, None]).square().mean().backward()
    want = grads(model)
    model.zero_grad()
    out, c = prefix.forward(model, ids, attn, pos, use_cache=False)
    assert c == 11 and out.logits.shape[1] == ids.shape[1] - 11
    torch.testing.assert_close(out.logits, plain[:, 11:], atol=1e-5, rtol=1e-4)
    (out.logits[:, -3:] * attn[:, -3:, None]).square().mean().backward()
    got = grads(model)
    assert got.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-3)


def test_shared_prefix_forward_bounds_keeps_lora_and_scalar_heads():
    """keep_from bounds the prefix (the caller reads outputs from there on); a LoRA-wrapped policy and a
    sequence classifier (the reward model's pooled score) give the plain forward's numbers."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    rows = rows_with_a_shared_prefix(1)
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    model = load_causal_lm(resolve_model(TINY), TINY)
    with torch.no_grad():
        out, c = prefix.forward(model, ids, attn, keep_from=4)
        assert c == 4
        torch.testing.assert_close(out.logits, model(input_ids=ids, attention_mask=attn).logits[:, 4:], atol=1e-5, rtol=1e-4)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False))
    with torch.no_grad():
        out, c = prefix.forward(lora, ids, attn)
        assert c == 11
        torch.testing.assert_close(out.logits, lora(input_ids=ids, attention_mask=attn).logits[:, 11:], atol=1e-5, rtol=1e-4)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(resolve_model(TINY), num_labels=1)
    rm.config.pad_token_id = 0
    with torch.no_grad():
        out, c = prefix.forward(rm, ids, attn)
        assert c == 11
        torch.testing.assert_close(out.logits, rm(input_ids=ids, attention_mask=attn).logits, atol=1e-5, rtol=1e-4)


def test_no_sharing_where_it_cannot_apply():
    """One row, no common prefix, or gradient checkpointing (blocks recomputed without a cache): the plain
    forward, reported as prefix 0."""
    model = load_causal_lm(resolve_model(TINY), TINY)
    rows = rows_with_a_shared_prefix(2)
    ids = torch.tensor([r[:12] for r in rows])
    attn = torch.ones_like(ids)
    assert prefix.forward(model, ids[:1], attn[:1])[1] == 0
    assert prefix.forward(model, ids[:, 11:], attn[:, 11:])[1] == 0  # the rows' own tokens differ at column 0
    assert prefix.forward(model, ids, attn)[1] == 11
    model.gradient_checkpointing_enable()
    assert not prefix.can_share(model) and prefix.forward(model, ids, attn)[1] == 0


def test_reward_trainer_with_a_shared_prefix_gives_trl_s_loss_and_gradients(tmp_path):
    """stages/reward_model.py's trainer (SharedPrefixLoss over TRL's RewardTrainer) on one collated batch of
    chain_sum pairs: TRL's own loss and gradients, from a forward that ran the shared prefix once."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from rlhf.core.config import DataConfig
    from rlhf.core.models import load_tokenizer
    from rlhf.data.tasks import Task
    from stages.reward_model import SharedPrefixRewardTrainer

    path = resolve_model(TINY)
    tok = load_tokenizer(path)
    rows = Task(DataConfig(train_size=4, eval_size=1)).preference_rows()
    results = []
    for cls in (RewardTrainer, SharedPrefixRewardTrainer):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
        model.config.pad_token_id = tok.pad_token_id
        trainer = cls(model=model, args=RewardConfig(output_dir=str(tmp_path / cls.__name__), report_to=[], max_length=128,
                                                   use_cpu=True, bf16=False),
                      train_dataset=Dataset.from_list(rows), processing_class=tok)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        calls = []
        hook = model.model.embed_tokens.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape))
        loss = trainer.compute_loss(model, dict(batch))
        hook.remove()
        loss.backward()
        results.append((loss.detach(), grads(model), calls))
    (trl_loss, trl_grads, trl_calls), (ours_loss, ours_grads, ours_calls) = results
    assert len(trl_calls) == 1 and len(ours_calls) == 2 and ours_calls[0][0] == 1  # the prefix as one row, then the rest
    torch.testing.assert_close(ours_loss, trl_loss, atol=1e-6, rtol=1e-5)
    for name in trl_grads:
        torch.testing.assert_close(ours_grads[name], trl_grads[name], atol=1e-6, rtol=1e-3)


def test_sft_trainer_with_a_shared_prefix_gives_trl_s_loss_and_gradients(tmp_path):
    """stages/sft.py's trainer on one collated batch of chain_sum demonstrations: the loss, the gradients
    and the logged token metrics of TRL's own forward (fused LM head, completion-only labels), with the
    shared prefix run once and the fused head's per-token fields padded back to the full width."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from rlhf.core.config import DataConfig
    from rlhf.core.models import load_tokenizer
    from rlhf.data.tasks import Task
    from rlhf.engines.logprobs import CompletionOnlyScoring
    from stages.sft import CompletionScoredSFTTrainer

    class Plain(CompletionOnlyScoring, SFTTrainer):
        pass

    path = resolve_model(TINY)
    tok = load_tokenizer(path)
    rows = Task(DataConfig(train_size=6, eval_size=1)).sft_rows()
    results = []
    for cls in (Plain, CompletionScoredSFTTrainer):
        model = load_causal_lm(path, TINY, trained=True)
        trainer = cls(model=model, args=SFTConfig(output_dir=str(tmp_path / cls.__name__), report_to=[], max_length=128,
                                                  use_cpu=True, bf16=False, completion_only_loss=True),
                      train_dataset=Dataset.from_list(rows), processing_class=tok)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(6)])
        calls = []
        hook = model.model.embed_tokens.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, dict(batch))
        hook.remove()
        assert calls == ([6] if cls is Plain else [1, 6])  # ours: the prefix as one row, then the rest
        loss.backward()
        logged = trainer._metrics["train" if model.training else "eval"]
        metrics = {k: v[-1] for k, v in logged.items() if k in ("entropy", "mean_token_accuracy")}
        results.append((loss.detach(), grads(model), metrics))
    (trl_loss, trl_grads, trl_metrics), (ours_loss, ours_grads, ours_metrics) = results
    torch.testing.assert_close(ours_loss, trl_loss, atol=1e-6, rtol=1e-5)
    assert ours_metrics.keys() == trl_metrics.keys() == {"entropy", "mean_token_accuracy"}
    for k in trl_metrics:
        assert ours_metrics[k] == pytest.approx(trl_metrics[k], rel=1e-4, abs=1e-6)
    for name in trl_grads:
        torch.testing.assert_close(ours_grads[name], trl_grads[name], atol=1e-6, rtol=1e-3)
