"""The embedded task: deterministic by seed, disjoint splits, a verifier that reads the last number."""

from __future__ import annotations

import random

import pytest

from rlhf.core.config import DataConfig
from rlhf.data.tasks import Task, last_number, wrong_answer
from rlhf.data.userdata import DataError


def test_deterministic_by_seed_and_changes_with_seed():
    a, b = Task(DataConfig(train_size=50, eval_size=20)), Task(DataConfig(train_size=50, eval_size=20))
    assert [p.question for p in a.train] == [p.question for p in b.train]
    assert [p.question for p in a.eval] == [p.question for p in b.eval]
    assert a.preference_rows() == b.preference_rows()
    c = Task(DataConfig(train_size=50, eval_size=20, seed=1))
    assert [p.question for p in c.train] != [p.question for p in a.train]


def test_train_and_eval_prompts_do_not_overlap():
    # 1-digit sums have only 2 x 10 x 10 = 200 distinct questions, so random splits would collide.
    task = Task(DataConfig(train_size=120, eval_size=30, task_params={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}))
    train_q = {p.question for p in task.train}
    assert task.eval and not train_q & {p.question for p in task.eval}
    assert len({p.id for p in task.train + task.eval}) == len(task.train) + len(task.eval)


ONE_DIGIT = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 2 x 10 x 10 = 200 questions


def test_too_small_a_problem_space_is_an_error_naming_the_size_not_a_shorter_split():
    # 1,000 training problems of the 200 questions leave none for 30 held-out ones: an error, not 0 held-out prompts
    task = Task(DataConfig(train_size=1000, eval_size=30, task_params=ONE_DIGIT))
    with pytest.raises(DataError, match=r"^data.eval_size: 30 asked, but only 0 of the 240 problems .* \(the 1000 "
                                        r"problems drawn before hold 19\d distinct ones\): lower data.eval_size or .*data.train_size"):
        task.eval
    # RL prompts must be new questions too: 150 more are not there once train and eval hold most of the 200
    task = Task(DataConfig(train_size=60, eval_size=20, rl_size=150, task_params=ONE_DIGIT))
    assert len(task.eval) == 20
    with pytest.raises(DataError, match=r"^data.rl_size: 150 asked, but only \d+ of the 1200 problems .*data.eval_size\)"):
        task.rl


