"""Writes data/examples/gsm_symbolic.jsonl: reasoning-gym's gsm_symbolic problems (GSM8K's templates with
fresh numbers) as a prompts file of the kind a user brings: {prompt, answer, solution}, the solution the
template's worked chain of thought ending "The answer is N.". Deterministic (seed 0):

    .venv/bin/python data/examples/export_gsm_symbolic.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import reasoning_gym

ROWS = 1200
OUT = Path(__file__).with_name("gsm_symbolic.jsonl")


def row(entry: dict) -> dict:
    cot = entry["metadata"]["answer_cot"].strip()
    solution = re.sub(r"\n?####\s*(\S+)\s*$", lambda m: f"\nThe answer is {m.group(1)}.", cot)
    return {"prompt": entry["question"], "answer": str(entry["answer"]), "solution": solution}


if __name__ == "__main__":
    data = reasoning_gym.create_dataset("gsm_symbolic", seed=0, size=ROWS)
    OUT.write_text("".join(json.dumps(row(e)) + "\n" for e in data))
    print(f"{OUT}: {ROWS} rows")
