"""Where prompts come from: the embedded default task (verifiable problems from reasoning-gym), or a
prompts file of the user's (rlhf/data/prompts.py); `make_task` picks by the config. Both give the same
small interface: train, eval and RL problems, a score against the gold answer, SFT demonstrations.

From one `data` config the reasoning-gym task yields deterministic, disjoint train/eval problems with
gold answers, a verifier reward, SFT demonstrations and preference pairs. Prompts are conversational (a
single user turn) so the chat template applies, as TRL's conversational formats expect.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from functools import cached_property

from rlhf.core.config import DataConfig
from rlhf.data.userdata import DataError

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class Problem:
    id: str  # "<split>-<index>"
    question: str  # the user's text (of a conversational prompt: its last user turn), as tables show it
    answer: str | None  # the gold answer; None for an open-ended prompt
    entry: dict  # reasoning-gym's full entry (its score_answer needs it); empty for a prompts file's row
    system: str | None = None  # the system turn (data.system_prompt); None: the chat template's default
    turns: tuple = ()  # a prompts file's conversational prompt, as given
    extra: dict = field(default_factory=dict)  # the row's columns besides the prompt (a task problem: its answer)

    def messages(self) -> list[dict]:
        """The prompt as a conversation: a file's own turns, or the system turn when one is set, then the question."""
        if self.turns:
            return [dict(t) for t in self.turns]
        return ([{"role": "system", "content": self.system}] if self.system is not None else []) + [user(self.question)]

    def columns(self) -> dict:
        """The row's columns besides the prompt, by name, as reward functions receive them (TRL's **kwargs)."""
        return dict(self.extra)


def last_number(text: str) -> str | None:
    """The verifier reads the last number of a completion (so 'The answer is 7.' scores as '7')."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


class Split:
    """The training and held-out problems of a prompt source, from its cached `_splits` (train first)."""

    @property
    def train(self) -> list[Problem]:
        return self._splits[0]

    @property
    def eval(self) -> list[Problem]:
        return self._splits[1]


@dataclass(frozen=True)
class Task(Split):
    cfg: DataConfig
    open_ended = False  # every problem has a gold answer

    @property
    def name(self) -> str:
        return self.cfg.task.split(":", 1)[1]

    def _generate(self, seed: int, size: int):
        import reasoning_gym

        try:
            return reasoning_gym.create_dataset(self.name, seed=seed, size=size, **self.cfg.task_params)
        except (TypeError, ValueError, AssertionError) as e:  # reasoning-gym checks its parameters by assert
            raise DataError(f"data.task_params: reasoning-gym's {self.name!r} refuses {self.cfg.task_params} "
                            f"({type(e).__name__}: {e})") from None

    @cached_property
    def _splits(self) -> tuple[list[Problem], list[Problem]]:
        # Train and eval come from different seeds; eval drops any question that also appears in
        # train so the held-out score never rewards memorisation.
        train_ds = self._generate(self.cfg.seed, self.cfg.train_size)
        train = [self._problem(f"train-{i}", e) for i, e in enumerate(train_ds)]
        held_out = self._draw("data.eval_size", self.cfg.seed + 1_000_003, self.cfg.eval_size, train)
        return train, [self._problem(f"eval-{i}", e) for i, e in enumerate(held_out)]

    def _draw(self, key: str, seed: int, n: int, apart_from: list[Problem]) -> list[dict]:
        """n entries of a fresh seed with distinct questions, none in `apart_from`: from 2n drawn, or 8n where
        a small problem space leaves too few. Distinct, because a repeated held-out question counts twice
        and narrows a bootstrap interval that assumes independent prompts. reasoning-gym seeds item i by
        seed + i, so the larger draw starts with the smaller one."""
        for drawn in (2 * n, 8 * n):
            seen, fresh = {p.question for p in apart_from}, []
            for e in self._generate(seed, drawn):
                if e["question"] not in seen:
                    fresh.append(e)
                    seen.add(e["question"])
                    if len(fresh) == n:
                        return fresh
        # a problem space that the earlier splits exhaust (chain_sum of 2 terms of 1 digit has 200 questions):
        # an error, not fewer prompts than the config promises
        raise DataError(f"{key}: {n} asked, but only {len(fresh)} of the {drawn} problems that {self.cfg.task} generated "
                        f"for it are new questions (the {len(apart_from)} problems drawn before hold "
                        f"{len({p.question for p in apart_from})} distinct ones): lower {key} or the sizes drawn before it "
                        f"(data.train_size{', data.eval_size' if key == 'data.rl_size' else ''}), or widen data.task_params")

    @cached_property
    def rl(self) -> list[Problem]:
        """RL prompts: the training problems, or (data.rl_size > 0) a fresh draw from a third seed with
        every question of train and eval removed."""
        if not self.cfg.rl_size:
            return self.train
        fresh = self._draw("data.rl_size", self.cfg.seed + 2_000_003, self.cfg.rl_size, self.train + self.eval)
        return [self._problem(f"rl-{i}", e) for i, e in enumerate(fresh)]

    def _problem(self, pid: str, e: dict) -> Problem:
        return Problem(pid, e["question"], str(e["answer"]), e, self.cfg.system_prompt, extra={"answer": str(e["answer"])})

    @cached_property
    def _scorer(self):
        import reasoning_gym

        return reasoning_gym.get_score_answer_fn(self.name)

    def score(self, completion: str, problem: Problem) -> float:
        """Verifier reward of the completion's last number: 1.0 where reasoning-gym's own scorer gives full
        marks and 0.0 elsewhere, or (data.partial_credit true) that scorer's graded score in [0, 1]."""
        answer = last_number(completion)
        score = float(self._scorer(answer if answer is not None else completion.strip(), problem.entry))
        return score if self.cfg.partial_credit else float(score >= 1.0)

    def sft_rows(self) -> list[dict]:
        """Demonstrations: the gold answer as the assistant's reply, or (answer_format 'worked') a worked
        solution ending in it."""
        reply = {"worked": worked_solution, "calculator": calculator_solution}.get(self.cfg.answer_format, lambda p: p.answer)
        return [{"prompt": p.messages(), "completion": [assistant(reply(p))]} for p in self.train]

    def preference_rows(self) -> list[dict]:
        """Pairs whose chosen answer verifies and whose rejected answer does not (by construction)."""
        rng = random.Random(self.cfg.seed)
        pool = [p.answer for p in self.train]
        rows = []
        for p in self.train:
            # with data.partial_credit true, reasoning-gym gives partial credit when the gold string
            # appears inside the answer ('-5' for '5'): redraw until the verifier scores the rejected reply 0.
            wrong = wrong_answer(p.answer, rng, pool)
            for _ in range(20):
                if self.score(wrong, p) == 0.0:
                    break
                wrong = wrong_answer(p.answer, rng, pool)
            else:
                raise ValueError(f"{self.cfg.task}: could not build an incorrect answer for {p.id}")
            rows.append(
                {"prompt": p.messages(), "chosen": [assistant(p.answer)], "rejected": [assistant(wrong)]}
            )
        return rows


