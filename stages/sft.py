"""Supervised fine-tuning on prompt/completion demonstrations (TRL SFTTrainer).

Loss on completion tokens only by default (InstructGPT, Ouyang et al. 2022, sec. 3.5 trains on the
labeller demonstrations). Outputs: `model/` (HF folder, safetensors, LoRA merged), `metrics.parquet`.
Held-out greedy verifier accuracy of the base and the trained policy goes into the manifest metrics.
"""

from __future__ import annotations

from trl import SFTConfig as TRLSFTConfig
from trl import SFTTrainer

from rlhf.core import dist
from rlhf.core.config import SFTConfig
from rlhf.engines.generation import verifier_accuracy
from rlhf.engines.logprobs import CompletionOnlyScoring
from rlhf.engines.prefix import SharedPrefixLoss
from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model
from rlhf.data.pairs import demonstrations
from rlhf.data.userdata import sift
from rlhf.core.stage import StageContext, StageResult
from rlhf.data.sources import make_task
from rlhf.train.training import TrainerRun, trainer_kwargs


class CompletionScoredSFTTrainer(SharedPrefixLoss, CompletionOnlyScoring, SFTTrainer):
    """SFTTrainer whose fused LM head projects only the positions the loss reads (the completion, by
    default) on the CPU too, as TRL already does on GPUs, and whose batches run their shared prompt prefix
    once (rlhf/engines/prefix.py)."""


def prompt_tokens(tokenizer, prompt) -> int:
    """Tokens of a demonstration's prompt as the trainer lays it out (a conversation through the chat
    template, up to the assistant's turn); 0 for a row without one (`text`, `messages`)."""
    if isinstance(prompt, list):
        prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if isinstance(prompt, str) else 0


def fit_prompts(rows: list[dict], tokenizer, max_length: int, on_bad_row: str, log) -> tuple[list[dict], int]:
    """(rows that leave room for their answer, dropped count). TRL truncates a row to max_length from its
    start and then drops it silently when no answer token is left, so a prompt as long as max_length would
    vanish from training (every row: a DataLoader error about zero samples). Named here instead, by row."""
    def problem(n_row):
        n, row = n_row
        tokens = prompt_tokens(tokenizer, row.get("prompt"))
        return f"row {n}: its prompt is {tokens} tokens, sft.max_length is {max_length}: no answer token fits" \
            if tokens >= max_length else None

    kept, problems = sift(list(enumerate(rows, 1)), problem, on_bad_row, log, "SFT demonstrations",
                          hint="; raise sft.max_length")
    return [row for _, row in kept], len(problems)


def run(cfg: SFTConfig, ctx: StageContext) -> StageResult:
    pcfg = ctx.cfg
    rows, dropped = demonstrations(pcfg.data, ctx.log)
    base = resolve_model(pcfg.model)
    tokenizer = load_tokenizer(base)
    rows, too_long = fit_prompts(rows, tokenizer, cfg.max_length, pcfg.data.on_bad_row, ctx.log)
    dropped += too_long
    model = load_causal_lm(base, pcfg.model, trained=not cfg.lora.enabled)
    task = make_task(pcfg.data)
    held_out = [] if task.open_ended else task.eval[: cfg.eval_prompts]  # open-ended: nothing to verify
    metrics: dict[str, float] = {}
    if held_out and dist.is_main():
        metrics["sft/base_accuracy"] = verifier_accuracy(model, tokenizer, task, held_out, cfg.eval_max_new_tokens)
        ctx.log.info("sft: base model held-out accuracy %.3f on %d prompts", metrics["sft/base_accuracy"], len(held_out))

    tr = TrainerRun.start(ctx)
    args = TRLSFTConfig(
        **trainer_kwargs(cfg, tr.out_dir, pcfg.run.seed, pcfg.model.dtype),
        max_length=cfg.max_length,
        completion_only_loss=cfg.completion_only_loss,
        packing=False,
    )
    trainer = tr.build(CompletionScoredSFTTrainer, model, args, rows, tokenizer, cfg)
    result = tr.train(trainer)
    metrics["sft/train_loss"] = float(result.training_loss)
    metrics["sft/steps"] = float(trainer.state.global_step)
    metrics["sft/tokens_seen"] = float(trainer.state.num_input_tokens_seen or 0)

    outputs = tr.publish_policy(trainer, tokenizer, cfg, metrics)
    return StageResult(
        outputs=outputs,
        rows={"train": len(rows), "dropped": dropped, "eval_prompts": len(held_out)},
        metrics=metrics,
        resumed_from_step=tr.resumed_from_step,
    )
