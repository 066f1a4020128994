"""The RL loop on the tiny profile: GRPO and PPO raise a learnable reward, experience is Parquet, a
crash after a checkpoint resumes at the next iteration without rewriting earlier experience, and NaN
rewards stop the stage with a message naming the iteration.

The reward (tests/reward_fns.py) is the share of response tokens in the lower third of the vocabulary.
A random-init model is near-uniform over 49k tokens, so rollouts use temperature 0.1: sampling is
peaked, and the policy gets a signal it can follow within a dozen iterations.
"""

from __future__ import annotations

import hashlib
import math
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest

from conftest import only
from rlhf.core.loader import ConfigError
from rlhf.core.models import load_causal_lm
from rlhf.pipeline.runner import execute_stage
from rlhf.core.store import ArtifactStore
from rlhf.train.training import CRASH_ENV, InjectedCrash
from rlhf.train.rl_loop import RLGuardError
from rlhf.core.tables import METRICS_SCHEMA, EXPERIENCE_SCHEMA, ROLLOUT_SCHEMA

sys.path.insert(0, str(Path(__file__).parent))  # reward_fns is imported by 'module:function'

ONLY_RL = ("rollout.max_new_tokens=8", "rollout.temperature=0.1")


def rl_cfg(tiny_cfg, algo: str, *extra: str):
    common = [f"{algo}.enabled=true", f"{algo}.reward_source=function", f"{algo}.reward_function=reward_fns:low_vocab_share",
              f"{algo}.learning_rate=1e-3", f"{algo}.eval_prompts=0", f"{algo}.save_every=100"]
    return tiny_cfg(*only(algo), *ONLY_RL, *common, *extra)


def reward_curve(cfg, algo: str) -> list[float]:
    store = ArtifactStore(cfg.storage)
    table = store.read_table(store.stage_path(cfg.run.name, algo, "metrics.parquet"), METRICS_SCHEMA)
    return [r["value"] for r in sorted(table.to_pylist(), key=lambda r: r["step"]) if r["name"] == "reward_mean"]


@pytest.mark.slow
def test_grpo_raises_reward(tiny_cfg):
    cfg = rl_cfg(tiny_cfg, "grpo", "grpo.iterations=12", "grpo.prompts_per_iteration=4", "grpo.group_size=8",
                 "grpo.minibatch_size=16", "grpo.max_kl=50")
    m = execute_stage(cfg, "grpo")
    curve = reward_curve(cfg, "grpo")
    assert len(curve) == 12
    assert sum(curve[-3:]) / 3 > curve[0] + 0.25, curve  # about 0.4 -> 0.95 for this seed
    assert math.isfinite(m["metrics"]["grpo/kl"]) and m["metrics"]["grpo/k3"] >= 0
    store = ArtifactStore(cfg.storage)
    exp = store.read_table(store.stage_path(cfg.run.name, "grpo", "experience", "iter-000012.parquet"), EXPERIENCE_SCHEMA)
    assert exp.num_rows == 32 and set(exp.column("sample_index").to_pylist()) == set(range(8))


@pytest.mark.slow
def test_ppo_raises_reward(tiny_cfg):
    # 6 iterations: this seed's reward reads 0.43, 0.72, 0.93, 0.98, 1.0, 1.0 (it stays at 1.0 up to 12)
    cfg = rl_cfg(tiny_cfg, "ppo", "ppo.iterations=6", "ppo.prompts_per_iteration=32", "ppo.minibatch_size=16",
                 "ppo.epochs=2", "ppo.kl.beta=0.01", "ppo.vf_coef=1.0", "ppo.lam=1.0", "ppo.max_kl=50")
    m = execute_stage(cfg, "ppo")
    curve = reward_curve(cfg, "ppo")
    assert len(curve) == 6
    assert sum(curve[-3:]) / 3 > curve[0] + 0.25, curve  # about 0.4 -> 0.99 for this seed
    assert math.isfinite(m["metrics"]["ppo/kl"]) and math.isfinite(m["metrics"]["ppo/value_loss"])
    assert m["metrics"]["ppo/kl_beta"] != 0.01  # the adaptive controller moved beta


