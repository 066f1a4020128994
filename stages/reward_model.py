"""Reward model trained on preference pairs with the Bradley-Terry loss, -log sigmoid(r_chosen - r_rejected)
(Ouyang et al. 2022, eq. 1), initialised from the SFT policy by default, as InstructGPT does. Two kinds:

- classifier: a scalar head (num_labels=1) on the last token (TRL RewardTrainer); with `use_margin` and a
  `margin` column, -log sigmoid(r_c - r_r - m) (Touvron et al. 2023, eq. 2).
- implicit: no new head; r(x, y) = sum_t log pi(y_t | x, y_<t), the fine-tuned LM's own log-likelihood of
  the answer. Its Bradley-Terry loss is DPO's with a reference that gives every answer the same
  likelihood (Rafailov et al. 2023, sec. 5), so TRL's DPOTrainer trains it with zero reference columns
  (rlhf/train/dpo_trainer.py), beta 1. Why: a new head on the last token must learn to judge an answer
  from a few hundred pairs, while the LM head already knows how likely the SFT policy finds it. On the
  default run's held-out on-policy pairs the untrained SFT policy's log-likelihood alone ranked 0.766 of
  them right, the trained classifier 0.61 (docs/benchmarks.md).

Held-out pairwise accuracy and mean reward margin: on the preferences stage's pairs of held-out prompts
when that stage is an input (the policy's own answers to prompts the model never trained on), else on a
seeded split. Accuracy is also reported split by which answer is longer (`eval_accuracy_chosen_longer`,
`..._chosen_shorter`): a reward model that tracks length instead of quality shows it there (Singhal et
al. 2023, "A Long Way to Go"). Outputs: `model/`, `metrics.parquet`.
"""

from __future__ import annotations

import random

import torch

from datasets import Dataset
from transformers import AutoModelForSequenceClassification
from trl import RewardConfig, RewardTrainer

