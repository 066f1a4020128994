"""DPO from cached reference log-probs (TRL DPOTrainer, no reference model in memory).

Rafailov et al. 2023. The policy starts from the SFT model (or the base model when SFT is off); the
reference log-probs come from the ref_logprobs stage's Parquet table, joined on pair_id, and reach TRL's
DPOTrainer as dataset columns (rlhf/train/dpo_trainer.py: no reference model is built).
With `rounds: N > 1`, iterative DPO: each later round samples, judges and pairs the current policy and
trains again (rlhf/train/dpo_rounds.py); per-round figures are `dpo/round_<r>/...` metrics.
Outputs: `model/`, `metrics.parquet`; held-out verifier accuracy in the manifest metrics.
"""

from __future__ import annotations

from trl import DPOConfig as TRLDPOConfig

from rlhf.core.config import DPOConfig
from rlhf.core.models import load_causal_lm, load_tokenizer
from rlhf.data.pairs import stage_pairs
from rlhf.core.stage import StageContext, StageResult
from rlhf.train.dpo_trainer import REF_COLUMNS, CachedRefDPOTrainer, with_reference
from rlhf.train.dpo_rounds import finish_round, finished_rounds, read_round_metrics, round_data, round_metrics, round_model_dir
from rlhf.train.training import TrainerRun, start_model, trainer_kwargs


def run(cfg: DPOConfig, ctx: StageContext) -> StageResult:
    pcfg = ctx.cfg
    init = start_model(ctx)
    tokenizer = load_tokenizer(init)
    done = finished_rounds(ctx, cfg.rounds)  # > 0 only when a multi-round run resumes
    start = round_model_dir(ctx, done[-1]["round"]) if done else init
    model = load_causal_lm(start, pcfg.model, trained=not cfg.lora.enabled)
    metrics: dict[str, float] = {}
    for record in done:
        metrics.update(round_metrics(record))
    history = [row for record in done for row in read_round_metrics(ctx, record["round"])]
    offset = sum(record["steps"] for record in done)
    rows_out: dict[str, int] = {}
    resumed = None  # the stage step this attempt resumed from (finished rounds plus a checkpoint)

    for r in range(len(done) + 1, cfg.rounds + 1):
        if r == 1:
            rows, _ = stage_pairs(ctx)
            ref = ctx.read_input(ctx.inputs.ref_logps, "ref_logps")
            data = {"pairs": len(rows)}
        else:
            rows, ref, data = round_data(cfg, ctx, model, tokenizer, r)
        train_rows, unmatched = with_reference(rows, ref.select(["pair_id", *REF_COLUMNS]).to_pylist())
        rows_out = {"train_pairs": len(train_rows), "without_reference": unmatched}
        tr = TrainerRun.start(ctx, step_offset=offset)
        if r == len(done) + 1 and (done or tr.resumed_from_step):
            resumed = offset + (tr.resumed_from_step or 0)
        trainer = tr.build(CachedRefDPOTrainer, model, trainer_args(cfg, tr, pcfg), train_rows, tokenizer, cfg)
        if trainer.ref_model is not None:  # guards the TRL behaviour this stage depends on
            raise RuntimeError("DPOTrainer built a reference model although cached reference log-probs were supplied")
        result = tr.train(trainer)
        steps = int(trainer.state.global_step)
        last = {r_["name"]: r_["value"] for r_ in tr.progress.rows if r_["name"].startswith("rewards/")}
        metrics.update({"dpo/train_loss": float(result.training_loss), "dpo/steps": float(offset + steps),
                        **{f"dpo/{k}": v for k, v in last.items()}})
        if r == cfg.rounds:
            tr.progress.rows[:0] = history
            outputs = tr.publish_policy(trainer, tokenizer, cfg, metrics)
            if cfg.rounds > 1:
                metrics.update(round_metrics({**data, "round": r, "steps": steps, "accuracy": metrics.get("dpo/accuracy")}))
            return StageResult(outputs=outputs, rows=rows_out, metrics=metrics, resumed_from_step=resumed)
        model = trainer.model.merge_and_unload() if cfg.lora.enabled else trainer.model
        record = finish_round(ctx, cfg, r, model, tokenizer, tr.progress.table(), steps, data)
        metrics.update(round_metrics(record))
        history += tr.progress.rows
        offset += steps
    raise AssertionError("unreachable: the last round returns")


def trainer_args(cfg: DPOConfig, tr: TrainerRun, pcfg) -> TRLDPOConfig:
    return TRLDPOConfig(
        **trainer_kwargs(cfg, tr.out_dir, pcfg.run.seed, pcfg.model.dtype),
        max_length=cfg.max_length,
        truncation_mode="keep_start",
        beta=cfg.beta,
        loss_type=[cfg.loss_type, "sft"] if cfg.nll_weight > 0 else [cfg.loss_type],
        loss_weights=[1.0, cfg.nll_weight] if cfg.nll_weight > 0 else None,
        label_smoothing=cfg.label_smoothing,
        precompute_ref_log_probs=True,  # with the override above: no reference model is built or run
    )
