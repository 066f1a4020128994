"""Iterative DPO (`dpo.rounds`): later rounds sample the previous round's policy on their own prompts and
use it as their reference; a crash in a later round resumes there and ends with the same model."""

from __future__ import annotations

import pytest
import torch

from conftest import only
from rlhf.core.models import load_causal_lm, load_tokenizer
from rlhf.core.store import ArtifactStore
from rlhf.data.tasks import Task
from rlhf.engines.logprobs import pair_logps, tokenize_pair
from rlhf.pipeline.runner import execute_stage
from rlhf.train.dpo_rounds import round_problems
from rlhf.train.training import CRASH_ENV, InjectedCrash
from rlhf.core.tables import PAIRS_SCHEMA, REF_LOGPS_SCHEMA, METRICS_SCHEMA

# 16 prompts a round, a fresh RL draw of 16 for round 2; tiny DPO: 6 steps a round, checkpoints every 3
ROUNDS = [*only("sft", "preferences", "ref_logprobs", "dpo"), "dpo.rounds=2", "preferences.prompts=16",
          "data.rl_size=16"]


def test_round_prompts_by_hand(tiny_cfg):
    task = Task(tiny_cfg("data.rl_size=32").data)
    assert [p.id for p in round_problems(task, 16, 32, 2)] == [f"rl-{i}" for i in range(16)]
    assert [p.id for p in round_problems(task, 16, 32, 3)] == [f"rl-{i}" for i in range(16, 32)]
    # no fresh draw: the training prompts again (Pang et al. 2024); preferences.prompts None means all of them
    cfg = tiny_cfg()
    assert round_problems(Task(cfg.data), cfg.preference_prompts(), 0, 3) == Task(cfg.data).train


def weights(path: str, cfg) -> dict[str, torch.Tensor]:
    return load_causal_lm(path, cfg.model).state_dict()


def run_rounds(cfg) -> tuple[dict, dict]:
    """(preferences manifest, dpo manifest)."""
    execute_stage(cfg, "sft")
    prefs = execute_stage(cfg, "preferences")
    execute_stage(cfg, "ref_logprobs")
    return prefs, execute_stage(cfg, "dpo")


def test_round_two_samples_the_round_one_policy_which_is_its_reference(tiny_cfg):
    cfg = tiny_cfg(*ROUNDS)
    prefs, m = run_rounds(cfg)
    store = ArtifactStore(cfg.storage)
    path = lambda *p: store.stage_path(cfg.run.name, "dpo", *p)  # noqa: E731
    metrics = m["metrics"]
    assert metrics["dpo/round_1/steps"] == 6 and metrics["dpo/round_2/steps"] == 6 and metrics["dpo/steps"] == 12
    pairs = store.read_table(path("rounds", "2", "pairs.parquet"), PAIRS_SCHEMA).to_pylist()
    assert len(pairs) == metrics["dpo/round_2/pairs"] == m["rows"]["train_pairs"] > 0
    assert metrics["dpo/round_1/pairs"] == prefs["rows"]["pairs"]
    assert {r["policy"] for r in pairs} == {"dpo-round-1"} and all(r["prompt_id"].startswith("rl-") for r in pairs)
    assert 0.0 <= metrics["dpo/round_2/score_mean"] <= 1.0 and "dpo/round_1/accuracy" in metrics

    # round 2's reference numbers are round 1's model scoring round 2's pairs, recomputed here
    round1 = path("rounds", "1", "model")
    ref = store.read_table(path("rounds", "2", "ref_logps.parquet"), REF_LOGPS_SCHEMA).to_pylist()
    tok = load_tokenizer(round1)
    tokenized = [tokenize_pair(tok, r) for r in pairs]
    with torch.inference_mode():
        out = pair_logps(load_causal_lm(round1, cfg.model), tok, tokenized, cfg.dpo.max_length, 8)
    assert [r["pair_id"] for r in ref] == [p.pair_id for p in tokenized]
    assert torch.allclose(torch.tensor([r["ref_chosen_logps"] for r in ref], dtype=torch.float64), out.chosen.double().reshape(-1), atol=1e-4)
    assert torch.allclose(torch.tensor([r["ref_rejected_logps"] for r in ref], dtype=torch.float64), out.rejected.double().reshape(-1), atol=1e-4)

    # one loss curve over both rounds, no step twice; the final model moved on from round 1's
    loss = [r["step"] for r in store.read_table(path("metrics.parquet"), METRICS_SCHEMA).to_pylist() if r["name"] == "loss"]
    assert loss == sorted(set(loss)) and loss[0] <= 2 and loss[-1] == 12 and any(6 < s < 12 for s in loss)
    final, first = weights(path("model"), cfg), weights(round1, cfg)
    assert any(not torch.equal(final[k], first[k]) for k in final)


@pytest.mark.slow
def test_crash_in_round_two_resumes_there_and_ends_with_the_same_model(tiny_cfg, monkeypatch):
    _, straight = run_rounds(tiny_cfg(*ROUNDS, "run.name=straight"))
    cfg = tiny_cfg(*ROUNDS, "run.name=crashed")
    store = ArtifactStore(cfg.storage)
    for stage in ("sft", "preferences", "ref_logprobs"):  # the same inputs: a copy of the straight run's
        store.fs.copy(store.stage_path("straight", stage), store.stage_path("crashed", stage), recursive=True)
        assert execute_stage(cfg, stage)["status"] == "skipped"
    monkeypatch.setenv(CRASH_ENV, "dpo:10")  # round 2's 4th step, after its checkpoint at stage step 9
    with pytest.raises(InjectedCrash):
        execute_stage(cfg, "dpo")
    path = lambda *p: store.stage_path(cfg.run.name, "dpo", *p)  # noqa: E731
    assert store.read_manifest(cfg.run.name, "dpo") is None and store.read_json(path("rounds", "1", "round.json"))
    sampled = store.fs.cat_file(path("rounds", "2", "pairs.parquet"))
    monkeypatch.delenv(CRASH_ENV)

    resumed = execute_stage(cfg, "dpo")
    assert resumed["resumed_from_step"] == 9
    assert store.fs.cat_file(path("rounds", "2", "pairs.parquet")) == sampled  # read back, not sampled again
    assert {k: v for k, v in resumed["metrics"].items() if "round_1" in k} == {
        k: v for k, v in straight["metrics"].items() if "round_1" in k}
    a = weights(path("model"), cfg)
    b = weights(store.stage_path("straight", "dpo", "model"), cfg)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