def _digest(store, path) -> str:
    return hashlib.sha256(store.fs.cat_file(path)).hexdigest()


def test_crash_after_checkpoint_resumes_at_next_iteration(tiny_cfg, monkeypatch):
    cfg = rl_cfg(tiny_cfg, "grpo", "grpo.iterations=5", "grpo.save_every=2", "grpo.prompts_per_iteration=2",
                 "grpo.group_size=4", "grpo.minibatch_size=8", "grpo.max_kl=50")
    store = ArtifactStore(cfg.storage)
    monkeypatch.setenv(CRASH_ENV, "grpo:3")
    with pytest.raises(InjectedCrash):
        execute_stage(cfg, "grpo")
    assert store.read_manifest(cfg.run.name, "grpo") is None
    exp = lambda i: store.stage_path(cfg.run.name, "grpo", "experience", f"iter-{i:06d}.parquet")  # noqa: E731
    before = {i: _digest(store, exp(i)) for i in (1, 2)}
    mtimes = {i: store.fs.info(exp(i)).get("mtime") for i in (1, 2)}

    monkeypatch.delenv(CRASH_ENV)
    m = execute_stage(cfg, "grpo")
    assert m["status"] == "resumed" and m["resumed_from_step"] == 2  # iteration 3 starts again
    assert {i: _digest(store, exp(i)) for i in (1, 2)} == before
    assert {i: store.fs.info(exp(i)).get("mtime") for i in (1, 2)} == mtimes  # not rewritten
    assert all(store.fs.exists(exp(i)) for i in range(1, 6))
    assert len(reward_curve(cfg, "grpo")) == 5


def test_a_nan_reward_stops_the_stage_naming_the_function(tiny_cfg):
    from rlhf.train.rewards import RewardFunctionError

    cfg = rl_cfg(tiny_cfg, "grpo", "grpo.reward_function=reward_fns:nan_after_first", "grpo.iterations=3",
                 "grpo.prompts_per_iteration=2", "grpo.group_size=4", "grpo.minibatch_size=8")
    with pytest.raises(RewardFunctionError, match=r"reward function reward_fns:nan_after_first: returned nan for "
                                                  r"completion 0: rewards must be finite"):
        execute_stage(cfg, "grpo")
    store = ArtifactStore(cfg.storage)
    assert store.read_manifest(cfg.run.name, "grpo") is None


def test_the_guard_stops_on_a_nan_or_a_kl_above_the_limit_naming_the_iteration():
    from rlhf.train.rl_loop import guard

    with pytest.raises(RLGuardError, match=r"grpo iteration 3: policy loss is nan; stopping, the last complete checkpoint"):
        guard("grpo", 3, "policy loss", float("nan"))
    with pytest.raises(RLGuardError, match=r"ppo iteration 2: mean KL = 12.000 exceeds max_kl 10"):
        guard("ppo", 2, "mean KL", 12.0, 10.0)
    guard("ppo", 2, "mean KL", 9.0, 10.0)


def test_rollout_stage_writes_scored_samples(tiny_cfg):
    cfg = tiny_cfg(*only("rollout"), "rollout.policy=base", "rollout.prompts=4", "rollout.n=3",
                   "rollout.temperature=1.0")
    m = execute_stage(cfg, "rollout")
    store = ArtifactStore(cfg.storage)
    table = store.read_table(store.stage_path(cfg.run.name, "rollout", "rollouts.parquet"), ROLLOUT_SCHEMA)
    rows = table.to_pylist()
    assert len(rows) == 12 and m["rows"] == {"samples": 12}
    assert all(len(r["response_ids"]) == len(r["logp_rollout"]) <= 8 for r in rows)
    assert all(r["finish_reason"] in ("stop", "length") and 0.0 <= r["reward"] <= 1.0 for r in rows)
    assert all(lp <= 0.0 for r in rows for lp in r["logp_rollout"])
    again = execute_stage(cfg, "rollout")
    assert again["status"] == "skipped"


