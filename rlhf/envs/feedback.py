"""The built-in chat environment: the policy answers, a checker says whether the answer is right, and a
wrong one gets another attempt as the next user turn, up to the section's max_turns (multi-attempt RL
with verifier feedback: the second attempt of SCoRe, Kumar et al. 2024, made a loop). It works on any
prompt with a gold answer: the embedded reasoning-gym tasks and a prompts file's `answer` column.

The check reads the attempt's last number where the gold answer is a number (as the task's verifier
does), else compares the attempt's last line with the answer, ignoring case and spacing. The configured
reward terms then score the whole transcript, whose last answer is the final attempt; `attempt_cost`
(an option) is subtracted for each wrong attempt that gets feedback, so that a right first answer is worth more than a
right third one.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def _number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def is_right(attempt: str, answer: str) -> bool:
    """Whether an attempt gives the gold answer (its last number, or its last line for a textual answer)."""
    gold = _number(answer.strip())
    if gold is not None:
        found = _NUMBER.findall(attempt)
        return bool(found) and _number(found[-1]) == gold
    lines = [line for line in attempt.strip().splitlines() if line.strip()]
    norm = lambda t: " ".join(t.lower().split()).strip(" .")  # noqa: E731
    return bool(lines) and re.search(r"(?:^|\W)" + re.escape(norm(answer)) + "$", norm(lines[-1])) is not None


class Feedback:
    """One episode: each attempt is checked; a wrong one is told so, and the policy tries again."""

    chat = True
    stop = ()

    def __init__(self, attempt_cost: float = 0.0, message: str = "That is not right. Check your work and answer again."):
        if isinstance(attempt_cost, bool) or not isinstance(attempt_cost, (int, float)) or not 0.0 <= attempt_cost <= 1.0:
            raise ValueError(f"attempt_cost must be a number in [0, 1], not {attempt_cost!r}")
        self.attempt_cost, self.message = float(attempt_cost), str(message)

    def reset(self, problem: dict) -> None:
        if problem.get("answer") is None:
            raise ValueError(f"prompt {problem.get('id')}: the feedback environment needs a gold answer")
        self.answer, self.attempts = str(problem["answer"]), 0

    def step(self, turn: str) -> tuple[str | None, float, bool]:
        self.attempts += 1
        if is_right(turn, self.answer):
            return None, 0.0, True
        return self.message, -self.attempt_cost, False
