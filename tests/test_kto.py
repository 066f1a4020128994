"""KTO from the reference cache: the loss by hand, TRL's loss equals ours, cached reference numbers equal an
independent forward, a second run does zero reference passes, no reference model is ever built, and bad
unpaired rows are named."""

from __future__ import annotations

import json

import pytest
import torch
import trl.trainer.kto_trainer as trl_kto
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import KTOConfig

from conftest import only
from rlhf.core.config import ModelConfig
from rlhf.engines.logprobs import completion_logps
from rlhf.maths.losses import kto_loss
from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model
from rlhf.pipeline.runner import execute_stage
from rlhf.data.userdata import DataError
from stages.kto import CachedRefKTOTrainer

T = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731


def test_kto_loss_by_hand():
    # r = -0.2 (desirable) and -1.4 (undesirable); beta 0.1; z0 = 0
    loss = kto_loss(T(-1.2, -2.5), T(-1.0, -1.1), torch.tensor([True, False]), 0.0, beta=0.1)
    assert loss.tolist() == pytest.approx([0.505000, 0.465057], abs=1e-6)
    assert loss.mean().item() == pytest.approx(0.485028, abs=1e-6)
    # z0 = 0.5: desirable 1 - sigmoid(0.1 * (-0.7)) = 0.517493; undesirable 1 - sigmoid(0.1 * 1.9) = 0.452642
    loss = kto_loss(T(-1.2, -2.5), T(-1.0, -1.1), torch.tensor([True, False]), 0.5, beta=0.1)
    assert loss.tolist() == pytest.approx([0.517493, 0.452642], abs=1e-6)
    # a negative KL estimate is clamped to 0; class weights scale each side
    clamped = kto_loss(T(-1.2, -2.5), T(-1.0, -1.1), torch.tensor([True, False]), -3.0, beta=0.1,
                       desirable_weight=2.0, undesirable_weight=0.5)
    assert clamped.tolist() == pytest.approx([1.010000, 0.232529], abs=1e-6)
    # APO-zero (unpaired): undesirable sigmoid(0.1 * -1.4) = 0.465057, desirable as KTO with z0 = 0
    apo = kto_loss(T(-1.2, -2.5), T(-1.0, -1.1), torch.tensor([True, False]), 9.0, beta=0.1, loss_type="apo_zero_unpaired")
    assert apo.tolist() == pytest.approx([0.505000, 0.465057], abs=1e-6)


def unpaired(n: int) -> list[dict]:
    """Desirable replies say 'yes', undesirable ones 'no': separable by construction."""
    rows = []
    for i in range(n):
        good = i % 2 == 0
        rows.append({
            "prompt": [{"role": "user", "content": f"Question {i}: is {i} + {i} equal to {2 * i}?"}],
            "completion": [{"role": "assistant", "content": f"yes yes, {2 * i}" if good else f"no no, {2 * i + 1}"}],
            "label": good,
        })
    return rows


def kto_args(tmp_path, **kw) -> KTOConfig:
    return KTOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, max_length=64, beta=0.1, report_to=[],
                     use_cpu=True, bf16=False, activation_checkpointing=False, per_device_train_batch_size=4, **kw)


