"""Rollout: responses of one checkpoint (base, sft, dpo, ppo or grpo) to a prompt set, as Parquet.

Uses the rollout engine interface (rlhf/engines/engine.py) with the `rollout` sampling parameters, scores each
response with the task verifier, and writes `rollouts.parquet` (prompt id, sample index, prompt,
response, token ids, sampler log-probs, finish reason, reward).
"""

from __future__ import annotations

import torch

from rlhf.core import progress
from rlhf.core.config import RolloutConfig
from rlhf.engines.engine import HFEngine, SamplingParams
from rlhf.engines.vllm_engine import make_vllm
from rlhf.core.models import inference_model, load_causal_lm, load_tokenizer, resolve_model
from rlhf.core.stage import StageContext, StageResult
from rlhf.data.sources import make_task
from rlhf.train.training import fetch_model



def run(cfg: RolloutConfig, ctx: StageContext) -> StageResult:
    path = fetch_model(ctx, ctx.inputs.policy) if ctx.inputs.policy else resolve_model(ctx.cfg.model)
    tok = load_tokenizer(path)
    task = make_task(ctx.cfg.data)
    problems = (task.train if cfg.split == "train" else task.eval)[: cfg.prompts]
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.n, cfg.seed)
    def on_batch(done: int, total: int) -> None:
        ctx.log.info("rollout: %d/%d samples", done, total)
        progress.report(ctx.stage, done, total)

    prompts = [p.messages() for p in problems]
    if cfg.engine == "vllm":
        with make_vllm(cfg, path, tok, inference_model(ctx.cfg.model).dtype, ctx.cfg.run.seed) as engine:
            gens = engine.generate(prompts, params, on_batch=on_batch)
    else:
        with torch.inference_mode():
            gens = HFEngine(load_causal_lm(path, inference_model(ctx.cfg.model)), tok, cfg.batch_size).generate(prompts, params, on_batch=on_batch)
    rows = [{"prompt_id": problems[g.prompt_index].id, "sample_index": g.sample_index, "prompt": problems[g.prompt_index].question,
             "response": g.text, "response_ids": g.token_ids, "logp_rollout": g.logprobs, "finish_reason": g.finish_reason,
             # the verifier's score; none for open-ended prompts (nothing to verify against)
             "reward": None if task.open_ended else task.score(g.text, problems[g.prompt_index])} for g in gens]
    metrics = {"rollout/stop_fraction": sum(g.finish_reason == "stop" for g in gens) / len(gens)}
    if not task.open_ended:
        metrics["rollout/reward_mean"] = sum(r["reward"] for r in rows) / len(rows)
    return StageResult(outputs={"rollouts": ctx.write_output("rollouts", rows)}, rows={"samples": len(rows)}, metrics=metrics)