from rlhf.core.config import RewardModelConfig
from rlhf.core.models import load_causal_lm, load_tokenizer, torch_dtype, weights_dtype
from rlhf.data.pairs import onpolicy_pairs, stage_pairs
from rlhf.data.tasks import assistant, user
from rlhf.engines.prefix import SharedPrefixLoss
from rlhf.train.dpo_trainer import CachedRefDPOTrainer
from rlhf.train.rewards import reward_model_scores
from rlhf.core.stage import StageContext, StageResult
from rlhf.train.training import (
    TrainerRun,
    peft_config,
    publish_model,
    start_model,
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


class SharedPrefixRewardTrainer(SharedPrefixLoss, RewardTrainer):
    """TRL's RewardTrainer with each batch's shared prompt prefix run once (rlhf/engines/prefix.py): the
    same scores and gradients for about a third of the compute on chain_sum's 48-token prompts."""


def run(cfg: RewardModelConfig, ctx: StageContext) -> StageResult:
    pcfg = ctx.cfg
    rows, dropped = stage_pairs(ctx, keep_margin=cfg.use_margin, contrast=True)  # with policy-vs-base pairs
    rows = [{k: v for k, v in r.items() if k != "pair_id"} for r in rows]
    held_out_pairs = [{k: v for k, v in r.items() if k != "pair_id"} for r in onpolicy_pairs(ctx, "eval_pairs")] if (
        ctx.inputs.pairs) else []
    if held_out_pairs:  # pairs of held-out prompts: every training pair trains
        train_rows, eval_rows = rows, held_out_pairs
    else:
        train_rows, eval_rows = split(rows, cfg.eval_fraction, pcfg.run.seed)
    init = start_model(ctx)  # SFT's model with init_from: sft, else the base model
    tokenizer = load_tokenizer(init)
    if cfg.kind == "implicit":
        return run_implicit(cfg, ctx, init, tokenizer, train_rows, eval_rows, bool(held_out_pairs), dropped)
    # The scalar head is new and randomly initialised, before the Trainer seeds anything: seed it here, or
    # it depends on what ran earlier in this process (in `rlhf run` every stage shares one process), and
    # the same content key would give another reward model in a fresh worker or after a resume.
    torch.manual_seed(pcfg.run.seed)
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
    trainer = SharedPrefixRewardTrainer(
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
        "reward_model/eval_accuracy": float(held_out["eval_accuracy"]),
        "reward_model/eval_margin": float(held_out["eval_margin"]),
        "reward_model/eval_loss": float(held_out["eval_loss"]),
        **{k: v for k, v in held_out_scores(trainer.model, tokenizer, eval_rows).items() if "chosen_" in k},
    }
    return finish(ctx, tr, trainer, result, tokenizer, metrics, len(train_rows), len(eval_rows), bool(held_out_pairs),
                  dropped)


def as_conversation(row: dict) -> dict:
    """A plain-text pair {prompt, chosen, rejected} (TRL's standard format) as a conversation: the prompt as
    the user's turn, each answer as the assistant's reply, the form the implicit reward scores (the answer's
    log-likelihood after the prompt under the chat template). Conversational pairs pass unchanged; a pair
    without a prompt is refused by preflight (rlhf/pipeline/preflight.py check_data)."""
    if isinstance(row["chosen"], list):
        return row
    return {**row, "prompt": [user(row["prompt"])], "chosen": [assistant(row["chosen"])],
            "rejected": [assistant(row["rejected"])]}


def run_implicit(cfg: RewardModelConfig, ctx: StageContext, init: str, tokenizer, train_rows: list[dict],
                 eval_rows: list[dict], on_policy: bool, dropped: int) -> StageResult:
    """The implicit reward model: reference-free DPO (zero reference log-probs, beta 1) of the init LM."""
    from trl import DPOConfig as TRLDPOConfig

    train_rows, eval_rows = [as_conversation(r) for r in train_rows], [as_conversation(r) for r in eval_rows]
    pcfg = ctx.cfg
    rows = [{**r, "ref_chosen_logps": 0.0, "ref_rejected_logps": 0.0} for r in train_rows]
    tr = TrainerRun.start(ctx)
    args = TRLDPOConfig(**trainer_kwargs(cfg, tr.out_dir, pcfg.run.seed, pcfg.model.dtype), max_length=cfg.max_length,
                        truncation_mode="keep_start", beta=1.0, loss_type=["sigmoid"], precompute_ref_log_probs=True)
    model = load_causal_lm(init, pcfg.model, trained=not cfg.lora.enabled)
    trainer = tr.build(CachedRefDPOTrainer, model, args, rows, tokenizer, cfg)
    result = tr.train(trainer)
    metrics = held_out_scores(trainer.model, tokenizer, eval_rows)
    return finish(ctx, tr, trainer, result, tokenizer, metrics, len(train_rows), len(eval_rows), on_policy, dropped)


def finish(ctx, tr, trainer, result, tokenizer, metrics: dict, n_train: int, n_eval: int, on_policy: bool,
           dropped: int) -> StageResult:
    metrics = {"reward_model/train_loss": float(result.training_loss),
               "reward_model/steps": float(trainer.state.global_step), **metrics}
    ctx.log.info(
        "reward_model: held-out pairwise accuracy %.3f (chosen longer %.3f, shorter %.3f), mean margin %.3f on %d %s pairs",
        metrics["reward_model/eval_accuracy"], metrics["reward_model/eval_accuracy_chosen_longer"],
        metrics["reward_model/eval_accuracy_chosen_shorter"], metrics["reward_model/eval_margin"], n_eval,
        "on-policy held-out" if on_policy else "split-off",
    )
    outputs = {"model": publish_model(ctx, trainer.model, tokenizer), "metrics": write_metrics(ctx, tr.progress.table())}
    return StageResult(
        outputs=outputs,
        rows={"train_pairs": n_train, "eval_pairs": n_eval, "dropped": dropped},
        metrics=metrics,
        resumed_from_step=tr.resumed_from_step,
    )


def accuracy_by_length(chosen_scores, rejected_scores, chosen_lengths, rejected_lengths) -> dict[str, float]:
    """Pairwise accuracy (chosen scored strictly higher) overall and split by which answer is longer;
    NaN for an empty split. Pairs of equal length count in the overall figure only.
    Hand-worked: scores c [2, 0, 1], r [1, 1, 1], lengths c [5, 1, 3], r [2, 4, 3] -> correct [1, 0, 0];
    chosen longer: pair 0 -> 1.0; chosen shorter: pair 1 -> 0.0; overall 1/3."""
    correct = [c > r for c, r in zip(chosen_scores, rejected_scores)]

    def share(keep) -> float:
        picked = [ok for ok, k in zip(correct, keep) if k]
        return sum(picked) / len(picked) if picked else float("nan")

    return {"accuracy": share([True] * len(correct)),
            "accuracy_chosen_longer": share([c > r for c, r in zip(chosen_lengths, rejected_lengths)]),
            "accuracy_chosen_shorter": share([c < r for c, r in zip(chosen_lengths, rejected_lengths)])}


def held_out_scores(model, tokenizer, rows: list[dict]) -> dict[str, float]:
    """The reward model's own scores of each held-out pair's two sides: pairwise accuracy overall and split
    by which answer is longer (answer characters), mean margin r_c - r_r and Bradley-Terry loss.
    Conversational rows only (TRL's plain-text format has no assistant turn to measure): NaN otherwise."""
    import torch

    keys = ("accuracy", "accuracy_chosen_longer", "accuracy_chosen_shorter", "margin", "loss")
    if not rows or not all(isinstance(r["chosen"], list) for r in rows):
        return {f"reward_model/eval_{k}": float("nan") for k in keys}

    def convs(side):
        return [r["prompt"] + r[side] if "prompt" in r else r[side] for r in rows]

    def length(r, side):
        return sum(len(m["content"]) for m in r[side] if m["role"] == "assistant")

    with torch.inference_mode():
        chosen, rejected = reward_model_scores(model, tokenizer, convs("chosen")), reward_model_scores(model, tokenizer, convs("rejected"))
    split = accuracy_by_length(chosen, rejected, [length(r, "chosen") for r in rows], [length(r, "rejected") for r in rows])
    margin = torch.tensor(chosen, dtype=torch.float64) - torch.tensor(rejected, dtype=torch.float64)
    split.update(margin=float(margin.mean()), loss=float(-torch.nn.functional.logsigmoid(margin).mean()))
    return {f"reward_model/eval_{k}": v for k, v in split.items()}
