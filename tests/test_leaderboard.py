"""One leaderboard across runs and models: eval policies may name another run's stage or any model; answers
are kept per (weights, prompts, sampling settings) and reused, so adding a policy generates only its own;
`rlhf leaderboard` rates every policy the store keeps and `rlhf query` reads it."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from conftest import CONFIG, IMPORT_TIMES, heavy_imports, run_cli
from rlhf.core.config import StorageConfig, TinyModelConfig
from rlhf.core.models import tiny_model_dir
from rlhf.core.store import ArtifactStore
from rlhf.engines import answers
from rlhf.engines.engine import Generation
from rlhf.ops import leaderboard
from rlhf.train.rewards import reward_model_scores

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
    # episodes are kept too, apart from single answers, and reused by a later eval on the same environment
    feedback = "eval.environment={name: feedback, max_turns: 2, max_tokens: 24}"
    d = run(store, "d", "sft.enabled=false", "eval.policies=[base, a/sft]", "eval.anchor=base", feedback)
    assert d["rows"]["answers_generated"] == 16 and d["rows"]["answers_reused"] == 0
    e = run(store, "e", "sft.enabled=false", "eval.policies=[base, a/sft, b/sft]", "eval.anchor=base", feedback)
    assert e["rows"]["answers_generated"] == 8 and e["rows"]["answers_reused"] == 16
    assert (json.loads((store / "e" / "eval" / "manifest.json").read_text())["metrics"]["eval/episode_turns/a/sft"]
            == d["metrics"]["eval/episode_turns/a/sft"])  # the kept episodes carry their masks

    board = run_cli("leaderboard", "--format", "json", "--rounds", "100", *sets(f"storage.url={store}"), env=IMPORT_TIMES)
    assert board.returncode == 0, board.stderr[-3000:]
    # the verifier's scores are kept with the answers: rating them needs no tensor library (torch was 1.5 of its 3 s)
    assert not heavy_imports(board.stderr), heavy_imports(board.stderr)
    board_rows = json.loads(board.stdout)
    rows = [r for r in board_rows if "environment" not in json.loads(r["params"])]
    assert {r["policy"] for r in rows} == {"base:tiny", "a/sft", "b/sft", f"model:{other}"}
    assert len({r["prompt_set"] for r in rows}) == 1 and all(r["answers"] == 8 and r["battles"] == 24 for r in rows)
    assert {r["run"] for r in rows} == {"a", "b", "c"}  # the runs that generated them
    episodes = [r for r in board_rows if r not in rows]
    assert {r["policy"] for r in episodes} == {"base:tiny", "a/sft", "b/sft"} and all(r["battles"] == 16 for r in episodes)
    assert {json.loads(r["params"])["environment"]["name"] for r in episodes} == {"feedback"}
    assert {r["run"] for r in episodes} == {"d", "e"}
    queried = run_cli("query", "--format", "json", *sets(f"storage.url={store}"),
                      "SELECT policy, lc_elo, accuracy FROM leaderboard ORDER BY policy")
    assert [r["policy"] for r in json.loads(queried.stdout)] == sorted(r["policy"] for r in board_rows)

    # a model as the judge too: every kept answer scored once, then reused
    judged = [run_cli("leaderboard", "--format", "json", "--rounds", "100", "--judge-model", f"model:{other}",
                      *sets(f"storage.url={store}")) for _ in range(2)]
    assert all(j.returncode == 0 for j in judged), judged[0].stderr
    assert "56 answers scored, 0 reused" in judged[0].stderr and "0 answers scored, 56 reused" in judged[1].stderr
    rows = json.loads(judged[1].stdout)
    assert {(r["judge"], r["policy"], r["params"]) for r in rows} == {
        (j, r["policy"], r["params"]) for j in ("verifier", f"reward_model:{other}") for r in rows}
    assert len(rows) == 14


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


def test_an_entry_written_before_episodes_were_kept_reads_as_single_answers(tmp_path):
    import pyarrow as pa

    from rlhf.core.tables import ANSWERS_SCHEMA_V1

    store = ArtifactStore(StorageConfig(url=str(tmp_path)))
    key = "a" * 64
    path = answers.entry_path(store, key)
    old = [{"prompt_index": 0, "prompt_id": "p0", "sample_index": 0, "response": "4", "response_ids": [19],
            "logprobs": [-0.5], "finish_reason": "stop", "verifier_score": 1.0}]
    store.write_table(f"{path}/answers.parquet", pa.Table.from_pylist(old, schema=ANSWERS_SCHEMA_V1), ANSWERS_SCHEMA_V1)
    store.write_json(f"{path}/manifest.json", {"policy": "r/sft", "run": "r", "params": {"n": 1},
                                               "prompt_set": "0" * 16, "verified": True})
    assert answers.read(store, key) == ([Generation(0, 0, [19], [-0.5], "4", "stop")], [1.0])
    entry = {"key": key}
    assert leaderboard.with_rows(store, entry) and entry["rows"][0]["policy_mask"] is None
    # an episode round-trips with its mask and error; a table of neither format is skipped, named
    episode = Generation(0, 0, [19, 5, 20], [-0.5, 0.0, -0.25], "4 no 5", "env_error", mask=[1, 0, 1], error="boom")
    answers.write(store, "b" * 64, [episode], [0.0], ["p0"], {"policy": "x", "run": "r", "params": {"n": 1},
                                                                "prompt_set": "0" * 16, "verified": True})
    assert answers.read(store, "b" * 64) == ([episode], [0.0])
    for bad in ([1, 0], [1, 2, 1]):  # a mask that does not fit its tokens: generated again, not rated
        answers.write(store, "c" * 64, [dataclasses.replace(episode, mask=bad)], [0.0], ["p0"],
                      {"policy": "x", "run": "r", "params": {"n": 1}, "prompt_set": "0" * 16, "verified": True})
        assert answers.read(store, "c" * 64) is None and not leaderboard.with_rows(store, {"key": "c" * 64})
    store.write_table(f"{path}/answers.parquet", pa.table({"x": [1]}), pa.schema([("x", pa.int64())]))
    assert not leaderboard.with_rows(store, {"key": key})


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
    [(_, members)] = grouped.items()
    assert [m["policy"] for m in members] == ["base:m", "r/sft@aaaaaaaa", "r/sft@bbbbbbbb", "x"]


PROMPTS = [[{"role": "user", "content": f"Tell me about {i}."}] for i in range(4)]


def keep(store, key: str, policy: str, texts: list[str], verified: bool = False) -> None:
    """An answers entry as the eval stage writes it (the tokens are the texts' lengths: only counts matter)."""
    gens = [Generation(i, 0, list(range(1, 2 + len(t) // 4)), [0.0], t, "stop") for i, t in enumerate(texts)]
    answers.write(store, key, gens, [1.0 if verified and "yes" in t else 0.0 if verified else None for t in texts],
                  [f"p{i}" for i in range(len(texts))], {"policy": policy, "run": "r", "prompt_set": answers.prompt_set(PROMPTS),
                                                         "params": {"n": 1}, "verified": verified})


def test_a_reward_model_judges_open_ended_answers_across_entries_and_scores_each_answer_once(tmp_path, capsys):
    store = ArtifactStore(StorageConfig(url=str(tmp_path)))
    keep(store, "a" * 64, "short", ["No.", "Yes.", "Hm.", "Ok."])
    keep(store, "b" * 64, "long", [f"{i} is a number with a long and friendly story behind it." for i in range(4)])
    judge = leaderboard.load_judge(store, f"model:{tiny_model_dir(TinyModelConfig())}", "float32")
    table = leaderboard.build(store, rounds=50, judge=judge)
    assert "no text of its prompts" in capsys.readouterr().err and table.num_rows == 0  # not kept yet: not judged

    assert answers.keep_prompts(store, PROMPTS) == answers.prompt_set(PROMPTS)
    rows = leaderboard.build(store, rounds=50, judge=judge).to_pylist()
    assert {r["policy"] for r in rows} == {"short", "long"} and {r["judge"] for r in rows} == {judge.name}
    assert all(r["accuracy"] is None and r["answers"] == 4 and r["battles"] == 4 for r in rows)
    assert judge.counts == {"scored": 8, "reused": 0}
    # the kept rewards are the reward model's own scores of (prompt, answer), and decide the battles
    want = reward_model_scores(judge.model, judge.tokenizer, [p + [{"role": "assistant", "content": t}] for p, t in zip(
        PROMPTS, [f"{i} is a number with a long and friendly story behind it." for i in range(4)])])
    got = store.read_json(leaderboard.judged_path(store, judge, "b" * 64))["rewards"]
    assert got == pytest.approx(want, rel=1e-5)
    short = store.read_json(leaderboard.judged_path(store, judge, "a" * 64))["rewards"]
    wins = sum(g > s for g, s in zip(got, short)) + 0.5 * sum(g == s for g, s in zip(got, short))
    by = {r["policy"]: r for r in rows}
    assert (by["long"]["elo"] > by["short"]["elo"]) == (wins > 2) or wins == 2

    keep(store, "c" * 64, "third", ["Four.", "Five.", "Six.", "Seven."])  # a third policy: only its answers scored
    rows = leaderboard.build(store, rounds=50, judge=judge).to_pylist()
    assert judge.counts == {"scored": 12, "reused": 8} and {r["policy"] for r in rows} == {"short", "long", "third"}

    # a prompts file that is not the set it names (edited in a shared store) is not used
    store.write_json(answers.prompts_path(store, answers.prompt_set(PROMPTS)), {"prompts": PROMPTS[:3]})
    assert leaderboard.build(store, rounds=50, judge=judge).num_rows == 0
    # and the verifier alone does not rate open-ended answers, and says how to
    assert leaderboard.build(store, rounds=50).num_rows == 0 and "--judge-model" in capsys.readouterr().err


@pytest.mark.parametrize("spec, expected", [
    ("nope/reward_model", "run 'nope' has no complete reward_model stage in the store"),
    ("a/sft", "expected <run>/reward_model"),
    ("../x/reward_model", "invalid run name '../x'"),
    ("model:/no/such/folder", "no model folder there"),
    ("model:a b", "without spaces or control characters"),
])
def test_a_judge_that_does_not_exist_is_refused(tmp_path, spec, expected):
    proc = run_cli("leaderboard", "--judge-model", spec, *sets(f"storage.url={tmp_path / 'store'}"))
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
