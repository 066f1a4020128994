"""On-policy preference pairs: the pair builder by hand, the stage on the tiny profile (schema, provenance,
ties), the stages downstream reading its pairs, content keys that follow the SFT key, config refusals,
and the reward model's accuracy split by length."""

from __future__ import annotations

import pytest

from conftest import only
from rlhf.core.loader import ConfigError
from rlhf.data.pairs import build_pairs, contrast_pairs
from rlhf.core.registry import SPECS
from rlhf.pipeline.preflight import predicted_keys
from rlhf.pipeline.runner import execute_stage
from rlhf.core.store import ArtifactStore
from stages.reward_model import accuracy_by_length
from rlhf.core.tables import PAIRS_SCHEMA

PAIR_STAGES = ("sft", "preferences", "reward_model", "ref_logprobs", "dpo")


def test_build_pairs_by_hand():
    # scores [1, 0, 1, 0.5]: the first best (0) vs the first worst (1)
    assert build_pairs([1.0, 0.0, 1.0, 0.5], "best_worst") == ([(0, 1)], 0)
    # every two answers with different scores, the higher first; (0, 2) is the one tie
    assert build_pairs([1.0, 0.0, 1.0, 0.5], "all_pairs") == ([(0, 1), (0, 3), (2, 1), (3, 1), (2, 3)], 1)
    assert build_pairs([0.0, 0.0, 0.0], "best_worst") == ([], 1)  # all equal: one tie, no pair
    assert build_pairs([0.0, 0.0, 0.0], "all_pairs") == ([], 3)
    assert build_pairs([0.2, 0.9], "best_worst") == ([(1, 0)], 0)
    with pytest.raises(ValueError, match="unknown mode"):
        build_pairs([0.0, 1.0], "best_of_n")


def test_contrast_pairs_by_hand():
    # policy best-first 1, 2, 3, 0; base 0 (score 0) vs policy 1 pairs; base 1 (score 1) ties policy 2:
    # unpaired, policy 2 stays free; base 2 (0.2) vs policy 2 pairs
    assert contrast_pairs([0.0, 1.0, 1.0, 0.5], [0.0, 1.0, 0.2]) == ([(1, 0), (2, 2)], 1)
    assert contrast_pairs([0.0, 0.0], [0.0, 0.0]) == ([], 2)  # the policy never beats the base model
    assert contrast_pairs([1.0], [0.0, 0.0]) == ([(0, 0)], 1)  # one policy answer is used once


def test_accuracy_by_length_by_hand():
    # correct: [2 > 1, 0 > 1, 1 > 1] = [1, 0, 0]; chosen longer only in pair 0, shorter only in pair 1
    out = accuracy_by_length([2.0, 0.0, 1.0], [1.0, 1.0, 1.0], [5, 1, 3], [2, 4, 3])
    assert out == {"accuracy": pytest.approx(1 / 3), "accuracy_chosen_longer": 1.0, "accuracy_chosen_shorter": 0.0}


