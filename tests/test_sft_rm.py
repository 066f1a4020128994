"""SFT and reward-model stages on the tiny profile: learning happens, crashes resume from the last
checkpoint, and content keys decide what reruns."""

from __future__ import annotations

import json

import pyarrow.compute as pc
import pytest
from safetensors.torch import load_file

from conftest import only
from rlhf.pipeline.runner import execute_stage
from rlhf.core.store import ArtifactStore
from rlhf.train.training import CRASH_ENV, InjectedCrash
from rlhf.core.tables import METRICS_SCHEMA


def metric_series(cfg, stage: str, name: str) -> list[tuple[int, float]]:
    store = ArtifactStore(cfg.storage)
    table = store.read_table(store.stage_path(cfg.run.name, stage, "metrics.parquet"), METRICS_SCHEMA)
    rows = table.filter(pc.equal(table["name"], name)).to_pylist()
    return [(r["step"], r["value"]) for r in rows]


def test_sft_loss_goes_down_and_outputs_are_complete(tiny_cfg):
    cfg = tiny_cfg(*only("sft"), "sft.max_steps=12")
    m = execute_stage(cfg, "sft")
    assert m["status"] == "ran" and m["rows"]["train"] == 64
    losses = [v for _, v in metric_series(cfg, "sft", "loss")]
    assert len(losses) >= 4
    assert losses[-1] < losses[0] - 0.5, losses  # tiny model, lr 1e-3: about 10.8 -> 9.9 in 12 steps
    store = ArtifactStore(cfg.storage)
    files = {p.rsplit("/", 1)[-1] for p in store.fs.find(store.stage_path("tiny", "sft", "model"))}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files
    assert not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    assert not store.fs.exists(store.stage_path("tiny", "sft", "checkpoints"))  # dropped once complete
    from rlhf.core.models import home

    assert not (home() / "work" / "tiny" / f"sft-{m['key'][:16]}").exists()  # local scratch too
    for key in ("key", "code_version", "packages", "seed", "rows", "timings", "inputs"):
        assert key in m
    assert m["timings"]["peak_rss_mb"] >= m["timings"]["start_rss_mb"] > 0


def separable_pairs(path, n: int) -> str:
    """Chosen replies are always 'yes ...', rejected ones 'no ...': separable by construction."""
    rows = []
    for i in range(n):
        prompt = [{"role": "user", "content": f"Question {i}: is {i} + {i} equal to {2 * i}?"}]
        rows.append({
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": f"yes yes, {2 * i}"}],
            "rejected": [{"role": "assistant", "content": f"no no, {2 * i + 1}"}],
        })
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_reward_model_learns_a_separable_preference(tiny_cfg, tmp_path):
    prefs = separable_pairs(tmp_path / "prefs.jsonl", 96)
    cfg = tiny_cfg(
        f"data.prefs_path={prefs}", *only("reward_model"), "reward_model.init_from=base", "reward_model.kind=classifier",
        "reward_model.max_steps=30", "reward_model.learning_rate=3e-3", "reward_model.eval_fraction=0.25",
        "reward_model.save_steps=100",
    )
    m = execute_stage(cfg, "reward_model")
    assert m["rows"] == {"train_pairs": 72, "eval_pairs": 24, "dropped": 0}
    assert m["metrics"]["reward_model/eval_accuracy"] >= 0.9, m["metrics"]
    assert m["metrics"]["reward_model/eval_margin"] > 0


def lora_reward_model_crashed_and_resumed(tiny_cfg, tmp_path, monkeypatch, *extra: str):
    """A LoRA reward model on separable pairs, crashed at step 15 and resumed from its step-10 checkpoint;
    checks it resumed there, ran all 30 steps and learnt (held-out >= 0.9). Returns (cfg, manifest)."""
    prefs = separable_pairs(tmp_path / "prefs.jsonl", 96)
    cfg = tiny_cfg(
        f"data.prefs_path={prefs}", *only("reward_model"), "reward_model.init_from=base", "reward_model.lora.enabled=true",
        "reward_model.max_steps=30", "reward_model.learning_rate=1e-2", "reward_model.eval_fraction=0.25",
        "reward_model.save_steps=10", *extra,
    )
    monkeypatch.setenv(CRASH_ENV, "reward_model:15")
    with pytest.raises(InjectedCrash):
        execute_stage(cfg, "reward_model")
    monkeypatch.delenv(CRASH_ENV)
    m = execute_stage(cfg, "reward_model")
    assert m["status"] == "resumed" and m["resumed_from_step"] == 10 and m["metrics"]["reward_model/steps"] == 30
    assert m["metrics"]["reward_model/eval_accuracy"] >= 0.9, m["metrics"]
    return cfg, m


