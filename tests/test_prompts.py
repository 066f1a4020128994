"""Your prompts, your rewards, your judge: a prompts file of the user's feeds SFT, GRPO and eval through the
command a user runs (`rlhf run` in a subprocess): gold answers checked by math-verify, a weighted list of
reward terms whose extra columns reach user functions by name, open-ended prompts rewarded and judged by a
reward model, and raw and length-controlled Elo in DuckDB. Bad prompts files and rewards are refused before
any model loads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import CONFIG, only, run_cli

TESTS = str(Path(__file__).parent)  # reward_fns lives here; the CLI finds it through PYTHONPATH, as a user's module would
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}


def write_prompts(path: Path, n: int, answers: bool = True) -> str:
    rows = []
    for i in range(n):
        prompt = f"What is {i} + {i + 1}?" if i % 3 else [{"role": "system", "content": "Answer with a number."},
                                                            {"role": "user", "content": f"What is {i} + {i + 1}?"}]
        rows.append({"prompt": prompt, "target": i, **({"answer": str(2 * i + 1)} if answers else {})})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.mark.slow  # SFT, GRPO and eval on the tiny model through the CLI (about a minute and a half)
def test_a_prompts_file_with_answers_runs_sft_grpo_and_eval_with_math_verify_and_a_column_reward(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    store = tmp_path / "store"
    rewards = '[{kind: math_verify}, {kind: function, function: "reward_fns:target_scaled", weight: 0.5}]'
    args = sets(f"storage.url={store}", *only("sft", "grpo", "eval"), f"data.prompts_path={prompts}",
                f"grpo.rewards={rewards}", "eval.policies=[base, sft, grpo]", "eval.anchor=sft", "eval.judge=verifier")
    shown = run_cli("validate", "--profile", "tiny", *args, env=ENV)
    assert shown.returncode == 0, shown.stderr
    assert f"prompts: {prompts}: 36 training and 4 held-out prompts" in shown.stdout
    assert "grpo reward: 1 x math_verify(answer) + 0.5 x function(reward_fns:target_scaled)" in shown.stdout
    done = run_cli("run", "--profile", "tiny", "--run-name", "mine", *args, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # SFT learned the file's answers as demonstrations; GRPO sampled the file's prompts
    experience = pq.read_table(store / "mine" / "grpo" / "experience").to_pylist()
    by_prompt = {}
    for row in experience:
        parts = dict(row["rewards"])
        assert set(parts) == {"math_verify", "target_scaled"}
        assert row["reward"] == pytest.approx(parts["math_verify"] + 0.5 * parts["target_scaled"])
        by_prompt.setdefault(row["prompt"], set()).add(parts["target_scaled"])
    targets = {q: int(q.split()[2]) for q in by_prompt}  # "What is i + i+1?": the row's target is i
    assert all(values == {targets[q] / 100} for q, values in by_prompt.items())  # each prompt's own column value
    metrics = pq.read_table(store / "mine" / "grpo" / "metrics.parquet").to_pylist()
    names = {m["name"] for m in metrics}
    assert {"reward/math_verify", "reward/target_scaled"} <= names
    ratings = run_cli("query", "--format", "json", "--set", f"storage.url={store}",
                      "SELECT policy, elo, lc_elo, length_coef FROM ratings WHERE run = 'mine'")
    rows = json.loads(ratings.stdout)
    assert {r["policy"] for r in rows} == {"base", "sft", "grpo"} and all(r["lc_elo"] is not None for r in rows)
    samples = json.loads(run_cli("query", "--format", "json", "--set", f"storage.url={store}",
                                 "SELECT DISTINCT prompt_id, prompt FROM samples WHERE run = 'mine'").stdout)
    assert len(samples) == 4 and all(s["prompt"].startswith("What is ") for s in samples)


@pytest.mark.slow  # a reward model, GRPO and eval on the tiny model through the CLI
def test_open_ended_prompts_train_grpo_on_the_reward_model_and_eval_rates_by_it_with_length_control(tmp_path):
    prompts = write_prompts(tmp_path / "open.jsonl", 40, answers=False)
    pairs = tmp_path / "prefs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Say something about {i}.", "chosen": f"{i} is a fine number indeed.",
                                         "rejected": f"{i}."}) + "\n" for i in range(24)))
    store = tmp_path / "store"
    args = sets(f"storage.url={store}", *only("sft", "reward_model", "grpo", "eval"), f"data.prompts_path={prompts}",
                "data.answer_column=null", f"data.prefs_path={pairs}", f"data.sft_path={pairs}",
                "grpo.rewards=[{kind: reward_model}]", "eval.judge=reward_model", "eval.policies=[sft, grpo]",
                "eval.anchor=sft")
    sft_rows = tmp_path / "sft.jsonl"
    sft_rows.write_text("".join(json.dumps({"prompt": f"Say something about {i}.", "completion": f"{i} is fine."}) + "\n"
                                for i in range(24)))
    args = [a.replace(f"data.sft_path={pairs}", f"data.sft_path={sft_rows}") for a in args]
    shown = run_cli("validate", "--profile", "tiny", *args, env=ENV)
    assert shown.returncode == 0, shown.stderr
    assert "open-ended (no answers): judged by the reward model" in shown.stdout
    assert "grpo reward: 1 x reward_model" in shown.stdout
    done = run_cli("run", "--profile", "tiny", "--run-name", "open", *args, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = json.loads(run_cli("query", "--format", "json", "--set", f"storage.url={store}",
                              "SELECT judge, policy, elo, lc_elo, lc_ci_low, lc_ci_high, length_coef, accuracy "
                              "FROM ratings WHERE run = 'open'").stdout)
    assert {r["judge"] for r in rows} == {"reward_model"} and {r["policy"] for r in rows} == {"sft", "grpo"}
    assert all(r["accuracy"] is None and r["lc_ci_low"] <= r["lc_elo"] <= r["lc_ci_high"] for r in rows)
    samples = json.loads(run_cli("query", "--format", "json", "--set", f"storage.url={store}",
                                 "SELECT count(*) AS n, count(verifier_score) AS verified, count(rm_reward) AS judged "
                                 "FROM samples WHERE run = 'open'").stdout)[0]
    assert samples["verified"] == 0 and samples["judged"] == samples["n"] > 0


PROMPT_CASES = [
    ("no-prompt", '{"question": "2+2?", "answer": "4"}\n', [], "line 1: missing columns: expected {prompt}, got ['answer', 'question']"),
    ("prompt-type", '{"prompt": 7, "answer": "4"}\n', [], "line 1: 'prompt' must be a string or a list of messages, got int"),
    ("unknown-role", '{"prompt": [{"role": "h4x0r", "content": "hi"}], "answer": "4"}\n', [],
     "line 1: 'prompt' message 0 has role 'h4x0r'; roles are system, user, assistant"),
    ("ends-with-assistant", '{"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "answer": "4"}\n',
     [], "line 1: 'prompt' must end with the user's turn"),
    ("no-answer-column", '{"prompt": "2+2?", "solution": "4"}\n', [], "line 1: no 'answer' column (columns: prompt, solution)"),
    ("answer-type", '{"prompt": "2+2?", "answer": [4]}\n', [], "line 1: 'answer' must be text or a number, got list"),
    ("function-imports", None, ["grpo.rewards=[{kind: function, function: \"no_such_module:f\"}]"],
     "grpo: reward function 'no_such_module:f': cannot import 'no_such_module'"),
    ("function-length", None, ["grpo.rewards=[{kind: function, function: \"reward_fns:wrong_length\"}]"],
     "grpo: reward function reward_fns:wrong_length: returned 1 values for 2 completions"),
    ("function-raises", None, ["grpo.rewards=[{kind: function, function: \"reward_fns:needs_gold\"}]"],
     "grpo: reward function reward_fns:needs_gold: a probe call on the first 2 prompts raised TypeError"),
    ("math-verify-column", None, ["grpo.rewards=[{kind: math_verify, column: gold}]"],
     "grpo.rewards: math_verify reads column 'gold', which prompt train-0 lacks (its columns: answer, target)"),
    ("verifier-open-ended", None, ["data.answer_column=null"],
     "grpo.reward_source: 'verifier' checks gold answers, and data.answer_column is null"),
]


@pytest.mark.parametrize("name, text, extra, expected", PROMPT_CASES, ids=[c[0] for c in PROMPT_CASES])
def test_bad_prompts_and_rewards_exit_2_before_any_model_loads(tmp_path, name, text, extra, expected):
    prompts = tmp_path / "p.jsonl"
    if text is None:
        write_prompts(prompts, 10)
    else:
        prompts.write_text(text)
    store = tmp_path / "store"
    proc = run_cli("validate", "-c", str(CONFIG), "--profile", "tiny", *sets(
        f"storage.url={store}", *only("sft", "grpo"), f"data.prompts_path={prompts}", "grpo.reward_source=verifier",
        *extra), env=ENV)
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not store.exists()
