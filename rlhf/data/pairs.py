"""Training rows for the stages: demonstrations, preference pairs and KTO's unpaired examples, from user
files or the task.

Every preference row carries a stable `pair_id` ("train-17" for task data, "row-17" for user data, 1-based
like the row numbers in error messages) that joins it to its cached reference log-probs.
"""

from __future__ import annotations

import logging
import random

from trl.data_utils import extract_prompt

from rlhf.core.config import DataConfig
from rlhf.data.sources import make_task
from rlhf.data.userdata import load_rows



def build_pairs(scores: list[float], mode: str = "best_worst") -> tuple[list[tuple[int, int]], int]:
    """(chosen, rejected) sample indices from one prompt's K judged answers, and the ties dropped.

    best_worst: the first highest- vs the first lowest-scored answer, one pair per prompt (a prompt
    whose answers all score the same is one tie). all_pairs: every i < j with different scores, the
    higher first; each equal-score pair is a tie.
    Hand-worked, scores [1, 0, 1, 0.5]: best_worst -> [(0, 1)], 0 ties; all_pairs -> (0,1), (0,3),
    (2,1), (3,1), (2,3) and one tie (0, 2).
    """
    if mode == "best_worst":
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        worst = min(range(len(scores)), key=lambda i: (scores[i], i))
        return ([(best, worst)], 0) if scores[best] > scores[worst] else ([], 1)
    if mode == "all_pairs":
        pairs, ties = [], 0
        for i in range(len(scores)):
            for j in range(i + 1, len(scores)):
                if scores[i] == scores[j]:
                    ties += 1
                else:
                    pairs.append((i, j) if scores[i] > scores[j] else (j, i))
        return pairs, ties
    raise ValueError(f"pairing: unknown mode {mode!r}")


def contrast_pairs(policy_scores: list[float], base_scores: list[float]) -> tuple[list[tuple[int, int]], int]:
    """(policy index, base index) pairs from one prompt: each base answer, in order, against the policy's
    best answer not yet used, when that one scores strictly higher; else the base answer is unpaired
    (counted) and no policy answer is used up.
    Hand-worked, policy [0, 1, 1, 0.5], base [0, 1, 0.2]: policy best-first 1, 2, 3, 0; base 0 vs
    policy 1 (1 > 0) pairs; base 1 vs policy 2 (1 = 1) is unpaired; base 2 vs policy 2 (1 > 0.2) pairs
    -> [(1, 0), (2, 2)], 1 unpaired."""
    order = sorted(range(len(policy_scores)), key=lambda i: (-policy_scores[i], i))
    pairs, unpaired, k = [], 0, 0
    for b, score in enumerate(base_scores):
        if k < len(order) and policy_scores[order[k]] > score:
            pairs.append((order[k], b))
            k += 1
        else:
            unpaired += 1
    return pairs, unpaired


def training_rows(pairs: list[dict]) -> list[dict]:
    """PAIRS_SCHEMA rows as training rows: the conversation parts and pair_id, without provenance."""
    return [{k: r[k] for k in ("prompt", "chosen", "rejected", "pair_id")} for r in pairs]


def onpolicy_pairs(ctx, output: str = "pairs") -> list[dict]:
    """The preferences stage's pairs (`pairs` or `eval_pairs`) as training rows with pair_id."""
    return training_rows(ctx.read_input(ctx.inputs.pairs, output).to_pylist())


def stage_pairs(ctx, keep_margin: bool = False, contrast: bool = False) -> tuple[list[dict], int]:
    """The pairs a stage trains on: on-policy pairs when the preferences stage is its input (with
    `contrast`, also its policy-vs-base contrast pairs when it wrote them), else `preference_pairs` (a
    user file or the task's synthetic pairs)."""
    if ctx.inputs.pairs:
        extra = onpolicy_pairs(ctx, "contrast_pairs") if contrast and ctx.inputs.pairs.has("contrast_pairs") else []
        return onpolicy_pairs(ctx) + extra, 0
    return preference_pairs(ctx.cfg.data, ctx.log, keep_margin)


def demonstrations(data: DataConfig, log: logging.Logger) -> tuple[list[dict], int]:
    """(rows, dropped count): user data when data.sft_path is set, else the task's demonstrations."""
    if data.sft_path:
        rows, dropped = load_rows(data.sft_path, "sft", data.on_bad_row)
        for message in dropped:
            log.warning("dropped %s", message)
        return rows, len(dropped)
    return make_task(data).sft_rows(), 0


def preference_pairs(data: DataConfig, log: logging.Logger, keep_margin: bool = False) -> tuple[list[dict], int]:
    """(rows with pair_id, dropped count): user data when data.prefs_path is set, else the task's pairs."""
    if data.prefs_path:
        rows, dropped = load_rows(data.prefs_path, "prefs", data.on_bad_row, keep_index=True)
        for message in dropped:
            log.warning("dropped %s", message)
        rows = [{**row, "pair_id": f"row-{n}"} for n, row in rows]
    else:
        task = make_task(data)
        rows, dropped = [{**row, "pair_id": p.id} for row, p in zip(task.preference_rows(), task.train)], []
    if not keep_margin:
        rows = [{k: v for k, v in r.items() if k != "margin"} for r in rows]
    return rows, len(dropped)


def unpaired_examples(data: DataConfig, log: logging.Logger, pairs: list[dict] | None = None) -> tuple[list[dict], int]:
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
        if pairs is None:
            pairs, n_dropped = preference_pairs(data, log)
        else:
            n_dropped = 0
        pairs = [p if "prompt" in p else {**p, **extract_prompt(p)} for p in pairs]  # implicit-prompt rows
        rows = [
            {"prompt": p["prompt"], "completion": p[side], "label": side == "chosen", "example_id": f"{p['pair_id']}:{side}"}
            for p in pairs
            for side in ("chosen", "rejected")
        ]
    random.Random(data.seed).shuffle(rows)
    return rows, n_dropped
