"""Preflight: the memory arithmetic by hand, the per-stage outlook (run / resume / skip) against a real store,
and the risky-setting warnings."""

from __future__ import annotations

import json

import pytest

from conftest import CONFIG, only, run_cli
from rlhf.core import progress
from rlhf.core.config import ModelConfig
from rlhf.core.loader import load_config
from rlhf.pipeline.memory import Shape, activation_bytes, model_shape, stage_estimates, trained_model_bytes
from rlhf.pipeline.preflight import nothing_to_run, outlook, predicted_keys, risky_settings
from rlhf.pipeline.runner import execute_stage
from rlhf.core.store import ArtifactStore
from rlhf.train.training import CRASH_ENV, InjectedCrash

# h 8, 1 layer, 2 heads (head dim 4), 1 kv head -> kv_dim 4, MLP 16, vocab 10, tied embeddings.
SMALL = Shape(hidden=8, layers=1, heads=2, kv_heads=1, intermediate=16, vocab=10, tied=True)


def test_parameter_counts_by_hand():
    # embeddings 10*8 = 80; layer: q 64 + k,v 2*8*4 = 64 + o 64 + MLP 3*8*16 = 384 + 2 norms 16 = 592;
    # final norm 8 -> 680.
    assert SMALL.params() == 680
    # SmolLM2-135M: 49152*576 + 30 * (576^2 + 2*576*192 + 576^2 + 3*576*1536 + 2*576) + 576 = 134,515,008
    assert model_shape(ModelConfig()).params() == 134_515_008


def test_training_memory_by_hand():
    assert trained_model_bytes(SMALL, 4, "adamw_torch", None) == {"weights": 2720, "gradients": 2720, "optimizer": 5440}
    assert trained_model_bytes(SMALL, 4, "adamw_bnb_8bit", None)["optimizer"] == 1360  # 2 bytes per weight
    # LoRA r=2: per layer (in+out) = q 16 + k 12 + v 12 + o 16 + gate 24 + up 24 + down 24 = 128 -> 256 weights
    assert trained_model_bytes(SMALL, 4, "adamw_torch", 2) == {"weights": 2720, "gradients": 1024, "optimizer": 2048}
    # batch 2, seq 4, fp32: 5*a*s/h = 5; one layer = 4*2*8*(34+5) * 4/2 bytes = 4992
    assert activation_bytes(SMALL, 2, 4, 4, flash=False, checkpointing=False) == 4992
    assert activation_bytes(SMALL, 2, 4, 4, flash=True, checkpointing=False) == 4352  # no score term
    assert activation_bytes(SMALL, 2, 4, 4, flash=False, checkpointing=True) == 256 + 4992  # 2sbh * 2 + one layer


def test_mixed_precision_memory_by_hand():
    # bf16 compute, float32 master weights, gradients and AdamW states: 4 + 4 + 8 bytes per weight
    assert trained_model_bytes(SMALL, 2, "adamw_torch", None, mixed=True) == {"weights": 2720, "gradients": 2720, "optimizer": 5440}
    assert trained_model_bytes(SMALL, 2, "adamw_bnb_8bit", None, mixed=True)["optimizer"] == 1360
    # LoRA r=2: the base stays bf16 (680 x 2), the 256 adapter weights train in float32
    assert trained_model_bytes(SMALL, 2, "adamw_torch", 2, mixed=True) == {"weights": 1360, "gradients": 1024, "optimizer": 2048}


# Qwen2.5-1.5B's shape (its config.json; q/k/v biases left out, 0.03% of the weights).
QWEN_1_5B = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}


