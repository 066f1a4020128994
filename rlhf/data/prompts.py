"""A prompts file of the user's as a task (data.prompts_path): the interface of rlhf/data/tasks.py's Task,
so the preferences stage, PPO, GRPO, rollouts and eval take it as they take reasoning-gym's problems.

Rows are {prompt: str | [messages], ...other columns}, checked row by row before any model loads (file
and line in every error; data.on_bad_row fail or drop). The held-out prompts are data.eval_prompts_path,
or a seeded split of the file (data.eval_fraction by data.seed), with any prompt that also appears among
the training prompts removed; at most data.train_size and data.eval_size of each are used. With
data.answer_column every row must carry a gold answer (text or a number), and a completion scores by
data.verifier against it; without one (null) the prompts are open-ended, for a reward model to judge.
"""

from __future__ import annotations

import json
import random
from functools import cached_property

from rlhf.core.config import DataConfig
from rlhf.data.tasks import Problem, Split, assistant
from rlhf.data.userdata import DataError, load_rows
from rlhf.data.verifiers import VERIFIERS


def load_prompts(cfg: DataConfig, source: str) -> tuple[list[dict], list[str]]:
    """The file's valid rows and the dropped-row messages; the columns the config names must be in every row."""
    required = tuple(c for c in (cfg.answer_column, cfg.completion_column) if c)
    return load_rows(source, "prompts", cfg.on_bad_row, required=required)


class PromptFile(Split):
    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        self.open_ended = cfg.answer_column is None

    def _problem(self, pid: str, row: dict) -> Problem:
        prompt = row["prompt"]
        turns = tuple(prompt) if isinstance(prompt, list) else ()
        question = prompt if isinstance(prompt, str) else next(m["content"] for m in reversed(prompt) if m["role"] == "user")
        answer = None if self.open_ended else str(row[self.cfg.answer_column]).strip()
        extra = {k: v for k, v in row.items() if k != "prompt"}
        return Problem(pid, question, answer, {}, None if turns else self.cfg.system_prompt, turns, extra)

    @cached_property
    def _splits(self) -> tuple[list[Problem], list[Problem], int]:
        rows, dropped = load_prompts(self.cfg, self.cfg.prompts_path)
        if self.cfg.eval_prompts_path:
            train_rows, (eval_rows, more) = rows, load_prompts(self.cfg, self.cfg.eval_prompts_path)
            dropped += more
        else:
            order = list(range(len(rows)))
            random.Random(self.cfg.seed).shuffle(order)
            n_eval = max(1, round(len(rows) * self.cfg.eval_fraction))
            if n_eval >= len(rows):
                raise DataError(f"{self.cfg.prompts_path}: {len(rows)} usable prompts leave none to train on after "
                                f"data.eval_fraction {self.cfg.eval_fraction} of them are held out")
            eval_rows, train_rows = [rows[i] for i in order[:n_eval]], [rows[i] for i in order[n_eval:]]
        seen = {json.dumps(r["prompt"], sort_keys=True) for r in train_rows}
        eval_rows = [r for r in eval_rows if json.dumps(r["prompt"], sort_keys=True) not in seen]
        train = [self._problem(f"train-{i}", r) for i, r in enumerate(train_rows[: self.cfg.train_size])]
        evals = [self._problem(f"eval-{i}", r) for i, r in enumerate(eval_rows[: self.cfg.eval_size])]
        if not evals:
            raise DataError(f"{self.cfg.eval_prompts_path or self.cfg.prompts_path}: no held-out prompt left (every one "
                            "also appears among the training prompts)")
        return train, evals, len(dropped)

    @property
    def rl(self) -> list[Problem]:
        return self.train

    @property
    def dropped(self) -> int:
        return self._splits[2]

    def score(self, completion: str, problem: Problem) -> float:
        if problem.answer is None:
            raise ValueError(f"{problem.id}: an open-ended prompt has no gold answer to verify against "
                             "(data.answer_column is null): judge it with the reward model")
        return VERIFIERS[self.cfg.verifier](problem.answer, completion)

    def sft_rows(self) -> list[dict]:
        """Demonstrations: data.completion_column (a worked solution), else the gold answer, as the reply."""
        column = self.cfg.completion_column or self.cfg.answer_column
        if column is None:
            raise DataError(f"{self.cfg.prompts_path}: open-ended prompts (data.answer_column null) hold no replies to "
                            "fine-tune on: set data.sft_path, or data.completion_column")
        return [{"prompt": p.messages(), "completion": [assistant(str(p.columns()[column]))]} for p in self.train]

    def preference_rows(self) -> list[dict]:
        raise DataError(f"{self.cfg.prompts_path}: a prompts file holds no preference pairs: enable the preferences "
                        "stage (on-policy pairs judged on these prompts), or set data.prefs_path")


