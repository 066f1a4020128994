"""Iterative DPO's later rounds (`dpo.rounds > 1`): sample the current policy, judge, pair, score the
pairs with the round's reference, and keep each finished round in the store so a crash resumes there.

Pang et al. 2024 ("Iterative Reasoning Preference Optimization", sec. 2): round t starts from the model
of round t-1, which also generates the round's pairs and is its reference. Here round 1 is plain DPO on
the preferences stage's pairs with the SFT reference cache; round r > 1 samples the round r-1 policy
with the preferences settings (K, temperature, judge, pairing) on its own fresh RL prompts (data.rl_size
> 0; else the training prompts again, as the paper does), and its reference log-probs come from that
same model before the round trains (one model in memory, no second copy).

Layout under the stage prefix, each marker written last:
  rounds/<r>/pairs.parquet, ref_logps.parquet, data.json   the round's pairs (r > 1); data.json: complete
  rounds/<r>/model/, metrics.parquet, round.json           the trained round (r < last); round.json: complete
The last round's model is the stage's `model`. Trainer checkpoints (`checkpoints/`) belong to the round
being trained: they are cleared before a new round's pairs are written, so a resume never loads another
round's checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import torch

from rlhf.core.config import DPOConfig
from rlhf.core.store import CHECKPOINTS
from rlhf.data.pairs import training_rows
from rlhf.data.tasks import Problem
from rlhf.data.sources import PromptSource, make_task
from rlhf.engines.engine import HFEngine
from rlhf.engines.logprobs import pair_logps, tokenize_pair
from rlhf.train.onpolicy import make_judge, pair_rows, sample_and_judge
from rlhf.train.refcache import TABLE, ref_table, screen
from rlhf.train.training import held_out_accuracy, publish_model, write_metrics
from rlhf.core.tables import PAIRS_SCHEMA, REF_LOGPS_SCHEMA, METRICS_SCHEMA

ROUNDS = "rounds"
ROUND_FIELDS = ("pairs", "ties", "score_mean", "steps", "accuracy")  # reported as dpo/round_<r>/<field>


def round_problems(task: PromptSource, n: int, rl_size: int, r: int) -> list[Problem]:
    """Round r's n prompts (r >= 2): the (r-1)-th slice of the fresh RL draw, or the training prompts again."""
    return task.rl[(r - 2) * n:(r - 1) * n] if rl_size else task.train[:n]


def finished_rounds(ctx, rounds: int) -> list[dict]:
    """The records of rounds 1.. that completed before a crash, in order (the last round never has one)."""
    done = []
    for r in range(1, rounds):
        record = ctx.store.read_json(ctx.path(ROUNDS, str(r), "round.json"))
        # a record that is not what finish_round writes is treated as absent: the round runs again
        if not (isinstance(record, dict) and record.get("round") == r and type(record.get("steps")) is int
                and record["steps"] >= 0):
            break
        done.append(record)
    return done


def round_metrics(record: dict) -> dict[str, float]:
    r = record["round"]
    return {f"dpo/round_{r}/{k}": float(record[k]) for k in ROUND_FIELDS
            if isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)}


def round_model_dir(ctx, r: int) -> str:
    """A local folder with round r's model (the store's own folder when it is local, else a download)."""
    remote = ctx.path(ROUNDS, str(r), "model")
    if ctx.store.is_local:
        return remote
    return str(ctx.store.get_dir(remote, ctx.workdir / ROUNDS / str(r) / "model"))


def read_round_metrics(ctx, r: int) -> list[dict]:
    return ctx.store.read_table(ctx.path(ROUNDS, str(r), "metrics.parquet"), METRICS_SCHEMA).to_pylist()


