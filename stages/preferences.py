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
from rlhf.engines.engine import HFEngine, SamplingParams
from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model, torch_dtype
from rlhf.data.pairs import PAIRS_SCHEMA, build_pairs
from rlhf.train.rewards import function_scores, import_reward_function, reward_model_scores
from rlhf.core.stage import StageContext, StageResult
from rlhf.data.tasks import Problem, Task, assistant, user
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


def make_judge(cfg: PreferencesConfig, task: Task, dtype: str):
    """judge(problems, texts, token_ids) -> scores; and its name for the provenance column."""
    if cfg.judge == "function":
        fn = import_reward_function(cfg.reward_function)
        return (lambda problems, texts, ids: function_scores(fn, problems, texts, ids)), f"function:{cfg.reward_function}"
    if cfg.judge == "reward_model":
        from transformers import AutoModelForSequenceClassification

        rm = AutoModelForSequenceClassification.from_pretrained(cfg.reward_model_path, dtype=torch_dtype(dtype))
        tok = load_tokenizer(cfg.reward_model_path)

        def judge(problems, texts, ids):
            return reward_model_scores(rm, tok, [[user(p.question), assistant(t)] for p, t in zip(problems, texts)])

        return judge, f"reward_model:{cfg.reward_model_path}"
    return (lambda problems, texts, ids: [task.score(t, p) for p, t in zip(problems, texts)]), "verifier"


def sample_and_judge(engine, problems: list[Problem], cfg: PreferencesConfig, judge, log_progress) -> list[list]:
    """Per problem, its K generations with scores: [[(generation, score), ...], ...]."""
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.samples_per_prompt, cfg.seed)
    gens = engine.generate([[user(p.question)] for p in problems], params, on_batch=log_progress)
    scores = judge([problems[g.prompt_index] for g in gens], [g.text for g in gens], [g.token_ids for g in gens])
    grouped: list[list] = [[] for _ in problems]
    for g, s in zip(gens, scores):
        grouped[g.prompt_index].append((g, s))
    return [sorted(group, key=lambda gs: gs[0].sample_index) for group in grouped]


def pair_rows(problems: list[Problem], grouped: list[list], cfg: PreferencesConfig, judge_name: str,
              policy_key: str) -> tuple[list[dict], int]:
    rows, ties = [], 0
    for problem, group in zip(problems, grouped):
        chosen_rejected, n_ties = build_pairs([s for _, s in group], cfg.pairing)
        ties += n_ties
        for c, r in chosen_rejected[: cfg.max_pairs_per_prompt]:
            rows.append({
                "pair_id": f"{problem.id}:{c}:{r}", "prompt": [user(problem.question)],
                "chosen": [assistant(group[c][0].text)], "rejected": [assistant(group[r][0].text)],
                "prompt_id": problem.id, "chosen_index": c, "rejected_index": r,
                "chosen_score": float(group[c][1]), "rejected_score": float(group[r][1]), "judge": judge_name,
                "policy": cfg.policy, "policy_key": policy_key, "temperature": cfg.temperature, "top_p": cfg.top_p,
                "samples_per_prompt": cfg.samples_per_prompt,
            })
    return rows, ties


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
        rows, ties = pair_rows(problems, grouped, cfg, judge_name, policy_key)
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