def test_stage_writes_judged_pairs_that_downstream_stages_train_on(tiny_cfg):
    cfg = tiny_cfg(*only(*PAIR_STAGES))
    sft = execute_stage(cfg, "sft")
    prefs = execute_stage(cfg, "preferences")
    store = ArtifactStore(cfg.storage)
    table = store.read_table(store.stage_path(cfg.run.name, "preferences", "pairs.parquet"), PAIRS_SCHEMA)
    rows = table.to_pylist()
    n_prompts = cfg.data.train_size
    # best_worst: one pair or one tie per prompt
    assert prefs["rows"]["pairs"] + prefs["rows"]["pairs_ties"] == n_prompts and len(rows) == prefs["rows"]["pairs"] > 0
    assert cfg.preferences.contrast_samples == 1  # as the tiny profile: one base answer per training prompt
    assert prefs["rows"]["samples"] == (n_prompts + cfg.preferences.eval_prompts) * cfg.preferences.samples_per_prompt + n_prompts
    for r in rows:
        assert r["chosen_score"] > r["rejected_score"] and r["chosen_index"] != r["rejected_index"]
        assert r["policy_key"] == sft["key"] and r["judge"] == "function:rlhf.train.rewards:low_vocab_share"
        assert r["prompt"][0]["role"] == "user" and r["chosen"][0]["role"] == "assistant"
        assert r["pair_id"] == f"{r['prompt_id']}:{r['chosen_index']}:{r['rejected_index']}"
    assert prefs["inputs"] == {"sft": sft["key"]}

    rm = execute_stage(cfg, "reward_model")
    assert rm["inputs"].keys() == {"sft", "preferences"}
    # trained on every training pair and contrast pair, scored on the held-out prompts' pairs
    assert rm["rows"]["train_pairs"] == len(rows) + prefs["rows"]["contrast_pairs"]
    assert rm["rows"]["eval_pairs"] == prefs["rows"]["eval_pairs"]
    assert {"reward_model/eval_accuracy_chosen_longer", "reward_model/eval_accuracy_chosen_shorter"} <= rm["metrics"].keys()
    ref = execute_stage(cfg, "ref_logprobs")
    assert ref["rows"]["pairs"] == len(rows) and ref["inputs"].keys() == {"sft", "preferences"}
    dpo = execute_stage(cfg, "dpo")
    assert dpo["rows"]["train_pairs"] == len(rows)


def test_contrast_pairs_train_the_reward_model_only(tiny_cfg):
    """With contrast_samples 2 the base model answers every training prompt twice; each base answer the
    judge scores below one of the policy's becomes a contrast pair (chosen: that policy answer), which the
    reward model trains on besides the on-policy pairs, and DPO does not."""
    import pyarrow.parquet as pq

    cfg = tiny_cfg(*only(*PAIR_STAGES), "preferences.contrast_samples=2")
    execute_stage(cfg, "sft")
    prefs = execute_stage(cfg, "preferences")
    store = ArtifactStore(cfg.storage)
    path = lambda name: store.stage_path(cfg.run.name, "preferences", name)  # noqa: E731
    contrast = store.read_table(path("contrast_pairs.parquet"), PAIRS_SCHEMA).to_pylist()
    with store.fs.open(path("samples.parquet"), "rb") as f:
        samples = pq.read_table(f).to_pylist()
    by_split = {(s["split"], s["prompt_id"], s["sample_index"]): s for s in samples}
    n_train = cfg.data.train_size
    assert prefs["rows"]["samples"] == len(samples) == (
        (n_train + cfg.preferences.eval_prompts) * cfg.preferences.samples_per_prompt + 2 * n_train)
    assert set(prefs["outputs"]) == {a.name for a in SPECS["preferences"].outputs}  # contrast_pairs too
    assert len(contrast) == prefs["rows"]["contrast_pairs"] > 0
    assert len(contrast) + prefs["rows"]["contrast_pairs_unpaired"] == 2 * n_train
    for r in contrast:
        chosen = by_split["train", r["prompt_id"], r["chosen_index"]]
        rejected = by_split["contrast", r["prompt_id"], r["rejected_index"]]  # the base model's answer
        assert (r["chosen"][0]["content"], r["rejected"][0]["content"]) == (chosen["response"], rejected["response"])
        assert r["chosen_score"] == chosen["score"] > r["rejected_score"] == rejected["score"]
        assert r["pair_id"] == f"{r['prompt_id']}:{r['chosen_index']}:base{r['rejected_index']}" and r["policy"] == "sft+base"
    rm = execute_stage(cfg, "reward_model")
    assert rm["rows"]["train_pairs"] == prefs["rows"]["pairs"] + len(contrast)
    execute_stage(cfg, "ref_logprobs")
    assert execute_stage(cfg, "dpo")["rows"]["train_pairs"] == prefs["rows"]["pairs"]