def test_cached_reference_equals_a_forward_and_trl_loss_equals_ours(tmp_path):
    path = resolve_model(ModelConfig(name="tiny"))
    tok = load_tokenizer(path)
    rows = unpaired(8)
    # 1) the precompute (our override of TRL's) on the reference model
    ref = load_causal_lm(path, ModelConfig(name="tiny"))
    filled = CachedRefKTOTrainer(model=ref, args=kto_args(tmp_path), train_dataset=Dataset.from_list(rows),
                                 processing_class=tok)
    assert filled.ref_model is None and filled.ref_forward_batches == 2
    batch = filled.data_collator([filled.train_dataset[i] for i in range(8)])
    ref.eval()
    with torch.no_grad():  # an independent forward with our own function: the same numbers in fp32
        own, _ = completion_logps(ref, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        own_kl, _ = completion_logps(ref, batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"])
    # Relative, not absolute: the fill ran batches of 4, this forward one of 8, so kernels may sum in another
    # order; sums near -75 then differ by an ulp or two (7.6e-6 each; 1.5e-5 was seen under load). rel 1e-6
    # is ~8 float32 ulps; a wrong position or mask would be off by whole nats.
    assert batch["ref_logps"].tolist() == pytest.approx(own.sum(1).tolist(), rel=1e-6, abs=0)
    assert batch["ref_KL_logps"].tolist() == pytest.approx(own_kl.sum(1).tolist(), rel=1e-6, abs=0)

    # 2) a policy that differs from the reference, trained on those cached columns: TRL's loss = kto_loss
    policy = load_causal_lm(path, ModelConfig(name="tiny"))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    cached = [{**r, "ref_logps": a, "ref_KL_logps": b}
              for r, a, b in zip(rows, filled.train_dataset["ref_logps"], filled.train_dataset["ref_KL_logps"])]
    trainer = CachedRefKTOTrainer(model=policy, args=kto_args(tmp_path / "p"), train_dataset=Dataset.from_list(cached),
                                  processing_class=tok)
    assert trainer.ref_forward_batches == 0
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    policy.eval()
    with torch.no_grad():
        trl_loss = trainer.compute_loss(policy, batch)
        logp, _ = completion_logps(policy, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        kl_logp, _ = completion_logps(policy, batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"])
    z0 = (kl_logp.sum(1) - batch["ref_KL_logps"]).mean()
    ours = kto_loss(logp.sum(1), batch["ref_logps"], batch["label"].bool(), z0, beta=0.1)
    assert trl_loss.item() == pytest.approx(ours.mean().item(), rel=1e-4)


def test_kto_stage_caches_reference_and_never_builds_a_reference_model(tiny_cfg, monkeypatch, tmp_path):
    data = tmp_path / "unpaired.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in unpaired(64)))
    common = (f"data.unpaired_path={data}", *only("kto"), "kto.max_steps=12", "kto.learning_rate=2e-3")

    def refuse(*a, **kw):
        raise AssertionError("KTOTrainer tried to build a reference model")

    loads, ref_batches = [], []
    real_load = AutoModelForCausalLM.from_pretrained.__func__
    real_ref = CachedRefKTOTrainer.compute_ref_log_probs
    monkeypatch.setattr(trl_kto, "create_model_from_path", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **kw: loads.append(a) or real_load(cls, *a, **kw)))
    monkeypatch.setattr(CachedRefKTOTrainer, "compute_ref_log_probs",
                        lambda self, *a: ref_batches.append(1) or real_ref(self, *a))

    first = execute_stage(tiny_cfg(*common, "run.name=first"), "kto")
    assert len(loads) == 1  # the policy; nothing else
    assert len(ref_batches) == 8 == first["metrics"]["kto/ref_forward_batches"]  # 64 examples / batch 8
    assert first["rows"] == {"desirable": 32, "undesirable": 32, "dropped": 0}
    assert first["metrics"]["kto/rewards/margins"] > 0  # 'yes' answers gained on 'no' answers

    second = execute_stage(tiny_cfg(*common, "run.name=second", "kto.max_steps=2"), "kto")  # steps: not in the key
    assert len(ref_batches) == 8 and second["metrics"]["kto/cache_hit"] == 1.0  # zero reference passes
    assert second["outputs"]["cache_entry"] == first["outputs"]["cache_entry"]
    # A different batch size pairs other completions for the KL term: another key, a fresh pass.
    third = execute_stage(tiny_cfg(*common, "run.name=third", "kto.max_steps=2", "kto.per_device_batch_size=4"), "kto")
    assert third["metrics"]["kto/cache_hit"] == 0.0 and len(ref_batches) == 8 + 16


def test_bad_unpaired_rows_are_named(tiny_cfg, tmp_path):
    data = tmp_path / "bad.jsonl"
    rows = unpaired(4)
    rows[2]["label"] = "yes"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=r"bad.jsonl line 3: 'label' must be true or false, got 'yes'"):
        execute_stage(tiny_cfg(f"data.unpaired_path={data}", *only("kto")), "kto")
    rows[2]["label"] = False
    rows[3]["completion"] = [{"role": "assistant", "content": "word " * 200}]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=r"example row-4: prompt \+ completion is \d+ tokens, over max_length 128"):
        execute_stage(tiny_cfg(f"data.unpaired_path={data}", *only("kto")), "kto")
    m = execute_stage(tiny_cfg(f"data.unpaired_path={data}", *only("kto"), "data.on_bad_row=drop", "kto.max_steps=1",
                               "kto.per_device_batch_size=2"), "kto")
    assert m["rows"] == {"desirable": 1, "undesirable": 2, "dropped": 1}  # row 4 (desirable) dropped