def test_sampling_is_reproducible_by_seed():
    from rlhf.core.config import ModelConfig
    from rlhf.engines.engine import HFEngine, SamplingParams
    from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model

    path = resolve_model(ModelConfig(name="tiny"))
    engine = HFEngine(load_causal_lm(path, ModelConfig(name="tiny")), load_tokenizer(path), batch_size=3)
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(4)]
    a = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=3))
    b = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=3))
    c = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=4))
    assert [g.token_ids for g in a] == [g.token_ids for g in b] != [g.token_ids for g in c]
    assert [(g.prompt_index, g.sample_index) for g in a] == [(i, s) for i in range(4) for s in range(2)]


def test_lora_policy_uses_its_base_as_reference_and_resumes(tiny_cfg, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = rl_cfg(tiny_cfg, "grpo", "grpo.lora.enabled=true", "grpo.lora.r=8", "grpo.learning_rate=1e-2",
                 "grpo.iterations=4", "grpo.save_every=2", "grpo.prompts_per_iteration=2", "grpo.minibatch_size=8",
                 "grpo.max_kl=50")
    loads = []
    real = AutoModelForCausalLM.from_pretrained.__func__
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **kw: loads.append(a) or real(cls, *a, **kw)))
    monkeypatch.setenv(CRASH_ENV, "grpo:3")
    with pytest.raises(InjectedCrash):
        execute_stage(cfg, "grpo")
    assert len(loads) == 1  # the base under the adapters; the reference is that base, adapters off
    store = ArtifactStore(cfg.storage)
    table = store.read_table(store.stage_path(cfg.run.name, "grpo", "iterations", "iter-000001.parquet"), METRICS_SCHEMA)
    assert {r["name"]: r["value"] for r in table.to_pylist()}["kl"] == 0.0  # zero-init B: policy == reference
    ckpt = store.stage_path(cfg.run.name, "grpo", "checkpoints", "iter-000002", "policy")
    assert store.fs.exists(f"{ckpt}/adapter_model.safetensors")  # only the adapters are checkpointed

    monkeypatch.delenv(CRASH_ENV)
    m = execute_stage(cfg, "grpo")
    assert m["status"] == "resumed" and m["resumed_from_step"] == 2
    assert m["metrics"]["grpo/kl"] != 0.0  # trained adapters moved the policy away from its base
    published = store.stage_path(cfg.run.name, "grpo", "model")
    assert not store.fs.exists(f"{published}/adapter_config.json")  # merged into a plain HF folder
    base = load_file(str(Path(loads[0][0]) / "model.safetensors"))
    with store.fs.open(f"{published}/model.safetensors", "rb") as f:
        from safetensors.torch import load as load_bytes

        merged = load_bytes(f.read())
    name = next(k for k in merged if "q_proj.weight" in k)
    assert not (merged[name] == base[name]).all()  # the adapters were merged into the weights


def test_lora_policy_does_not_depend_on_what_ran_before_it_in_the_process(tiny_cfg, tmp_path):
    # peft draws the LoRA A matrices at random when the loop wraps the policy. In `rlhf run` every stage
    # shares one process: the runner seeds each stage with run.seed, so RNG use before it (an earlier
    # stage) cannot change the adapters, and the same key gives the same model in a fresh worker.
    import torch
    from safetensors.torch import load as load_bytes

    models = []
    for name, draws in (("fresh", 0), ("after", 1000)):
        torch.rand(draws)
        cfg = rl_cfg(tiny_cfg, "grpo", "grpo.lora.enabled=true", "grpo.iterations=1", "grpo.prompts_per_iteration=2",
                     "grpo.minibatch_size=8", f"storage.url={tmp_path / name}")
        execute_stage(cfg, "grpo")
        store = ArtifactStore(cfg.storage)
        with store.fs.open(store.stage_path(cfg.run.name, "grpo", "model", "model.safetensors"), "rb") as f:
            models.append(load_bytes(f.read()))
    assert models[0].keys() == models[1].keys()
    for k in models[0]:
        assert torch.equal(models[0][k], models[1][k]), k


