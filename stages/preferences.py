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
held-out accuracy); `samples.parquet` with every judged answer. With `contrast_samples` N > 0 the base
model also answers each training prompt N times, and `contrast_pairs.parquet` pairs the policy's better
answers against them, for the reward model only: a reward model trained on the SFT policy's answers
alone has never seen a base-model answer and may rate one highest (InstructGPT's comparisons also mix
outputs of several models, Ouyang et al. 2022, sec. 3.5).
"""

from __future__ import annotations

import time

import torch

from rlhf.core import progress
from rlhf.core.config import PreferencesConfig
from rlhf.core.models import inference_model, load_causal_lm, load_tokenizer, resolve_model
from rlhf.core.stage import StageContext, StageResult
from rlhf.data.sources import make_task
from rlhf.engines.engine import HFEngine
from rlhf.train.onpolicy import contrast_rows, make_judge, pair_rows, sample_and_judge
from rlhf.train.training import fetch_model



def run(cfg: PreferencesConfig, ctx: StageContext) -> StageResult:
    task = make_task(ctx.cfg.data)
    policy = ctx.inputs.policy
    path = fetch_model(ctx, policy) if policy else resolve_model(ctx.cfg.model)
    policy_key = policy.key if policy else ""
    mcfg = inference_model(ctx.cfg.model)  # sampling and judging only: model.inference_dtype
    judge, judge_name = make_judge(cfg, task, mcfg.dtype)
    splits = {"train": task.train[: cfg.prompts], "eval": task.eval[: cfg.eval_prompts]}
    total = (sum(len(p) for p in splits.values()) * cfg.samples_per_prompt
             + len(splits["train"]) * cfg.contrast_samples)
    t0, done_before = time.perf_counter(), [0]

    def engine_for(model_path):
        return HFEngine(load_causal_lm(model_path, mcfg), load_tokenizer(model_path), cfg.batch_size)

    def sample(engine, problems, n):
        def log_progress(done: int, _total: int) -> None:
            k = done_before[0] + done
            ctx.log.info("preferences: %d/%d samples, %.1f samples/s", k, total, k / (time.perf_counter() - t0))
            progress.report(ctx.stage, k, total)

        with torch.inference_mode():
            grouped = sample_and_judge(engine, problems, cfg, judge, log_progress, n) if problems else []
        done_before[0] += len(problems) * n
        return grouped

    def keep_samples(split, problems, grouped):
        samples.extend({"split": split, "prompt_id": p.id, "sample_index": g.sample_index, "response": g.text,
                        "response_tokens": len(g.token_ids), "finish_reason": g.finish_reason, "score": float(s)}
                       for p, group in zip(problems, grouped) for g, s in group)
        scores = [s for group in grouped for _, s in group]
        if scores:
            metrics[f"preferences/{split}_score_mean"] = sum(scores) / len(scores)

    def write_pairs(name, rows):
        outputs[name], rows_out[name] = ctx.write_output(name, rows), len(rows)

    outputs, rows_out, metrics, samples, by_split = {}, {}, {}, [], {}
    engine = engine_for(path)
    for split, problems in splits.items():
        grouped = by_split[split] = sample(engine, problems, cfg.samples_per_prompt)
        rows, ties = pair_rows(problems, grouped, cfg, judge_name, cfg.policy, policy_key)
        name = "pairs" if split == "train" else "eval_pairs"
        write_pairs(name, rows)
        rows_out[f"{name}_ties"] = ties
        keep_samples(split, problems, grouped)
        if grouped:
            metrics[f"preferences/{split}_tie_fraction"] = ties / max(len(problems), 1) if cfg.pairing == "best_worst" else (
                ties / max(ties + len(rows), 1))
    if not rows_out["pairs"]:
        raise ValueError(f"preferences: every one of the {len(splits['train'])} training prompts was a tie "
                         f"({cfg.samples_per_prompt} answers each scored the same): no pairs; raise "
                         "preferences.samples_per_prompt or temperature")
    if cfg.contrast_samples:
        del engine  # one model in memory at a time
        base_grouped = sample(engine_for(resolve_model(ctx.cfg.model)), splits["train"], cfg.contrast_samples)
        rows, rows_out["contrast_pairs_unpaired"] = contrast_rows(splits["train"], by_split["train"], base_grouped, cfg,
                                                                  judge_name, policy_key)
        write_pairs("contrast_pairs", rows)
        keep_samples("contrast", splits["train"], base_grouped)
        metrics["preferences/contrast_pairs"] = float(len(rows))
        ctx.log.info("preferences: %d contrast pairs (policy vs base) from %d base answers, %d unpaired", len(rows),
                     len(splits["train"]) * cfg.contrast_samples, rows_out["contrast_pairs_unpaired"])
    outputs["samples"] = ctx.write_output("samples", samples)
    seconds = time.perf_counter() - t0
    metrics.update({"preferences/samples_per_s": total / seconds, "preferences/seconds": seconds,
                    "preferences/pairs": float(rows_out["pairs"])})
    ctx.log.info("preferences: %d pairs (%d ties) from %d prompts x %d samples, %d held-out pairs; %.1f samples/s",
                 rows_out["pairs"], rows_out["pairs_ties"], len(splits["train"]), cfg.samples_per_prompt,
                 rows_out["eval_pairs"], total / seconds)
    return StageResult(outputs=outputs, rows={**rows_out, "samples": len(samples)}, metrics=metrics)
