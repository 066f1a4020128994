"""DPO from the cache: no reference model is ever built, TRL's loss equals our reference function,
and the policy moves toward the chosen answers."""

from __future__ import annotations

import pytest
import torch
import trl.trainer.dpo_trainer as trl_dpo
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import DPOConfig

from rlhf.core.config import ModelConfig
from rlhf.engines.logprobs import pair_logps, tokenize_pair
from rlhf.maths.losses import dpo_loss
from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model
from conftest import only
from rlhf.pipeline.runner import execute_stage
from rlhf.train.dpo_trainer import CachedRefDPOTrainer
from test_ref_cache import CONV
from test_sft_rm import separable_pairs


def test_dpo_stage_never_builds_a_reference_model(tiny_cfg, monkeypatch, tmp_path):
    prefs = separable_pairs(tmp_path / "prefs.jsonl", 64)  # 'yes ...' beats 'no ...': learnable in a few steps
    cfg = tiny_cfg(f"data.prefs_path={prefs}", *only("sft", "ref_logprobs", "dpo"), "dpo.max_steps=12", "dpo.learning_rate=2e-3")
    for stage in ("sft", "ref_logprobs"):
        execute_stage(cfg, stage)

    def refuse(*a, **kw):
        raise AssertionError("DPOTrainer tried to build a reference model")

    loads = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def counting(cls, *a, **kw):
        loads.append(a[0] if a else kw.get("pretrained_model_name_or_path"))
        return real(cls, *a, **kw)

    monkeypatch.setattr(trl_dpo, "create_model_from_path", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(counting))
    m = execute_stage(cfg, "dpo")
    assert len(loads) == 1  # the policy; nothing else
    assert m["rows"] == {"train_pairs": 64, "without_reference": 0}
    assert m["inputs"].keys() == {"sft", "ref_logprobs"}
    assert m["metrics"]["dpo/rewards/margins"] > 0  # chosen answers gained on rejected ones


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_trl_loss_equals_reference_function(tmp_path, loss_type):
    path = resolve_model(ModelConfig(name="tiny"))
    tok = load_tokenizer(path)
    model = load_causal_lm(path, ModelConfig(name="tiny"))
    pairs = [tokenize_pair(tok, r) for r in CONV]
    policy = pair_logps(model, tok, pairs, max_length=64, batch_size=8)
    # A reference that differs from the policy, so the loss is not simply log 2.
    g = torch.Generator().manual_seed(0)
    ref_c = policy.chosen - torch.rand(len(pairs), generator=g, dtype=torch.float64)
    ref_r = policy.rejected + torch.rand(len(pairs), generator=g, dtype=torch.float64)
    rows = [{**r, "ref_chosen_logps": c, "ref_rejected_logps": j} for r, c, j in zip(CONV, ref_c.tolist(), ref_r.tolist())]
    args = DPOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, max_length=64, beta=0.1,
                     loss_type=[loss_type], report_to=[], use_cpu=True, bf16=False, activation_checkpointing=False)
    trainer = CachedRefDPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    assert trainer.ref_model is None
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    model.eval()
    with torch.no_grad():
        trl_loss = trainer.compute_loss(model, batch)
    ours, _ = dpo_loss(policy.chosen, policy.rejected, ref_c, ref_r, beta=0.1, loss_type=loss_type,
                       chosen_tokens=policy.chosen_tokens, rejected_tokens=policy.rejected_tokens)
    assert trl_loss.item() == pytest.approx(ours.mean().item(), rel=1e-4)