def update_gradients(loss_type: str, accumulation: int, weight: float | None = None):
    """One update() of the tiny model on 8 rollouts of different lengths with lr 0: the accumulated
    gradients (and the update's metrics). weight: every token's sampler-correction weight, or none."""
    import torch

    from rlhf.core.config import GRPOConfig, ModelConfig
    from rlhf.core.models import load_causal_lm, resolve_model
    from rlhf.engines.engine import Generation
    from rlhf.train.rl_loop import ALGORITHMS, Step, build_batch, score_all, update

    g = torch.Generator().manual_seed(0)
    lengths = [1, 3, 5, 2, 8, 4, 6, 7]
    gens = [Generation(i, 0, torch.randint(5, 1000, (n,), generator=g).tolist(), [-1.0] * n, "", "length")
            for i, n in enumerate(lengths)]
    prompts = [torch.randint(5, 1000, (3 + i % 3,), generator=g).tolist() for i in range(8)]
    model = load_causal_lm(resolve_model(ModelConfig(name="tiny")), ModelConfig(name="tiny"))
    cfg = GRPOConfig(prompts_per_iteration=2, group_size=4, minibatch_size=8, gradient_accumulation_steps=accumulation,
                     beta=0.0, max_grad_norm=1e9, loss_type=loss_type)
    batch = build_batch(prompts, gens, 0)
    batch.logp_old = score_all(model, batch, 1.0, 8) - 0.05 * batch.mask  # ratios away from 1
    batch.advantages = torch.randn(8, 1, generator=torch.Generator().manual_seed(1)) * batch.mask
    if weight is not None:
        batch.weights = weight * batch.mask
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # leaves the accumulated .grad in place
    stats = update(Step(ALGORITHMS["grpo"], cfg, 1, {"policy": model}, {"policy": optimizer}, 0.0, 1.0, nullcontext, 8), batch)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, stats


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_gradient_accumulation_gives_the_same_gradient(loss_type):
    """A minibatch of 8 rollouts of different lengths as 1 or 4 micro-batches: the same accumulated
    gradient (each micro-batch's loss weighted by its share of the minibatch's tokens, or of its
    sequences for the per-sequence loss types)."""
    import torch

    (one, s1), (four, s4) = update_gradients(loss_type, 1), update_gradients(loss_type, 4)
    assert one.keys() == four.keys() and any(v.abs().sum() > 0 for v in one.values())
    for name in one:
        torch.testing.assert_close(four[name], one[name], atol=1e-7, rtol=1e-4)
    assert s4["policy_loss"] == pytest.approx(s1["policy_loss"], rel=1e-5)  # share-weighted micro-batch metrics


def test_sampler_correction_weights_scale_the_policy_gradient():
    """batch.weights (sampler_correction) multiply the per-token policy-gradient loss: weights of 1 leave
    the gradient as it is, weights of 0.5 halve it."""
    import torch

    plain, _ = update_gradients("dapo", 1)
    ones, _ = update_gradients("dapo", 1, weight=1.0)
    half, _ = update_gradients("dapo", 1, weight=0.5)
    for name in plain:
        torch.testing.assert_close(ones[name], plain[name])
        torch.testing.assert_close(half[name], 0.5 * plain[name], atol=1e-9, rtol=1e-5)


def test_mixed_precision_keeps_float32_master_weights_and_a_bf16_reference(tiny_cfg, monkeypatch):
    """model.mixed_precision: the trained policy (and so its optimizer states) in float32, the frozen
    reference in bfloat16, forward passes under bf16 autocast (CPU autocast here, CUDA on GPUs)."""
    import torch

    import rlhf.train.rl_loop as rl

    loaded = []

    def recording(path, model_cfg, trained=False):
        model = load_causal_lm(path, model_cfg, trained)
        loaded.append((trained, next(model.parameters()).dtype))
        return model

    monkeypatch.setattr(rl, "load_causal_lm", recording)
    cfg = rl_cfg(tiny_cfg, "grpo", "model.dtype=bfloat16", "model.mixed_precision=true", "grpo.iterations=2",
                 "grpo.prompts_per_iteration=2", "grpo.minibatch_size=8")
    execute_stage(cfg, "grpo")
    assert loaded == [(True, torch.float32), (False, torch.bfloat16)]  # policy, then reference
    store = ArtifactStore(cfg.storage)
    with store.fs.open(store.stage_path(cfg.run.name, "grpo", "model", "model.safetensors"), "rb") as f:
        from safetensors.torch import load as load_safetensors

        assert {t.dtype for t in load_safetensors(f.read()).values()} == {torch.float32}
    kl = [r["value"] for r in store.read_table(store.stage_path(cfg.run.name, "grpo", "metrics.parquet"), METRICS_SCHEMA).to_pylist()
          if r["name"] == "kl" and r["step"] == 1]
    # bf16 rounding of the same weights, not two different models. The logged KL is the k1 estimate on 16
    # samples, which can fall either side of 0 (-0.006 on the RL prompt draw of data.rl_size).
    assert abs(kl[0]) < 0.1


