"""The environment protocol, shaped after Gymnasium's `reset` / `step` with text for actions and observations
(OpenEnv's HTTP environments have the same two calls). The package itself is not a dependency: its spaces
and vectorisation add nothing for text, and a user's class needs no import of ours to satisfy this.

    class MyEnv:
        stop = ("</tool>",)                  # strings that end a policy turn and hand over to the environment
        def reset(self, problem: dict) -> None: ...        # the prompt row: {question, answer, columns}
        def step(self, turn: str) -> tuple[str | None, float, bool]:
            ...                                            # (observation, reward, done)

A turn ends at the policy's end-of-sequence token (the episode ends: its final answer), at one of `stop`
(the environment's turn: its observation text is appended to the transcript, and its tokens are masked out
of every loss term), or at the turn's token budget. The episode's reward is the configured reward terms on
the whole transcript, plus the sum of the rewards `step` returned.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

BUILTIN = {"calculator": "rlhf.envs.calculator:Calculator"}


@dataclass(frozen=True)
class Step:
    """What the environment answered to one policy turn. `error`: the environment failed (an exception, a
    timeout, a crash, a forbidden call): the episode ends with it recorded."""
    observation: str | None
    reward: float = 0.0
    done: bool = False
    error: str | None = None


def resolve(spec: str) -> str:
    """'calculator' (built in) or 'module:Class' -> 'module:Class'."""
    return BUILTIN.get(spec, spec)


def load_class(spec: str):
    """The environment class `spec` names ('calculator' or 'module:Class'); ValueError naming what is wrong."""
    module, _, name = resolve(spec).partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, SyntaxError) as e:
        raise ValueError(f"environment {spec!r}: cannot import {name!r} from {module!r} ({type(e).__name__}: {e})") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {spec!r}: {name} has no {' or '.join(missing)} method (the protocol: "
                         "reset(problem), step(turn) -> (observation, reward, done))")
    return cls