_EXPRESSION = re.compile(r"(-?\d+)((?:\s*[-+]\s*\d+)+)\s*=\s*$")


def split_step(total: int, op: str, term: int) -> tuple[str, int]:
    """One step `total op term` written as tens, then units: '98 + 93 = 98 + 90 + 3 = 188 + 3 = 191'.
    Each move changes the tens or adds one digit, which a small model does more reliably than the whole
    sum at once (the verifier reads the last number, so the result stays the answer)."""
    sign = 1 if op == "+" else -1
    tens, units = term - term % 10, term % 10
    if tens == 0 or units == 0:  # nothing to split
        result = total + sign * term
        return f"{total} {op} {term} = {result}", result
    middle = total + sign * tens
    result = middle + sign * units
    return f"{total} {op} {term} = {total} {op} {tens} {op} {units} = {middle} {op} {units} = {result}", result


def worked_solution(problem: Problem) -> str:
    """A worked solution of a chain_sum problem, left to right, ending in the answer. Hand-worked:
    '15 - 43 =' -> '15 - 43 = 15 - 40 - 3 = -25 - 3 = -28. The answer is -28.'"""
    m = _EXPRESSION.search(problem.question)
    if m is None:
        raise ValueError(f"{problem.id}: no chain_sum expression in {problem.question!r}")
    total = int(m.group(1))
    steps = []
    for op, term in re.findall(r"([-+])\s*(\d+)", m.group(2)):
        text, total = split_step(total, op, int(term))
        steps.append(text)
    if str(total) != problem.answer:
        raise ValueError(f"{problem.id}: worked solution gives {total}, the gold answer is {problem.answer}")
    return "; ".join(steps) + f". The answer is {total}."


def calculator_solution(problem: Problem) -> str:
    """A chain_sum solution that calls the calculator (rlhf/envs/calculator.py) on the whole expression and
    reads its result. Hand-worked: '15 - 43 + 7 =' -> '<calc>15 - 43 + 7</calc><result>-21</result> The answer
    is -21.' In GRPO episodes the policy stops at '</calc>' and the environment writes the result."""
    m = _EXPRESSION.search(problem.question)
    if m is None:
        raise ValueError(f"{problem.id}: no chain_sum expression in {problem.question!r}")
    expression = " ".join((m.group(1) + m.group(2)).split())
    return f"<calc>{expression}</calc><result>{problem.answer}</result> The answer is {problem.answer}."


def wrong_answer(answer: str, rng: random.Random, pool: list[str]) -> str:
    """A plausible but incorrect answer: the gold number shifted by a non-zero offset, or, for
    non-numeric tasks, another problem's answer."""
    try:
        value = Decimal(answer)
    except InvalidOperation:
        return rng.choice(pool)
    offset = rng.choice([-10, -2, -1, 1, 2, 10, 11, 100])
    return str(value + offset)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}
