"""The built-in answer checks, by hand: math_verify compares by value whatever the notation; exact is text."""

from __future__ import annotations

import threading

import pytest

from rlhf.data.verifiers import exact, math_verify

SAME = [("28080", "The total is 28,080."), ("28080", "\\boxed{28080}"), ("1/2", "It is 0.5"),
        ("0.75", "\\frac{3}{4}"), ("-3", "so x = -3"), ("12", "12.0")]
DIFFERENT = [("44", "So 45"), ("1/2", "It is 0.4"), ("7", ""), ("28080", "I cannot tell")]


@pytest.mark.parametrize("gold, completion", SAME)
def test_math_verify_matches_by_value(gold, completion):
    assert math_verify(gold, completion) == 1.0


@pytest.mark.parametrize("gold, completion", DIFFERENT)
def test_math_verify_refuses_other_values_and_no_answer(gold, completion):
    assert math_verify(gold, completion) == 0.0


def test_a_gold_answer_that_is_not_mathematics_is_compared_as_text_and_threads_work():
    assert math_verify("Paris", " Paris ") == 1.0 and math_verify("Paris", "paris") == 0.0
    out = []  # the RL loop's scorers may call it off the main thread, where SIGALRM is unavailable
    t = threading.Thread(target=lambda: out.append((math_verify("1/2", "0.5"), math_verify("44", "45"))))
    t.start()
    t.join()
    assert out == [(1.0, 0.0)]


def test_exact_strips_only_the_ends():
    assert exact("42", " 42\n") == 1.0 and exact("4 2", "42") == 0.0 and exact("A", "a") == 0.0