@pytest.mark.parametrize(
    "text, expected",
    [("The answer is 7.", "7"), ("4 - 1 = 3", "3"), ("-37", "-37"), ("1,000 apples", "1000"), ("none", None), ("2.5 or 3.75", "3.75")],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_verifier_scores_gold_one_and_wrong_zero():
    task = Task(DataConfig(train_size=20, eval_size=5))
    p = task.train[0]
    assert task.score(f"The answer is {p.answer}.", p) == 1.0
    assert task.score(str(int(p.answer) + 1), p) == 0.0
    assert task.score("no idea", p) == 0.0


def test_partial_credit_for_a_substring_of_the_gold_answer_only_when_asked():
    """reasoning-gym's chain_sum scorer gives len(gold) / len(reply) when the gold answer is inside the
    reply: '-19' for 89 - 90 = -1 scores 2/3 with data.partial_credit true; the default scores it 0, full
    marks stay 1."""
    from rlhf.data.tasks import Problem

    entry = {"question": "89 - 90 =", "answer": "-1", "metadata": {}}
    problem = Problem("x", entry["question"], "-1", entry)
    graded, exact = Task(DataConfig(partial_credit=True)), Task(DataConfig())
    assert graded.score("-19", problem) == pytest.approx(2 / 3)
    assert exact.score("-19", problem) == 0.0
    assert exact.score("The answer is -1.", problem) == graded.score("The answer is -1.", problem) == 1.0


def test_demonstrations_and_pairs_are_conversational_and_verified():
    task = Task(DataConfig(train_size=30, eval_size=5))
    sft = task.sft_rows()
    assert len(sft) == 30 and sft[0]["prompt"][0]["role"] == "user" and sft[0]["completion"][0]["role"] == "assistant"
    for row, p in zip(task.preference_rows(), task.train):
        assert task.score(row["chosen"][0]["content"], p) == 1.0
        assert task.score(row["rejected"][0]["content"], p) == 0.0


def test_wrong_answer_for_non_numeric_gold_comes_from_the_pool():
    assert wrong_answer("cat", random.Random(0), ["dog"]) == "dog"
    assert wrong_answer("12", random.Random(0), []) != "12"


def test_rl_prompts_are_a_fresh_disjoint_draw():
    cfg = DataConfig(train_size=50, eval_size=20, rl_size=40)
    task = Task(cfg)
    rl = [p.question for p in task.rl]
    assert 0 < len(rl) <= 40 and len(set(rl)) == len(rl)  # up to rl_size, no repeats
    assert not set(rl) & {p.question for p in task.train + task.eval}
    assert rl == [p.question for p in Task(cfg).rl] and task.rl[0].id == "rl-0"  # deterministic
    assert Task(DataConfig(train_size=50, eval_size=20)).rl == Task(DataConfig(train_size=50, eval_size=20)).train


def test_worked_solutions_by_hand_and_verified_for_every_problem():
    from rlhf.data.tasks import Problem, split_step, worked_solution

    assert split_step(98, "+", 93) == ("98 + 93 = 98 + 90 + 3 = 188 + 3 = 191", 191)
    assert split_step(15, "-", 43) == ("15 - 43 = 15 - 40 - 3 = -25 - 3 = -28", -28)
    assert split_step(4, "-", 1) == ("4 - 1 = 3", 3)  # one digit: nothing to split
    assert split_step(23, "-", 60) == ("23 - 60 = -37", -37)  # a round ten: nothing to split
    q = "State the final answer to the following arithmetic problem: 15 - 43 + 7 ="
    assert worked_solution(Problem("t", q, "-21", {})) == "15 - 43 = 15 - 40 - 3 = -25 - 3 = -28; -28 + 7 = -21. The answer is -21."
    with pytest.raises(ValueError, match="gold answer is 5"):
        worked_solution(Problem("t", q, "5", {}))
    # every default problem: the worked solution ends in the gold answer and the verifier accepts it
    task = Task(DataConfig(train_size=200, eval_size=50, answer_format="worked",
                           task_params={"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}))
    for row, p in zip(task.sft_rows(), task.train):
        assert task.score(row["completion"][0]["content"], p) == 1.0
    with pytest.raises(ValueError, match="answer_format: 'worked' solutions exist for reasoning_gym:chain_sum only"):
        DataConfig(task="reasoning_gym:basic_arithmetic", answer_format="worked")


def test_calculator_solutions_call_the_tool_on_the_expression_and_verify():
    from rlhf.data.tasks import Problem, calculator_solution
    from rlhf.envs.calculator import Calculator

    q = "State the final answer to the following arithmetic problem: 15 - 43 + 7 ="
    assert calculator_solution(Problem("t", q, "-21", {})) == "<calc>15 - 43 + 7</calc><result>-21</result> The answer is -21."
    task = Task(DataConfig(train_size=100, eval_size=10, answer_format="calculator",
                           task_params={"min_terms": 5, "max_terms": 5, "min_digits": 3, "max_digits": 3}))
    calc = Calculator()
    calc.reset({})
    for row, p in zip(task.sft_rows(), task.train):
        reply = row["completion"][0]["content"]
        call, rest = reply.split("</calc>")
        assert calc.step(call + "</calc>")[0] == rest.split(" The")[0]  # the tool's result is the demonstration's
        assert task.score(reply, p) == 1.0


def test_system_prompt_reaches_every_prompt_and_the_chat_template():
    """data.system_prompt: null keeps the chat template's own system turn (SmolLM2's 16 tokens), "" writes
    an empty one, and every split's prompts, demonstrations and pairs carry it."""
    from rlhf.core.config import ModelConfig
    from rlhf.core.models import load_tokenizer, resolve_model
    from rlhf.engines.engine import chat_ids

    default, empty = Task(DataConfig(train_size=4, eval_size=2, rl_size=2)), Task(DataConfig(train_size=4, eval_size=2, rl_size=2, system_prompt=""))
    assert default.train[0].messages() == [{"role": "user", "content": default.train[0].question}]
    for p in empty.train + empty.eval + empty.rl:
        assert p.messages() == [{"role": "system", "content": ""}, {"role": "user", "content": p.question}]
    assert empty.sft_rows()[0]["prompt"] == empty.train[0].messages()
    assert empty.preference_rows()[0]["prompt"] == empty.train[0].messages()
    tok = load_tokenizer(resolve_model(ModelConfig(name="tiny")))
    with_default, without = chat_ids(tok, default.train[0].messages()), chat_ids(tok, empty.train[0].messages())
    assert "SmolLM" in tok.decode(with_default) and "SmolLM" not in tok.decode(without)
    assert len(with_default) - len(without) == 16
