"""Training rows for the stages: demonstrations and preference pairs, from user files or the task.

Every preference row carries a stable `pair_id` ("train-17" for task data, "row-17" for user data, 1-based
like the row numbers in error messages) that joins it to its cached reference log-probs.
"""

from __future__ import annotations

import logging

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