def test_logp_mismatch_by_hand_and_vllm_limits_are_refused(tiny_cfg):
    import torch

    from rlhf.core.loader import ConfigError
    from rlhf.train.rl_loop import Batch, logp_mismatch

    # |(-1.0) - (-1.1)| = 0.1, |(-2.0) - (-2.0)| = 0, |(-0.5) - (-0.2)| = 0.3; the padded 4th token is ignored
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    batch = Batch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), mask,
                  torch.tensor([[-1.0, -2.0], [-0.5, 0.0]]), logp_old=torch.tensor([[-1.1, -2.0], [-0.2, 5.0]]))
    m = logp_mismatch(batch)
    assert m["logp_mismatch_mean"] == pytest.approx(0.4 / 3) and m["logp_mismatch_max"] == pytest.approx(0.3)
    with pytest.raises(ConfigError, match="rollout.engine: 'vllm' in the RL loop needs grpo.lora.enabled false"):
        tiny_cfg("grpo.enabled=true", "rollout.engine=vllm", "grpo.lora.enabled=true")


@pytest.mark.parametrize("shared", [False, True])
def test_policy_scoring_projects_only_response_positions(shared):
    """forward() asks for the logits of the response positions only (logits_to_keep) and its numbers
    equal slicing full logits, with left-padded prompts and right-padded responses of mixed lengths; with
    prompts that share 10 leading tokens (a chat template's), the prefix runs once as its own row."""
    import torch

    from rlhf.core.config import ModelConfig
    from rlhf.engines.engine import Generation
    from rlhf.core.models import resolve_model
    from rlhf.train.rl_loop import build_batch, forward

    g = torch.Generator().manual_seed(0)
    gens = [Generation(i, 0, torch.randint(5, 1000, (n,), generator=g).tolist(), [-1.0] * n, "", "length")
            for i, n in enumerate([2, 5, 1, 4])]
    prompts = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (9, 4, 12, 7)]
    if shared:
        head = torch.randint(5, 1000, (10,), generator=g).tolist()
        prompts = [head + p for p in prompts]
    batch = build_batch(prompts, gens, 0)
    model = load_causal_lm(resolve_model(ModelConfig(name="tiny")), ModelConfig(name="tiny"))
    rows = []
    model.get_output_embeddings().register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[1]))
    with torch.no_grad():
        logp, _ = forward(model, batch, slice(None), temperature=0.7)
        ids, attn = batch.input_ids, batch.attention_mask
        full = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0)).logits
    p_w, t_w = batch.prompt_width, batch.mask.shape[1]
    want = torch.log_softmax(full[:, p_w - 1 : -1].float() / 0.7, -1).gather(-1, ids[:, p_w:, None])[..., 0]
    assert rows[:-1] == ([1, t_w + 1] if shared else [t_w + 1]) and t_w + 1 < ids.shape[1] / 2  # the last: full logits above
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)