def test_nll_weight_adds_the_chosen_answers_mean_nll(tmp_path):
    """dpo.nll_weight (RPO, Pang et al. 2024, eq. 3): TRL's ['sigmoid', 'sft'] with weights [1, alpha] is
    the DPO loss plus alpha x the mean negative log-likelihood per chosen completion token."""
    path = resolve_model(ModelConfig(name="tiny"))
    tok = load_tokenizer(path)
    model = load_causal_lm(path, ModelConfig(name="tiny"))
    pairs = [tokenize_pair(tok, r) for r in CONV]
    policy = pair_logps(model, tok, pairs, max_length=64, batch_size=8)
    ref_c, ref_r = policy.chosen - 0.5, policy.rejected + 0.25
    rows = [{**r, "ref_chosen_logps": c, "ref_rejected_logps": j} for r, c, j in zip(CONV, ref_c.tolist(), ref_r.tolist())]
    args = DPOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, max_length=64, beta=0.1,
                     loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], report_to=[], use_cpu=True, bf16=False,
                     activation_checkpointing=False)
    trainer = CachedRefDPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    model.eval()
    with torch.no_grad():
        trl_loss = trainer.compute_loss(model, batch)
    dpo, _ = dpo_loss(policy.chosen, policy.rejected, ref_c, ref_r, beta=0.1, loss_type="sigmoid")
    nll = -policy.chosen.sum() / policy.chosen_tokens.sum()
    assert trl_loss.item() == pytest.approx(dpo.mean().item() + 0.5 * nll.item(), rel=1e-4)


def test_trainer_refuses_an_on_the_fly_reference_pass(tmp_path):
    path = resolve_model(ModelConfig(name="tiny"))
    tok = load_tokenizer(path)
    args = DPOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, max_length=64, report_to=[],
                     use_cpu=True, bf16=False, activation_checkpointing=False)
    with pytest.raises(ValueError, match="lacks cached reference columns"):
        CachedRefDPOTrainer(model=load_causal_lm(path, ModelConfig(name="tiny")), args=args,
                            train_dataset=Dataset.from_list(CONV), processing_class=tok)


def test_completion_only_scoring_changes_no_number_and_projects_only_completions(tmp_path, monkeypatch):
    """The DPO stage's trainer scores completion positions only on the CPU (TRL scores every position
    there and masks) and runs the batch's shared prompt prefix once: same loss and same gradients as TRL's
    own forward and scoring, far fewer projected rows."""
    import trl.trainer.utils as trl_utils

    path = resolve_model(ModelConfig(name="tiny"))
    tok = load_tokenizer(path)
    rows = [{**r, "ref_chosen_logps": -3.0, "ref_rejected_logps": -4.0} for r in CONV]
    args = DPOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, max_length=64, beta=0.1,
                     report_to=[], use_cpu=True, bf16=False, activation_checkpointing=False)
    projected = []
    real_apply = trl_utils._ChunkedLogProbFunction.apply
    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply",
                        lambda hidden, *a: projected.append(hidden.shape[0]) or real_apply(hidden, *a))

    def loss_and_grads(trainer_cls):
        model = load_causal_lm(path, ModelConfig(name="tiny"))
        trainer = trainer_cls(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
        model.eval()
        rows_in = []
        hook = model.model.embed_tokens.register_forward_hook(lambda mod, inp, out: rows_in.append(inp[0].shape[0]))
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, batch)
        hook.remove()
        assert rows_in == ([len(rows) * 2] if trainer_cls is AllPositions else [1, len(rows) * 2])  # ours: prefix once
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}, batch

    class AllPositions(CachedRefDPOTrainer):  # TRL's CPU behaviour: every position through the vocabulary
        def compute_loss_context_manager(self):
            return trl_dpo.DPOTrainer.compute_loss_context_manager(self)

        def compute_loss(self, model, inputs, *args, **kwargs):  # and TRL's whole-row forward (no shared prefix)
            return trl_dpo.DPOTrainer.compute_loss(self, model, inputs, *args, **kwargs)

    theirs, their_grads, batch = loss_and_grads(AllPositions)
    ours, our_grads, _ = loss_and_grads(CachedRefDPOTrainer)
    assert ours == pytest.approx(theirs, abs=1e-6)
    for name, g in their_grads.items():
        torch.testing.assert_close(our_grads[name], g, atol=1e-6, rtol=1e-5)
    n, width = batch["input_ids"].shape
    assert projected == [n * (width - 1), int(batch["completion_mask"][:, 1:].sum())]
    assert projected[1] < projected[0] / 3
    assert trl_utils._use_triton(torch.device("cpu")) is False  # the switch is put back after each step