def round_data(cfg: DPOConfig, ctx, model, tokenizer, r: int) -> tuple[list[dict], pa.Table, dict]:
    """Round r's (training rows, reference table, record): read back when a crashed attempt finished
    sampling, else sampled from `model` (the round r-1 policy), judged, paired and scored."""
    folder = ctx.path(ROUNDS, str(r))
    record = ctx.store.read_json(f"{folder}/data.json")
    if isinstance(record, dict) and record.get("round") == r:
        pairs = ctx.store.read_table(f"{folder}/pairs.parquet", PAIRS_SCHEMA).to_pylist()
        ref = ctx.store.read_table(f"{folder}/{TABLE}", REF_LOGPS_SCHEMA)
        ctx.log.info("dpo round %d: %d pairs sampled before the restart, reused", r, len(pairs))
        return training_rows(pairs), ref, record
    ctx.store.remove(ctx.path(CHECKPOINTS))  # round r-1's: this round's trainer starts fresh

    pcfg, prefs = ctx.cfg, ctx.cfg.preferences
    task = make_task(pcfg.data)
    problems = round_problems(task, pcfg.preference_prompts(), pcfg.data.rl_size, r)
    judge, judge_name = make_judge(prefs, task, pcfg.model.dtype)
    t0 = time.perf_counter()

    def log_progress(done: int, total: int) -> None:
        ctx.log.info("dpo round %d: %d/%d samples, %.1f samples/s", r, done, total, done / (time.perf_counter() - t0))

    with torch.inference_mode():
        grouped = sample_and_judge(HFEngine(model, tokenizer, prefs.batch_size), problems,
                                   prefs.model_copy(update={"seed": prefs.seed + r - 1}), judge, log_progress)
    pairs, ties = pair_rows(problems, grouped, prefs, judge_name, f"dpo-round-{r - 1}", f"{ctx.key}:round-{r - 1}")
    if not pairs:
        raise ValueError(f"dpo round {r}: every one of the {len(problems)} prompts was a tie (the round {r - 1} "
                         f"policy's {prefs.samples_per_prompt} answers each scored the same): no pairs; lower "
                         "dpo.rounds or raise preferences.samples_per_prompt or temperature")
    kept, dropped = screen([tokenize_pair(tokenizer, row) for row in pairs], cfg.max_length, pcfg.data.on_bad_row, ctx.log)
    with torch.inference_mode():  # the reference of round r is the policy it starts from
        ref = ref_table(kept, pair_logps(model, tokenizer, kept, cfg.max_length, pcfg.ref_logprobs.batch_size))
    scores = [score for group in grouped for _, score in group]
    record = {"round": r, "prompts": len(problems), "pairs": len(pairs), "ties": ties, "dropped": len(dropped),
              "score_mean": sum(scores) / len(scores), "sample_seconds": time.perf_counter() - t0}
    ctx.store.write_table(f"{folder}/pairs.parquet", pa.Table.from_pylist(pairs, schema=PAIRS_SCHEMA), PAIRS_SCHEMA)
    ctx.store.write_table(f"{folder}/{TABLE}", ref, REF_LOGPS_SCHEMA)
    ctx.store.write_json(f"{folder}/data.json", record)  # last: the round's data is complete
    ctx.log.info("dpo round %d: %d pairs (%d ties) from %d prompts, sampled reward %.3f",
                 r, len(pairs), ties, len(problems), record["score_mean"])
    return training_rows(pairs), ref, record


def finish_round(ctx, cfg: DPOConfig, r: int, model, tokenizer, progress_table: pa.Table, steps: int,
                 data: dict) -> dict:
    """Publishes round r's model and metrics, then its record (last); returns the record."""
    accuracy = held_out_accuracy(ctx, model, tokenizer, cfg)
    folder = str(Path(ROUNDS) / str(r))
    publish_model(ctx, model, tokenizer, f"{folder}/model")
    write_metrics(ctx, progress_table, f"{folder}/metrics.parquet")
    record = {**data, "round": r, "steps": steps, "accuracy": accuracy}
    ctx.store.write_json(ctx.path(folder, "round.json"), record)  # last: the round is complete
    ctx.log.info("dpo round %d done: %d steps", r, steps)
    return record