def test_lora_reward_model_learns_resumes_and_publishes_merged_weights(tiny_cfg, tmp_path, monkeypatch):
    """A classifier reward model as rank-16 adapters plus the new scalar head (PEFT keeps the head fully
    trainable for SEQ_CLS), resumed from a Trainer checkpoint of adapters, published merged."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForSequenceClassification

    from rlhf.core.models import resolve_model

    cfg, _ = lora_reward_model_crashed_and_resumed(tiny_cfg, tmp_path, monkeypatch, "reward_model.kind=classifier")
    store = ArtifactStore(cfg.storage)
    folder = store.get_dir(store.stage_path("tiny", "reward_model", "model"), tmp_path / "rm")
    weights = load_file(str(folder / "model.safetensors"))
    assert "score.weight" in weights and not any("lora" in k for k in weights), sorted(weights)[:5]
    model = AutoModelForSequenceClassification.from_pretrained(folder)  # a plain model for eval and PPO
    assert not hasattr(model, "peft_config") and model.score.weight.shape[0] == 1
    start = load_file(str(Path(resolve_model(cfg.model)) / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(weights[q], start[q])  # the adapters' update is merged into the backbone
    assert torch.equal(weights["model.embed_tokens.weight"], start["model.embed_tokens.weight"])  # not adapted


def test_implicit_reward_model_learns_resumes_and_scores_its_own_log_likelihood(tiny_cfg, tmp_path, monkeypatch):
    """reward_model.kind: implicit (the default profile's): no head; the reward is the LM's summed log-prob of
    the reply, fit by reference-free DPO. It learns, resumes from an adapter checkpoint, publishes a plain
    causal LM, and scores exactly the completion log-probs the reference cache's code computes."""
    import torch

    from rlhf.core.models import load_tokenizer
    from rlhf.engines.logprobs import pair_logps, tokenize_pair
    from rlhf.train.rewards import load_reward_model, reward_model_scores

    cfg, m = lora_reward_model_crashed_and_resumed(tiny_cfg, tmp_path, monkeypatch, "reward_model.kind=implicit")
    assert m["rows"] == {"train_pairs": 72, "eval_pairs": 24, "dropped": 0}
    store = ArtifactStore(cfg.storage)
    folder = store.get_dir(store.stage_path("tiny", "reward_model", "model"), tmp_path / "rm")
    weights = load_file(str(folder / "model.safetensors"))
    assert "score.weight" not in weights and not any("lora" in k for k in weights), sorted(weights)[:5]
    model, tok = load_reward_model(str(folder), "float32")
    assert type(model).__name__.endswith("ForCausalLM")
    rows = [json.loads(line) for line in open(cfg.data.prefs_path)][:6]
    got_c = reward_model_scores(model, tok, [r["prompt"] + r["chosen"] for r in rows])
    got_r = reward_model_scores(model, tok, [r["prompt"] + r["rejected"] for r in rows])
    want = pair_logps(model, load_tokenizer(str(folder)), [tokenize_pair(tok, r) for r in rows], 128, 4)
    assert torch.allclose(torch.tensor(got_c, dtype=torch.float64), want.chosen, atol=1e-4)
    assert torch.allclose(torch.tensor(got_r, dtype=torch.float64), want.rejected, atol=1e-4)
    assert all(c > r for c, r in zip(got_c, got_r))


def test_a_reward_model_that_is_neither_classifier_nor_causal_lm_is_refused(tmp_path):
    from rlhf.train.rewards import load_reward_model

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    with pytest.raises(ValueError, match=r"architectures \['BertModel'\], neither a sequence classifier"):
        load_reward_model(str(tmp_path), "float32")


def test_the_reward_model_does_not_depend_on_what_ran_before_it_in_the_process(tmp_path):
    # In `rlhf run` every stage shares one process: the new scalar head must not take its initial weights
    # from whatever RNG state earlier stages left (the same key must give the same model in a fresh worker).
    import torch
    from conftest import CONFIG
    from rlhf.core.loader import load_config

    prefs = separable_pairs(tmp_path / "prefs.jsonl", 16)
    models = []
    for name, draws in (("fresh", 0), ("after", 1000)):
        torch.rand(draws)  # what an earlier stage would consume
        cfg = load_config(CONFIG, "tiny", [f"storage.url={tmp_path / name}", f"data.prefs_path={prefs}", *only("reward_model"),
                                           "reward_model.init_from=base", "reward_model.kind=classifier", "reward_model.max_steps=2",
                                           "reward_model.eval_fraction=0.25"])
        execute_stage(cfg, "reward_model")
        models.append(load_file(str(tmp_path / name / "tiny" / "reward_model" / "model" / "model.safetensors")))
    assert models[0].keys() == models[1].keys()
    for k in models[0]:
        assert torch.equal(models[0][k], models[1][k]), k


def test_crash_after_checkpoint_resumes_from_it(tiny_cfg, tmp_path, monkeypatch):
    common = (*only("sft"), "sft.max_steps=8", "sft.save_steps=4", "sft.eval_prompts=0")
    cfg = tiny_cfg(*common)
    store = ArtifactStore(cfg.storage)
    monkeypatch.setenv(CRASH_ENV, "sft:6")
    with pytest.raises(InjectedCrash):
        execute_stage(cfg, "sft")
    assert store.read_manifest("tiny", "sft") is None  # no manifest after the crash
    assert store.fs.exists(store.stage_path("tiny", "sft", "checkpoints", "checkpoint-4", ".complete"))

    monkeypatch.delenv(CRASH_ENV)
    m = execute_stage(cfg, "sft")
    assert m["status"] == "resumed" and m["resumed_from_step"] == 4
    assert m["metrics"]["sft/steps"] == 8
    steps = [s for s, _ in metric_series(cfg, "sft", "loss")]
    assert min(steps) > 4  # the resumed run logged only steps after the checkpoint
    assert execute_stage(cfg, "sft")["status"] == "skipped"

    # An uninterrupted run ends at the same weights: optimizer, scheduler, RNG and data order restored.
    straight = tiny_cfg(*common, storage=str(tmp_path / "straight"))
    execute_stage(straight, "sft")
    a = load_file(ArtifactStore(cfg.storage).get_dir(store.stage_path("tiny", "sft", "model"), tmp_path / "a") / "model.safetensors")
    s2 = ArtifactStore(straight.storage)
    b = load_file(s2.get_dir(s2.stage_path("tiny", "sft", "model"), tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() < 1e-5, k


def test_changed_key_reruns_the_stage_and_downstream_only(tiny_cfg):
    from flows.rlhf_flow import complete_key  # the orchestrating flow's own skip check (rlhf/full)

    def complete(c, stage):
        store = ArtifactStore(c.storage)
        return complete_key(store, c, stage, store.read_manifest(c.run.name, stage))

    cfg = tiny_cfg(*only("sft", "reward_model"))
    assert complete(cfg, "sft") is None  # nothing there yet
    first = {s: execute_stage(cfg, s) for s in ("sft", "reward_model")}
    assert [m["status"] for m in first.values()] == ["ran", "ran"]
    assert [complete(cfg, s) for s in first] == [m["key"] for m in first.values()]

    rm_only = tiny_cfg(*only("sft", "reward_model"), "reward_model.learning_rate=5e-4")
    assert complete(rm_only, "sft") == first["sft"]["key"] and complete(rm_only, "reward_model") is None
    assert execute_stage(rm_only, "sft")["status"] == "skipped"
    assert execute_stage(rm_only, "reward_model")["status"] == "ran"

    sft_changed = tiny_cfg(*only("sft", "reward_model"), "reward_model.learning_rate=5e-4", "sft.learning_rate=2e-3")
    assert complete(sft_changed, "sft") is None
    m_sft = execute_stage(sft_changed, "sft")
    m_rm = execute_stage(sft_changed, "reward_model")
    assert m_sft["status"] == "ran" and m_sft["key"] != first["sft"]["key"]
    assert m_rm["status"] == "ran" and m_rm["inputs"]["sft"] == m_sft["key"]
    ArtifactStore(sft_changed.storage).clear_stage(sft_changed.run.name, "sft")
    assert complete(sft_changed, "reward_model") is None  # an input gone: the stage run reports it, not the flow


def test_sft_trainer_projects_only_completion_tokens_with_the_same_loss(tmp_path, monkeypatch):
    """The SFT stage's trainer sends only the loss's tokens through the vocabulary projection on the CPU
    (TRL projects every position there): same per-step losses as TRL's SFTTrainer, far fewer rows."""
    import torch
    import trl.trainer.utils as trl_utils
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from rlhf.core.config import ModelConfig
    from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model
    from stages.sft import CompletionScoredSFTTrainer

    path = resolve_model(ModelConfig(name="tiny"))
    tok = load_tokenizer(path)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "completion": [{"role": "assistant", "content": str(2 * i)}]} for i in range(8)]
    projected = []
    real_apply = trl_utils._ChunkedLogProbFunction.apply
    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply",
                        lambda hidden, *a: projected.append(hidden.shape[0]) or real_apply(hidden, *a))
    runs = {}
    for cls in (SFTTrainer, CompletionScoredSFTTrainer):
        torch.manual_seed(0)
        args = SFTConfig(output_dir=str(tmp_path / cls.__name__), max_steps=2, per_device_train_batch_size=4,
                         learning_rate=1e-3, report_to=[], use_cpu=True, bf16=False, completion_only_loss=True,
                         logging_steps=1, save_strategy="no", disable_tqdm=True)
        trainer = cls(model=load_causal_lm(path, ModelConfig(name="tiny")), args=args,
                      train_dataset=Dataset.from_list(rows), processing_class=tok)
        trainer.train()
        runs[cls] = ([h["loss"] for h in trainer.state.log_history if "loss" in h], list(projected))
        projected.clear()
    (theirs, their_rows), (ours, our_rows) = runs[SFTTrainer], runs[CompletionScoredSFTTrainer]
    assert len(ours) == 2 and ours == pytest.approx(theirs, abs=1e-5)
    assert len(our_rows) == 2 and all(o * 5 < t for o, t in zip(our_rows, their_rows))