def test_pairs_key_follows_the_sft_key_and_reaches_downstream(tiny_cfg):
    base = predicted_keys(tiny_cfg(*only(*PAIR_STAGES)))
    other_sft = predicted_keys(tiny_cfg(*only(*PAIR_STAGES), "sft.learning_rate=2e-3"))
    other_judge = predicted_keys(tiny_cfg(*only(*PAIR_STAGES), "preferences.pairing=all_pairs"))
    assert all(other_sft[s] != base[s] for s in PAIR_STAGES)
    assert other_judge["sft"] == base["sft"]
    assert all(other_judge[s] != base[s] for s in ("preferences", "reward_model", "ref_logprobs", "dpo"))
    contrast = predicted_keys(tiny_cfg(*only(*PAIR_STAGES), "preferences.contrast_samples=0"))
    assert contrast["sft"] == base["sft"] and all(contrast[s] != base[s] for s in ("preferences", "reward_model"))
    # without the stage, the pair-trained stages read the task's pairs: keys without a preferences input
    off = predicted_keys(tiny_cfg(*only("sft", "reward_model", "ref_logprobs", "dpo")))
    assert "preferences" not in off and off["reward_model"] != base["reward_model"]


@pytest.mark.parametrize("overrides, message", [
    (["data.prefs_path=/tmp/pairs.jsonl"], "preferences.enabled: data.prefs_path is set too"),
    (["sft.enabled=false"], "preferences.policy: 'sft' needs sft.enabled: true"),
    (["preferences.judge=verifier"], "reward_function: set it exactly when judge is 'function'"),
    (["preferences.reward_model_path=/tmp/rm"], "reward_model_path: set it exactly when judge is 'reward_model'"),
    (["preferences.eval_prompts=100"], "preferences.eval_prompts: at most data.eval_size"),
    (["preferences.samples_per_prompt=1"], "preferences.samples_per_prompt"),
    (["preferences.policy=base", "preferences.contrast_samples=1"], "contrast_samples: contrasts the SFT policy"),
    (["preferences.contrast_samples=-1"], "preferences.contrast_samples"),
])
def test_bad_preferences_config_names_the_key(tiny_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tiny_cfg(*only("sft", "preferences"), *overrides)


def test_rl_keys_follow_the_rollout_settings_they_sample_with(tiny_cfg):
    """The RL loop samples with `rollout.*`: changing the temperature must rerun GRPO, not skip it."""
    base = predicted_keys(tiny_cfg(*only("sft", "grpo")))
    hotter = predicted_keys(tiny_cfg(*only("sft", "grpo"), "rollout.temperature=0.9"))
    assert hotter["sft"] == base["sft"] and hotter["grpo"] != base["grpo"]


def test_all_pairs_capped_per_prompt_by_hand():
    """Scores [1, 0, 1, 0.5] give five pairs in all_pairs order; a cap of 2 keeps (0, 1) and (0, 3)."""
    from types import SimpleNamespace

    from rlhf.core.config import PreferencesConfig
    from rlhf.data.tasks import Problem
    from rlhf.train.onpolicy import pair_rows

    problem = Problem("train-0", "1 + 1 =", "2", {})
    group = [(SimpleNamespace(text=t), s) for t, s in (("2", 1.0), ("3", 0.0), ("2", 1.0), ("2.5", 0.5))]
    cfg = PreferencesConfig(enabled=True, pairing="all_pairs", max_pairs_per_prompt=2)
    rows, ties = pair_rows([problem], [group], cfg, "verifier", cfg.policy, "k")
    assert [(r["chosen_index"], r["rejected_index"]) for r in rows] == [(0, 1), (0, 3)] and ties == 1
    assert [r["rejected"][0]["content"] for r in rows] == ["3", "2.5"]
    with pytest.raises(ValueError, match="max_pairs_per_prompt: caps pairing 'all_pairs'"):
        PreferencesConfig(max_pairs_per_prompt=2)
