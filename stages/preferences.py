"""Preferences: on-policy comparison data. The policy (SFT by default) answers every training prompt K
times through the rollout engine, a judge scores each answer, and each prompt gives its best vs its
worst answer as a pair (or every two answers that differ, with `pairing: all_pairs`); equal scores are
ties, dropped and counted.

This is the data flow of InstructGPT (Ouyang et al. 2022, sec. 3.5: labelers rank K outputs of the
policy) and of iterative/online DPO (Xiong et al. 2024, RLHFlow): the reward model and DPO then learn
from the mistakes this policy actually makes, not from synthetic ones. Judges: the task verifier, a
reward function `module:function` (TRL's signature), or a sequence-classification reward model by path.

Outputs (Parquet, rlhf.data.pairs.PAIRS_SCHEMA: TRL's conversational preference format plus provenance):
`pairs.parquet` from training prompts, `eval_pairs.parquet` from held-out prompts (the reward model's
held-out accuracy); `samples.parquet` with every judged answer.
"""

from __future__ import annotations

import time

import pyarrow as pa
import torch

from rlhf.core import progress
from rlhf.core.config import PreferencesConfig
from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model
from rlhf.core.stage import StageContext, StageResult
from rlhf.data.pairs import PAIRS_SCHEMA
from rlhf.data.tasks import Task
from rlhf.engines.engine import HFEngine
from rlhf.train.onpolicy import make_judge, pair_rows, sample_and_judge
from rlhf.train.training import fetch_model

SAMPLES_SCHEMA = pa.schema([
    pa.field("split", pa.string(), nullable=False),  # train | eval
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int64(), nullable=False),
    pa.field("response", pa.string()),
    pa.field("response_tokens", pa.int64()),
    pa.field("finish_reason", pa.string()),
    pa.field("score", pa.float64()),
])


def run(cfg: PreferencesConfig, ctx: StageContext) -> StageResult:
    task = Task(ctx.cfg.data)
    path = resolve_model(ctx.cfg.model) if cfg.policy == "base" else fetch_model(ctx, "sft")
    policy_key = ctx.inputs["sft"]["key"] if cfg.policy == "sft" else ""
    judge, judge_name = make_judge(cfg, task, ctx.cfg.model.dtype)
    splits = {"train": task.train[: cfg.prompts], "eval": task.eval[: cfg.eval_prompts]}
    total = sum(len(p) for p in splits.values()) * cfg.samples_per_prompt
    engine = HFEngine(load_causal_lm(path, ctx.cfg.model), load_tokenizer(path), cfg.batch_size)
    t0, done_before = time.perf_counter(), [0]

    outputs, rows_out, metrics, samples = {}, {}, {}, []
    for split, problems in splits.items():
        def log_progress(done: int, _total: int) -> None:
            n = done_before[0] + done
            ctx.log.info("preferences: %d/%d samples, %.1f samples/s", n, total, n / (time.perf_counter() - t0))
            progress.report(ctx.stage, n, total)

        with torch.inference_mode():
            grouped = sample_and_judge(engine, problems, cfg, judge, log_progress) if problems else []
        done_before[0] += len(problems) * cfg.samples_per_prompt
        rows, ties = pair_rows(problems, grouped, cfg, judge_name, cfg.policy, policy_key)
        name = "pairs" if split == "train" else "eval_pairs"
        ctx.store.write_table(ctx.path(f"{name}.parquet"), pa.Table.from_pylist(rows, schema=PAIRS_SCHEMA), PAIRS_SCHEMA)
        outputs[name], rows_out[name], rows_out[f"{name}_ties"] = f"{name}.parquet", len(rows), ties
        samples += [{"split": split, "prompt_id": p.id, "sample_index": g.sample_index, "response": g.text,
                     "response_tokens": len(g.token_ids), "finish_reason": g.finish_reason, "score": float(s)}
                    for p, group in zip(problems, grouped) for g, s in group]
        scores = [s for group in grouped for _, s in group]
        if scores:
            metrics[f"preferences/{split}_score_mean"] = sum(scores) / len(scores)
            metrics[f"preferences/{split}_tie_fraction"] = ties / max(len(problems), 1) if cfg.pairing == "best_worst" else (
                ties / max(ties + len(rows), 1))
    if not rows_out["pairs"]:
        raise ValueError(f"preferences: every one of the {len(splits['train'])} training prompts was a tie "
                         f"({cfg.samples_per_prompt} answers each scored the same): no pairs; raise "
                         "preferences.samples_per_prompt or temperature")
    ctx.store.write_table(ctx.path("samples.parquet"), pa.Table.from_pylist(samples, schema=SAMPLES_SCHEMA), SAMPLES_SCHEMA)
    outputs["samples"] = "samples.parquet"
    seconds = time.perf_counter() - t0
    metrics.update({"preferences/samples_per_s": total / seconds, "preferences/seconds": seconds,
                    "preferences/pairs": float(rows_out["pairs"])})
    ctx.log.info("preferences: %d pairs (%d ties) from %d prompts x %d samples, %d held-out pairs; %.1f samples/s",
                 rows_out["pairs"], rows_out["pairs_ties"], len(splits["train"]), cfg.samples_per_prompt,
                 rows_out["eval_pairs"], total / seconds)
    return StageResult(outputs=outputs, rows={**rows_out, "samples": len(samples)}, metrics=metrics)