def test_demonstrations_whose_prompt_fills_max_length_are_named_before_training():
    """TRL would drop such a row silently (nothing left to learn after truncation); with every row gone the
    Trainer fails on an empty sampler. Counted by hand: the tiny tokenizer's chat template around 'hi'."""
    import logging

    from rlhf.core.config import TinyModelConfig
    from rlhf.core.models import load_tokenizer, tiny_model_dir
    from rlhf.data.userdata import DataError
    from stages.sft import fit_prompts, prompt_tokens

    tok = load_tokenizer(str(tiny_model_dir(TinyModelConfig())))
    short = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "4"}]}
    n = prompt_tokens(tok, short["prompt"])
    assert n == len(tok(tok.apply_chat_template(short["prompt"], tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"]) and n > 3
    long = {**short, "prompt": [{"role": "user", "content": "hi " * 50}]}
    log = logging.getLogger("test")
    assert fit_prompts([short, long], tok, n + 1, "drop", log) == ([short], 1)
    with pytest.raises(DataError, match=r"1 of 2 SFT demonstrations are unusable \(data.on_bad_row: fail; raise "
                                        rf"sft.max_length\):\n  row 2: its prompt is \d+ tokens, sft.max_length is {n + 1}"):
        fit_prompts([short, long], tok, n + 1, "fail", log)
    with pytest.raises(DataError, match=r"2 of 2 SFT demonstrations are unusable \(none left"):
        fit_prompts([short, long], tok, n, "drop", log)
    assert fit_prompts([{"text": "no prompt"}], tok, 8, "fail", log) == ([{"text": "no prompt"}], 0)
