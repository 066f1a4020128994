"""Where the stages' prompts come from: data.task's generated problems (rlhf/data/tasks.py) or a prompts
file of the user's (rlhf/data/prompts.py), behind one small interface."""

from __future__ import annotations

from typing import Protocol

from rlhf.core.config import DataConfig
from rlhf.data.tasks import Problem, Task


class PromptSource(Protocol):
    """What the stages need of their prompts: reasoning-gym's Task, or a user's PromptFile."""

    open_ended: bool  # no gold answers: nothing to verify, a reward model judges

    @property
    def train(self) -> list[Problem]: ...

    @property
    def eval(self) -> list[Problem]: ...

    @property
    def rl(self) -> list[Problem]: ...

    def score(self, completion: str, problem: Problem) -> float: ...

    def sft_rows(self) -> list[dict]: ...

    def preference_rows(self) -> list[dict]: ...


def make_task(cfg: DataConfig) -> PromptSource:
    """data.prompts_path's prompts when it is set, else data.task's generated problems."""
    if cfg.prompts_path:
        from rlhf.data.prompts import PromptFile

        return PromptFile(cfg)
    return Task(cfg)
