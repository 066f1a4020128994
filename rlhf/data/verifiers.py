"""Checks of a completion against a gold answer, for prompts that carry one (data.prompts_path with
data.answer_column): the RL reward, the preference judge and eval's accuracy.

math_verify is Hugging Face's math-verify (the verifier behind open-r1 and TRL's accuracy reward): it
extracts the answer from the completion (a number, a fraction, a decimal, LaTeX, \\boxed{}) and compares
it with the gold answer by value, so '28,080', '28080.0' and '\\boxed{28080}' all match '28080'.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


def math_verify(answer: str, completion: str) -> float:
    """1.0 when the completion's answer equals the gold answer in value, else 0.0. Hand-worked: gold '1/2'
    against 'It is 0.5' is 1.0; gold '44' against 'So 45' is 0.0; an empty completion is 0.0. A gold answer
    that is not mathematics is compared as text (`exact`)."""
    from math_verify import parse, verify

    # math-verify bounds its parsing with SIGALRM, which only the main thread can use; completions are
    # bounded by the sampler's max_new_tokens anyway
    main = threading.current_thread() is threading.main_thread()
    if not main:
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that has no timeout
    gold = parse(answer, **({} if main else {"parsing_timeout": None}))
    if not gold:  # a gold answer that is not mathematics ('Paris'): compared as text
        return exact(answer, completion)
    pred = parse(completion, **({} if main else {"parsing_timeout": None}))
    return float(bool(pred) and verify(gold, pred, **({} if main else {"timeout_seconds": None})))


def exact(answer: str, completion: str) -> float:
    """1.0 when the stripped completion equals the stripped answer (case and inner spaces count)."""
    return float(completion.strip() == answer.strip())


VERIFIERS: dict[str, Callable[[str, str], float]] = {"math_verify": math_verify, "exact": exact}
