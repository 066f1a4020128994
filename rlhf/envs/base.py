"""The environment protocol, shaped after Gymnasium's `reset` / `step` with text for actions and observations
(OpenEnv's HTTP environments have the same two calls). The package itself is not a dependency: its spaces
and vectorisation add nothing for text, and a user's class needs no import of ours to satisfy this.

    class MyEnv:
        stop = ("</tool>",)                  # strings that end a policy turn and hand over to the environment
        chat = False                         # True: the end of the policy's chat turn hands over too
        def __init__(self, **options): ...                 # environment.options, as keyword arguments
        def reset(self, problem: dict) -> None: ...        # the prompt row: {id, question, answer, columns,
                                                           #   metadata (a reasoning-gym task's, else {})}
        def step(self, turn: str) -> tuple[str | None, float, bool]:
            ...                                            # (observation, reward, done)

A turn ends at one of `stop` (an inline call: the observation text is appended to the transcript as it is),
at the policy's end-of-sequence token, or at the turn's token budget. At the end-of-sequence token the
episode ends, unless the class says `chat = True`: then the environment answers as the next user turn of
the conversation, in the chat template's format, and the policy speaks again (a checker's feedback, a
game's next state), until `step` says done or returns no observation. Either way the environment's tokens
are masked out of every loss term. The episode's reward is the configured reward terms on the whole
transcript, plus the sum of the rewards `step` returned.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

BUILTIN = {"calculator": "rlhf.envs.calculator:Calculator", "feedback": "rlhf.envs.feedback:Feedback",
           "hanoi": "rlhf.envs.hanoi:Hanoi"}


@dataclass(frozen=True)
class Step:
    """What the environment answered to one policy turn. `error`: the environment failed (an exception, a
    timeout, a crash, a forbidden call): the episode ends with it recorded."""
    observation: str | None
    reward: float = 0.0
    done: bool = False
    error: str | None = None


def problem_payload(problem) -> dict:
    """What an environment's reset receives: plain data, safe to send to its process (a reasoning-gym problem's
    metadata too: a game's starting position is there)."""
    return {"id": problem.id, "question": problem.question, "answer": problem.answer, "columns": problem.columns(),
            "metadata": dict((getattr(problem, "entry", None) or {}).get("metadata") or {})}


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


def check(spec: str, options: dict, problems=()) -> str:
    """Before a run: the class loads and takes `options` as keyword arguments (a class of the user's is
    checked on its signature only: none of its code runs outside the sandbox; a built-in is built once,
    which checks the values too, and reset on `problems`, a few of the prompts it will play: a game on
    prompts that are not its puzzles, or feedback on prompts without answers, is named before any model
    loads). Returns 'module:Class'; ValueError naming what is wrong."""
    cls = load_class(spec)
    try:
        inspect.signature(cls).bind(**options)
        env = cls(**options) if spec in BUILTIN else None
    except (TypeError, ValueError) as e:
        raise ValueError(f"environment {spec!r}: options {options} do not fit {cls.__name__}"
                         f"{inspect.signature(cls)}: {e}") from None
    for problem in problems if env is not None else ():
        try:
            env.reset(problem_payload(problem))
        except ValueError as e:
            raise ValueError(f"environment {spec!r} cannot play these prompts: {e}") from None
    return resolve(spec)
