"""One leaderboard across runs and models: eval policies may name another run's stage or any model; answers
are kept per (weights, prompts, sampling settings) and reused, so adding a policy generates only its own;
`rlhf leaderboard` rates every policy the store keeps and `rlhf query` reads it."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import CONFIG, run_cli
from rlhf.core.config import StorageConfig, TinyModelConfig
from rlhf.core.models import tiny_model_dir
from rlhf.core.store import ArtifactStore
from rlhf.ops import leaderboard

OFF = ["preferences.enabled=false", "reward_model.enabled=false", "ref_logprobs.enabled=false", "dpo.enabled=false",
       "grpo.enabled=false", "eval.enabled=true", "eval.judge=verifier"]


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def run(store, name: str, *overrides: str) -> dict:
    done = run_cli("run", "--profile", "tiny", "--run-name", name, *sets(f"storage.url={store}", *OFF, *overrides))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((store / name / "eval" / "manifest.json").read_text())


@pytest.mark.slow  # three tiny runs through the CLI
def test_three_runs_one_leaderboard_and_a_fourth_policy_generates_only_its_answers(tmp_path):
    store = tmp_path / "store"
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir(TinyModelConfig()), other)
    a = run(store, "a", "eval.policies=[base, sft]")
    assert a["rows"]["answers_generated"] == 16 and a["rows"]["answers_reused"] == 0
    b = run(store, "b", "sft.learning_rate=2e-3", "eval.policies=[base, sft]")
    assert b["rows"]["answers_generated"] == 8 and b["rows"]["answers_reused"] == 8  # the same base on the same prompts
    c = run(store, "c", "sft.enabled=false", f"eval.policies=[base, a/sft, b/sft, 'model:{other}']", "eval.anchor=base")
    assert c["rows"]["answers_generated"] == 8 and c["rows"]["answers_reused"] == 24  # the fourth policy's alone
    assert set(c["inputs"]) == {"a/sft", "b/sft"} and c["inputs"]["a/sft"] == json.loads(
        (store / "a" / "sft" / "manifest.json").read_text())["key"]  # another run's stage is an input of the key

    board = run_cli("leaderboard", "--format", "json", "--rounds", "100", *sets(f"storage.url={store}"))
    assert board.returncode == 0, board.stderr
    rows = json.loads(board.stdout)
    assert {r["policy"] for r in rows} == {"base:tiny", "a/sft", "b/sft", f"model:{other}"}
    assert len({r["prompt_set"] for r in rows}) == 1 and all(r["answers"] == 8 and r["battles"] == 24 for r in rows)
    assert {r["run"] for r in rows} == {"a", "b", "c"}  # the runs that generated them
    queried = run_cli("query", "--format", "json", *sets(f"storage.url={store}"),
                      "SELECT policy, lc_elo, accuracy FROM leaderboard ORDER BY policy")
    assert [r["policy"] for r in json.loads(queried.stdout)] == sorted(r["policy"] for r in rows)


@pytest.mark.parametrize("policy, expected", [
    ("nope/sft", "eval.policies: 'nope/sft': run 'nope' has no complete sft stage in the store"),
    ("model:/no/such/folder", "eval.policies: 'model:/no/such/folder': no model folder there (no config.json)"),
    ("../x/sft", "invalid run name '..'"),
    ("a/reward_model", "'a/reward_model': 'reward_model' is not a policy stage"),
    ("gpt4", "'gpt4' is not a policy: base, sft, dpo, kto, ppo, grpo, <run>/<stage>"),
])
def test_an_eval_policy_that_does_not_exist_is_refused_before_anything(tmp_path, policy, expected):
    store = tmp_path / "store"
    proc = run_cli("validate", "-c", str(CONFIG), "--profile", "tiny",
                   *sets(f"storage.url={store}", *OFF, "sft.enabled=true", f"eval.policies=[sft, '{policy}']",
                         "eval.anchor=sft"))
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not store.exists()


def test_entries_are_checked_and_a_shared_name_keeps_both(tmp_path):
    store = ArtifactStore(StorageConfig(url=str(tmp_path)))
    meta = {"run": "r", "params": {"n": 1}, "prompt_set": "0" * 16, "verified": True}
    for key, policy in (("a" * 64, "r/sft"), ("b" * 64, "r/sft"), ("c" * 64, "base:m")):
        store.write_json(store.path("_cache", "answers", key, "manifest.json"), {**meta, "policy": policy})
    store.write_json(store.path("_cache", "answers", "d" * 64, "manifest.json"), {**meta, "policy": 7})  # hostile
    store.write_json(store.path("_cache", "answers", "e" * 64, "manifest.json"), {**meta, "policy": "x", "verified": False})
    found = leaderboard.entries(store)
    assert {e["key"][0] for e in found} == {"a", "b", "c", "e"}  # d is skipped
    grouped = leaderboard.groups(found)
    [(_, members)] = grouped.items()  # open-ended (unverified) answers are not rated
    assert [m["policy"] for m in members] == ["base:m", "r/sft@aaaaaaaa", "r/sft@bbbbbbbb"]