def test_estimator_reproduces_the_published_1_5b_table(tmp_path):
    """The seed's single-GPU table for a 1.5B model: PPO ~60 GB, DPO ~18 GB with 8-bit AdamW, GRPO (G=4)
    ~23 GB. Assumptions (the table states none; these are the usual ones): bf16 compute with float32
    master weights, gradients and optimizer states (model.mixed_precision); frozen models in bf16; flash
    attention; gradient checkpointing; 512-token sequences (RL: 96 prompt + 416 response tokens);
    micro-batch 1 pair (DPO) or 4 rollouts (GRPO, PPO); AdamW 8-bit for DPO and GRPO, full fp32 AdamW for
    PPO (policy and critic); PPO holds policy, critic, reference and reward model; GB = 1e9 bytes."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN_1_5B))
    cfg = load_config(CONFIG, "default", [
        f"model.name={tmp_path}", "model.dtype=bfloat16", "model.mixed_precision=true",
        "model.attn_implementation=flash_attention_2", "ref_logprobs.max_length=512", "rollout.max_new_tokens=416",
        "dpo.optim=adamw_bnb_8bit", "dpo.per_device_batch_size=1", "dpo.max_length=512", "dpo.gradient_checkpointing=true",
        "grpo.enabled=true", "grpo.optim=adamw_bnb_8bit", "grpo.group_size=4", "grpo.prompts_per_iteration=4",
        "grpo.minibatch_size=4", "grpo.gradient_checkpointing=true", "grpo.beta=0.04",  # the table holds a reference
        "grpo.lora.enabled=false",  # and trains full weights
        "ppo.enabled=true", "ppo.reward_source=reward_model", "ppo.prompts_per_iteration=8", "ppo.minibatch_size=4",
        "ppo.gradient_checkpointing=true", "ppo.lora.enabled=false"])  # full weights, as the table's
    assert model_shape(cfg.model).params() == pytest.approx(1.54e9, rel=0.01)
    gb = {stage: {k: v * 1024**3 / 1e9 for k, v in terms.items()} for stage, terms in stage_estimates(cfg).items()}
    # Measured: PPO 60.1, GRPO 22.8, DPO with a reference model 20.5 (the table's setting), ours 17.5.
    assert gb["ppo"]["total"] == pytest.approx(60, rel=0.15)
    assert gb["grpo"]["total"] == pytest.approx(23, rel=0.15)
    assert gb["dpo"]["total_with_reference_model"] == pytest.approx(18, rel=0.15)
    # The cached reference: one bf16 copy of the weights (2 bytes x 1.54e9) less than the table's DPO.
    assert gb["dpo"]["total_with_reference_model"] - gb["dpo"]["total"] == pytest.approx(3.09, abs=0.01)
    assert gb["ppo"]["optimizer"] == pytest.approx(2 * 8 * 1.5437, rel=1e-3)  # policy + critic, 8 bytes per weight


def test_estimates_cover_every_enabled_stage_and_grow_with_batch():
    cfg = load_config(CONFIG, "default", ["ppo.enabled=true", "grpo.minibatch_size=8"])  # the same micro-batch as PPO
    est = stage_estimates(cfg)
    assert set(est) == {"sft", "preferences", "reward_model", "ref_logprobs", "dpo", "ppo", "grpo", "eval"}
    assert est["ppo"]["total"] > est["grpo"]["total"] > est["ref_logprobs"]["total"]  # critic, then inference
    bigger = stage_estimates(load_config(CONFIG, "default", ["sft.per_device_batch_size=32"]))
    assert bigger["sft"]["activations"] == pytest.approx(4 * est["sft"]["activations"], rel=0.02)
    assert stage_estimates(load_config(CONFIG, "default", ["model.name=no-such-org/no-such-model"])) is None  # a hub id, not cached


def test_outlook_says_run_then_resume_then_skip_and_progress_is_reported(tiny_cfg, monkeypatch):
    cfg = tiny_cfg(*only("sft", "dpo", "ref_logprobs"), "sft.save_steps=2")
    store = ArtifactStore(cfg.storage)
    assert outlook(cfg, store) == {"sft": "run", "ref_logprobs": "run", "dpo": "run"}
    monkeypatch.setenv(CRASH_ENV, "sft:3")  # dies after the step-2 checkpoint
    with pytest.raises(InjectedCrash):
        execute_stage(cfg, "sft")
    monkeypatch.delenv(CRASH_ENV)
    assert outlook(cfg, store)["sft"] == "resume (checkpoints of this key)"
    seen = []
    with progress.listening(lambda stage, fraction: seen.append((stage, fraction))):
        manifest = execute_stage(cfg, "sft")
    assert seen[-1] == ("sft", 1.0) and [f for _, f in seen] == sorted(f for _, f in seen)  # resumed at step 2
    assert 0.25 <= seen[0][1] < 1.0
    assert manifest["key"] == predicted_keys(cfg)["sft"]  # the prediction is the key the stage records
    assert outlook(cfg, store)["sft"] == f"skip (complete, key {manifest['key'][:12]})"
    changed = tiny_cfg(*only("sft", "dpo", "ref_logprobs"), "sft.save_steps=2", "sft.learning_rate=1e-4")
    assert outlook(changed, store)["sft"] == "run (replaces the stored result: sft.learning_rate: 0.001 -> 0.0001)"

    only_sft = tiny_cfg(*only("sft"), "sft.save_steps=2")
    assert nothing_to_run(cfg, store) is None  # ref_logprobs and dpo have not run
    assert nothing_to_run(only_sft, store) is None  # complete, but no run report stored: the flow writes it
    store.write_bytes(store.path(cfg.run.name, "_report", "report.md"), b"# report")
    assert nothing_to_run(only_sft, store) == [{"stage": "sft", "key": manifest["key"], "metrics": manifest["metrics"]}]
    assert nothing_to_run(tiny_cfg(*only("sft"), "sft.save_steps=2", "sft.learning_rate=1e-4"), store) is None


def test_risky_settings_are_named():
    assert risky_settings(load_config(CONFIG, "default")) == []
    cfg = load_config(CONFIG, "default", ["grpo.reward_source=reward_model", "grpo.beta=0", "dpo.learning_rate=1e-3",
                                          "grpo.group_size=2", "grpo.minibatch_size=16"])
    warnings = risky_settings(cfg)
    assert any(w.startswith("grpo: KL beta 0 with a learned reward model") for w in warnings)
    assert "dpo.learning_rate: 0.001 is outside the usual 1e-07 .. 5e-05 for dpo" in warnings
    assert any(w.startswith("grpo.group_size: 2 samples per prompt") for w in warnings)


def test_validate_prints_the_preflight():
    proc = run_cli("validate", "--profile", "tiny", "--set", "grpo.reward_source=reward_model", "--set", "grpo.beta=0")
    assert proc.returncode == 0, proc.stderr
    assert "# memory sft: ~" in proc.stdout and "# memory grpo: ~" in proc.stdout
    assert "# WARNING grpo: KL beta 0 with a learned reward model" in proc.stdout


def test_bf16_on_a_cpu_is_native_only_with_its_flags(tmp_path):
    from rlhf.core.hardware import cpu_has_bf16

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n")
    assert cpu_has_bf16(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 amx_tile amx_bf16\n")
    assert cpu_has_bf16(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16x\n")  # whole flags only
    assert not cpu_has_bf16(str(info))
    assert not cpu_has_bf16(str(tmp_path / "absent"))


@pytest.mark.parametrize("native, dtype, expected", [(True, "float32", "bfloat16"), (False, "float32", "float32"),
                                                     (False, "bfloat16", "bfloat16")])
def test_inference_dtype_auto_takes_bf16_only_where_it_is_native(monkeypatch, native, dtype, expected):
    import rlhf.core.hardware as hardware
    import rlhf.core.models as models
    from rlhf.core.config import ModelConfig

    monkeypatch.setattr(hardware, "native_bf16", lambda: native)
    resolved = models.inference_model(ModelConfig(dtype=dtype, inference_dtype="auto"))
    assert resolved.dtype == expected and not resolved.mixed_precision
    assert models.inference_model(ModelConfig()).dtype == "float32"  # unset: the training dtype


@pytest.mark.parametrize("native, dtype, mixed", [(True, "bfloat16", True), (False, "float32", False)])
def test_mixed_precision_auto_is_decided_when_the_config_is_read(monkeypatch, native, dtype, mixed):
    """auto: bfloat16 mixed precision where native, else float32; the choice is in the config every stage and
    every content key sees, so runs on the two kinds of machine never share a key."""
    import rlhf.core.hardware as hardware
    import rlhf.core.models as models

    monkeypatch.setattr(hardware, "native_bf16", lambda: native)
    cfg = load_config(CONFIG, "default", ["model.mixed_precision=auto"])
    assert (cfg.model.dtype, cfg.model.mixed_precision) == (dtype, mixed)
    assert models.model_identity(cfg.model).get("mixed_precision", False) == mixed
    assert ModelConfig.model_validate(cfg.model.model_dump()) == cfg.model  # a resolved config validates as itself
    with pytest.raises(ValueError, match="mixed_precision: auto goes with dtype float32"):
        ModelConfig(dtype="float16", mixed_precision="auto")


def test_mixed_precision_auto_keys_differ_by_machine(monkeypatch):
    import rlhf.core.hardware as hardware

    keys = {}
    for native in (True, False):
        monkeypatch.setattr(hardware, "native_bf16", lambda: native)
        keys[native] = predicted_keys(load_config(CONFIG, "tiny", ["model.mixed_precision=auto"]))
    assert keys[True]["sft"] != keys[False]["sft"]


def test_validate_prints_what_mixed_precision_auto_chose_and_refuses_it_with_a_16_bit_dtype():
    from rlhf.core.hardware import native_bf16

    chosen = run_cli("validate", "--profile", "tiny", "--set", "model.mixed_precision=auto")
    assert chosen.returncode == 0, chosen.stderr
    expected = "dtype: bfloat16\n  attn_implementation: sdpa\n  mixed_precision: true" if native_bf16() else (
        "dtype: float32\n  attn_implementation: sdpa\n  mixed_precision: false")
    assert expected in chosen.stdout, chosen.stdout[:800]
    refused = run_cli("validate", "--profile", "tiny", "--set", "model.mixed_precision=auto", "--set", "model.dtype=float16")
    assert refused.returncode == 2 and "model.mixed_precision: auto goes with dtype float32" in refused.stderr, refused.stderr
