"""Training rows for the stages: demonstrations, preference pairs and KTO's unpaired examples, from user
files or the task.

Every preference row carries a stable `pair_id` ("train-17" for task data, "row-17" for user data, 1-based
like the row numbers in error messages) that joins it to its cached reference log-probs.
"""

from __future__ import annotations

import logging
import random

from trl.data_utils import extract_prompt

from rlhf.config import DataConfig
from rlhf.tasks import Task
from rlhf.userdata import load_rows


def demonstrations(data: DataConfig, log: logging.Logger) -> tuple[list[dict], int]:
    """(rows, dropped count): user data when data.sft_path is set, else the task's demonstrations."""
    if data.sft_path:
        rows, dropped = load_rows(data.sft_path, "sft", data.on_bad_row)
        for message in dropped:
            log.warning("dropped %s", message)
        return rows, len(dropped)
    return Task(data).sft_rows(), 0


def preference_pairs(data: DataConfig, log: logging.Logger, keep_margin: bool = False) -> tuple[list[dict], int]:
    """(rows with pair_id, dropped count): user data when data.prefs_path is set, else the task's pairs."""
    if data.prefs_path:
        rows, dropped = load_rows(data.prefs_path, "prefs", data.on_bad_row, keep_index=True)
        for message in dropped:
            log.warning("dropped %s", message)
        rows = [{**row, "pair_id": f"row-{n}"} for n, row in rows]
    else:
        task = Task(data)
        rows, dropped = [{**row, "pair_id": p.id} for row, p in zip(task.preference_rows(), task.train)], []
    if not keep_margin:
        rows = [{k: v for k, v in r.items() if k != "margin"} for r in rows]
    return rows, len(dropped)


def unpaired_examples(data: DataConfig, log: logging.Logger) -> tuple[list[dict], int]:
    """KTO's (rows with example_id, dropped count): `data.unpaired_path` when set, else every preference
    pair split into a desirable (chosen) and an undesirable (rejected) example.

    The order is a seeded shuffle (data.seed): KTO's KL term pairs each prompt with the completion of its
    neighbour in a fixed-order batch, and a pair's two halves side by side would share a prompt.
    """
    if data.unpaired_path:
        loaded, dropped = load_rows(data.unpaired_path, "unpaired", data.on_bad_row, keep_index=True)
        for message in dropped:
            log.warning("dropped %s", message)
        rows = [{**row, "example_id": f"row-{n}"} for n, row in loaded]
        n_dropped = len(dropped)
    else:
        pairs, n_dropped = preference_pairs(data, log)
        pairs = [p if "prompt" in p else {**p, **extract_prompt(p)} for p in pairs]  # implicit-prompt rows
        rows = [
            {"prompt": p["prompt"], "completion": p[side], "label": side == "chosen", "example_id": f"{p['pair_id']}:{side}"}
            for p in pairs
            for side in ("chosen", "rejected")
        ]
    random.Random(data.seed).shuffle(rows)
    return rows, n_dropped