def test_grpo_skips_uniform_groups_and_can_reuse_sampler_logps(tiny_cfg):
    """skip_uniform_groups: groups whose rewards are all equal never reach the update (nor the experience
    table); logp_old: rollout takes the sampler's log-probs, which match a recomputed forward. The first run
    is the default profile's GRPO path: LoRA adapters, the sampler's logp_old, uniform groups skipped.
    Its adapters ask for dropout 0.5, which the loop must switch off: with one minibatch and one epoch the
    update sees the very policy that sampled: the ratio pi / pi_old is 1."""
    cfg = rl_cfg(tiny_cfg, "grpo", "grpo.iterations=2", "grpo.prompts_per_iteration=6", "grpo.group_size=4",
                 "grpo.minibatch_size=24", "grpo.skip_uniform_groups=true", "grpo.logp_old=rollout",
                 "grpo.reward_function=reward_fns:uniform_on_sums", "grpo.lora.enabled=true", "grpo.lora.dropout=0.5",
                 "grpo.learning_rate=1e-2")  # adapters that matter by iteration 2 (B starts at zero)
    execute_stage(cfg, "grpo")
    store = ArtifactStore(cfg.storage)
    metrics = store.read_table(store.stage_path(cfg.run.name, "grpo", "metrics.parquet"), METRICS_SCHEMA).to_pylist()
    for it in (1, 2):
        exp = store.read_table(store.stage_path(cfg.run.name, "grpo", "experience", f"iter-{it:06d}.parquet"),
                               EXPERIENCE_SCHEMA).to_pylist()
        assert exp and all("+" not in r["prompt"] for r in exp)  # no addition (uniform group) trained
        assert len(exp) % 4 == 0 and len(exp) < 24
        fraction = next(r["value"] for r in metrics if r["step"] == it and r["name"] == "trained_fraction")
        assert fraction == len(exp) / 24
        assert all(r["logp_old"] == r["logp_rollout"] for r in exp)
        ratio = next(r["value"] for r in metrics if r["step"] == it and r["name"] == "ratio_mean")
        assert ratio == pytest.approx(1.0, abs=1e-3)
    # the same first iteration with logp_old recomputed: the sampler's numbers equal a full forward's, so
    # the sampler correction (TIS/MIS) weighs every trained token about 1 (HF sampler = trainer here)
    again = rl_cfg(tiny_cfg, "grpo", "grpo.iterations=1", "grpo.prompts_per_iteration=6", "grpo.group_size=4",
                   "grpo.minibatch_size=8", "grpo.skip_uniform_groups=true", "run.name=recompute",
                   "grpo.reward_function=reward_fns:uniform_on_sums", "grpo.sampler_correction=sequence_mask")
    execute_stage(again, "grpo")
    m = store.read_table(store.stage_path("recompute", "grpo", "metrics.parquet"), METRICS_SCHEMA).to_pylist()
    assert next(r["value"] for r in m if r["name"] == "logp_mismatch_max") < 1e-3
    assert next(r["value"] for r in m if r["name"] == "sampler_weight_mean") == pytest.approx(1.0, abs=0.05)


def test_an_iteration_with_only_uniform_groups_still_checkpoints_and_resumes(tiny_cfg, monkeypatch):
    """Skipped iterations (every group uniform, no update) end like trained ones: progress, the periodic
    checkpoint and the crash hook; a rerun resumes after the checkpoint."""
    cfg = rl_cfg(tiny_cfg, "grpo", "grpo.iterations=3", "grpo.save_every=1", "grpo.prompts_per_iteration=2",
                 "grpo.group_size=4", "grpo.minibatch_size=8", "grpo.skip_uniform_groups=true",
                 "grpo.reward_function=reward_fns:constant")
    store = ArtifactStore(cfg.storage)
    monkeypatch.setenv(CRASH_ENV, "grpo:2")
    with pytest.raises(InjectedCrash, match="after iteration 2"):
        execute_stage(cfg, "grpo")
    monkeypatch.delenv(CRASH_ENV)
    m = execute_stage(cfg, "grpo")
    assert m["status"] == "resumed" and m["resumed_from_step"] == 2
    rows = store.read_table(store.stage_path(cfg.run.name, "grpo", "metrics.parquet"), METRICS_SCHEMA).to_pylist()
    assert sorted({r["step"] for r in rows if r["name"] == "trained_fraction"}) == [1, 2, 3]
    assert all(r["value"] == 0.0 for r in rows if r["name"] == "trained_fraction")


