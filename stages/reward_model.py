"""Reward model: a scalar head (num_labels=1) trained on preference pairs (TRL RewardTrainer).

Loss: Bradley-Terry, -log sigmoid(r_chosen - r_rejected) (Ouyang et al. 2022, eq. 1); with
`use_margin` and a `margin` column, -log sigmoid(r_c - r_r - m) (Touvron et al. 2023, eq. 2).
Initialised from the SFT policy by default, as InstructGPT does. Held-out pairwise accuracy and mean
reward margin come from RewardTrainer.evaluate on a seeded split. Outputs: `model/`, `metrics.parquet`.
"""

from __future__ import annotations

import random

from datasets import Dataset
from transformers import AutoModelForSequenceClassification
from trl import RewardConfig, RewardTrainer

from rlhf.config import RewardModelConfig
from rlhf.models import load_tokenizer, resolve_model, torch_dtype, weights_dtype
from rlhf.pairs import preference_pairs
from rlhf.runner import StageContext, StageResult
from rlhf.training import (
    TrainerRun,
    fetch_model,
    peft_config,
    publish_model,
    trainer_kwargs,
    write_metrics,
)


def split(rows: list[dict], eval_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Seeded shuffle, then the last `eval_fraction` (at least one pair) is held out."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(rows) * eval_fraction))
    if n_eval >= len(rows):
        raise ValueError(f"reward_model.eval_fraction: leaves no training pairs out of {len(rows)}")
    return [rows[i] for i in order[:-n_eval]], [rows[i] for i in order[-n_eval:]]


def run(cfg: RewardModelConfig, ctx: StageContext) -> StageResult:
    pcfg = ctx.cfg
    rows, dropped = preference_pairs(pcfg.data, ctx.log, keep_margin=cfg.use_margin)
    rows = [{k: v for k, v in r.items() if k != "pair_id"} for r in rows]
    train_rows, eval_rows = split(rows, cfg.eval_fraction, pcfg.run.seed)
    init = fetch_model(ctx, "sft") if cfg.init_from == "sft" else resolve_model(pcfg.model)
    tokenizer = load_tokenizer(init)
    model = AutoModelForSequenceClassification.from_pretrained(
        init, num_labels=1, dtype=torch_dtype(weights_dtype(pcfg.model, not cfg.lora.enabled)), attn_implementation=pcfg.model.attn_implementation
    )
    model.config.pad_token_id = tokenizer.pad_token_id

    tr = TrainerRun.start(ctx)
    args = RewardConfig(
        **trainer_kwargs(cfg, tr.out_dir, pcfg.run.seed, pcfg.model.dtype),
        max_length=cfg.max_length,
        center_rewards_coefficient=cfg.center_rewards_coefficient or None,
        eval_strategy="no",
    )
    trainer = RewardTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(train_rows),
        eval_dataset=Dataset.from_list(eval_rows),
        processing_class=tokenizer,
        peft_config=peft_config(cfg, task_type="SEQ_CLS"),
        callbacks=tr.callbacks,
    )
    result = tr.train(trainer)
    held_out = trainer.evaluate()  # also lands in the metrics table through the progress callback
    metrics = {
        "reward_model/train_loss": float(result.training_loss),
        "reward_model/steps": float(trainer.state.global_step),
        "reward_model/eval_accuracy": float(held_out["eval_accuracy"]),
        "reward_model/eval_margin": float(held_out["eval_margin"]),
        "reward_model/eval_loss": float(held_out["eval_loss"]),
    }
    ctx.log.info(
        "reward_model: held-out pairwise accuracy %.3f, mean margin %.3f on %d pairs",
        metrics["reward_model/eval_accuracy"], metrics["reward_model/eval_margin"], len(eval_rows),
    )
    outputs = {"model": publish_model(ctx, trainer.model, tokenizer), "metrics": write_metrics(ctx, tr.progress.table())}
    return StageResult(
        outputs=outputs,
        rows={"train_pairs": len(train_rows), "eval_pairs": len(eval_rows), "dropped": dropped},
        metrics=metrics,
        resumed_from_step=tr.resumed_from_step,
    )