def test_refill_samples_fresh_prompts_until_the_groups_are_informative(tiny_cfg):
    """refill_rounds: groups dropped as uniform (here every addition) are replaced by groups of prompts the
    iteration has not drawn, up to prompts_per_iteration informative groups; none is trained twice."""
    common = ("grpo.iterations=1", "grpo.prompts_per_iteration=6", "grpo.group_size=4", "grpo.minibatch_size=8",
              "grpo.skip_uniform_groups=true", "grpo.reward_function=reward_fns:uniform_on_sums", "data.rl_size=64")
    trained = {}
    for rounds in (0, 3):
        cfg = rl_cfg(tiny_cfg, "grpo", *common, f"grpo.refill_rounds={rounds}", f"run.name=refill{rounds}")
        execute_stage(cfg, "grpo")
        store = ArtifactStore(cfg.storage)
        exp = store.read_table(store.stage_path(cfg.run.name, "grpo", "experience", "iter-000001.parquet"),
                               EXPERIENCE_SCHEMA).to_pylist()
        assert all("+" not in r["prompt"] for r in exp)  # still no uniform group trained
        groups = [r["prompt_id"] for r in exp[::4]]
        assert len(groups) == len(set(groups)) and all(len({r["prompt_id"] for r in exp[i:i + 4]}) == 1 for i in range(0, len(exp), 4))
        trained[rounds] = len(groups)
    assert trained[0] < 6 and trained[0] < trained[3] <= 6
    with pytest.raises(ConfigError, match="refill_rounds: refills the groups skip_uniform_groups drops"):
        rl_cfg(tiny_cfg, "grpo", "grpo.refill_rounds=2", "grpo.skip_uniform_groups=false")


def test_grpo_init_from_dpo_starts_from_the_dpo_policy(tiny_cfg, monkeypatch):
    """grpo.init_from: dpo (SFT -> DPO -> RLVR): the loop loads the DPO stage's model as its policy and
    reference, and DPO's key is part of GRPO's inputs."""
    import rlhf.train.rl_loop as rl

    cfg = tiny_cfg(*only("sft", "ref_logprobs", "dpo", "grpo"), *ONLY_RL, "grpo.init_from=dpo", "grpo.iterations=1",
                   "grpo.prompts_per_iteration=2", "grpo.group_size=4", "grpo.minibatch_size=8", "grpo.eval_prompts=0")
    for stage in ("sft", "ref_logprobs"):
        execute_stage(cfg, stage)
    dpo = execute_stage(cfg, "dpo")
    loaded = []
    real = rl.load_policy
    monkeypatch.setattr(rl, "load_policy", lambda c, init, resume, m, seed: loaded.append(init) or real(c, init, resume, m, seed))
    grpo = execute_stage(cfg, "grpo")
    assert len(loaded) == 1 and Path(loaded[0]).parts[-2:] == ("dpo", "model")
    assert grpo["inputs"] == {"dpo": dpo["key"]}  # it reads DPO's policy, not SFT's (whose key is in DPO's)


def test_grpo_rewarded_by_an_implicit_reward_model_gets_its_log_likelihoods(tiny_cfg):
    """reward_source: reward_model with reward_model.kind: implicit (a causal LM, no head): each sample's
    reward is that model's summed log-prob of the response given the prompt, the number eval's judge uses."""
    from rlhf.data.tasks import assistant, user
    from rlhf.train.rewards import load_reward_model, reward_model_scores

    cfg = tiny_cfg(*only("reward_model", "grpo"), *ONLY_RL, "reward_model.init_from=base", "reward_model.kind=implicit",
                   "reward_model.max_steps=2", "grpo.reward_source=reward_model", "grpo.beta=0.1", "grpo.iterations=1",
                   "grpo.prompts_per_iteration=2", "grpo.group_size=4", "grpo.minibatch_size=8", "grpo.eval_prompts=0")
    execute_stage(cfg, "reward_model")
    execute_stage(cfg, "grpo")
    store = ArtifactStore(cfg.storage)
    exp = store.read_table(store.stage_path(cfg.run.name, "grpo", "experience", "iter-000001.parquet"),
                           EXPERIENCE_SCHEMA).to_pylist()
    model, tok = load_reward_model(str(Path(cfg.storage.url) / cfg.run.name / "reward_model" / "model"), "float32")
    want = reward_model_scores(model, tok, [[user(r["prompt"]), assistant(r["response"])] for r in exp])
    assert len(exp) == 8 and all(w < 0 for w in want)  # log-likelihoods
    assert [r["reward"] for r in exp] == pytest.approx(want, abs=1e-4)
