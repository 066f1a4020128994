"""Shared plumbing of the Trainer-based stages (SFT, reward model, DPO): arguments, checkpoints
mirrored into the artifact store, resume, progress logs and the metrics table.

Checkpoints are written by the HF Trainer into local scratch, then copied to
`<stage prefix>/checkpoints/checkpoint-<step>/` with a `.complete` marker written last, so a copy cut
short by a crash is never resumed from. Resume downloads the newest complete checkpoint and hands it to
`Trainer.train(resume_from_checkpoint=...)`, which restores weights, optimizer, scheduler, RNG and the
data position (all loaded with torch.load(weights_only=True) by transformers).
"""

from __future__ import annotations

import os
import posixpath
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import transformers
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from rlhf.core import dist, progress, tracking
from rlhf.core.config import LaunchConfig, TrainerOptions
from rlhf.core.models import resolve_model
from rlhf.core.stage import Input
from rlhf.core.store import CHECKPOINTS, COMPLETE
from rlhf.core.tables import METRICS_SCHEMA

# Test hook: RLHF_TEST_CRASH_AT="<stage>:<step>" raises at the end of that optimizer step, emulating a
# crash between checkpoints. Used by tests/test_distributed.py; never set in normal runs.
CRASH_ENV = "RLHF_TEST_CRASH_AT"

# Progress is reported by ProgressAndMetrics through logging; library progress bars would interleave
# with it in the Prefect logs.
datasets.disable_progress_bars()
transformers.utils.logging.disable_progress_bar()


class InjectedCrash(RuntimeError):
    pass


def trainer_kwargs(opts: TrainerOptions, output_dir: Path, seed: int, dtype: str) -> dict[str, Any]:
    """TrainingArguments fields common to every stage, set explicitly (TRL's own defaults differ:
    it turns gradient checkpointing and bf16 on)."""
    import torch

    return {
        "output_dir": str(output_dir),
        "learning_rate": opts.learning_rate,
        "num_train_epochs": opts.num_epochs,
        "max_steps": opts.max_steps,
        "per_device_train_batch_size": opts.per_device_batch_size,
        "per_device_eval_batch_size": opts.per_device_batch_size,
        "gradient_accumulation_steps": opts.gradient_accumulation_steps,
        "optim": opts.optim,
        "lr_scheduler_type": opts.lr_scheduler,
        "warmup_steps": opts.warmup_ratio,  # a float in [0, 1) is a ratio of total steps in transformers 5
        "weight_decay": opts.weight_decay,
        "max_grad_norm": opts.max_grad_norm,
        "activation_checkpointing": opts.gradient_checkpointing,
        "bf16": dtype == "bfloat16",
        "fp16": dtype == "float16",
        "use_cpu": not torch.cuda.is_available(),
        "save_strategy": "steps",
        "save_steps": opts.save_steps,
        "save_total_limit": 1,
        "logging_steps": opts.logging_steps,
        "logging_first_step": True,
        "report_to": [],
        "disable_tqdm": True,
        "seed": seed,
        "data_seed": seed,
        "dataloader_num_workers": 0,
        "include_num_input_tokens_seen": True,
        **strategy_kwargs(opts.launch, opts.gradient_checkpointing),
    }


def strategy_kwargs(launch: LaunchConfig, checkpointing: bool) -> dict[str, Any]:
    """TrainingArguments for the sharded strategies; DDP needs none (accelerate reads torchrun's env).
    Both are GPU-only and refused earlier on a worker without CUDA (rlhf/pipeline/launch.py)."""
    if launch.strategy == "fsdp":
        return {"fsdp": "full_shard auto_wrap", "fsdp_config": {"activation_checkpointing": checkpointing}}
    if launch.strategy == "deepspeed_zero3":
        return {"deepspeed": {
            "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_gather_16bit_weights_on_model_save": True},
            "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        }}
    return {}


def peft_config(opts: TrainerOptions, task_type: str = "CAUSAL_LM"):
    if not opts.lora.enabled:
        return None
    from peft import LoraConfig

    lora = opts.lora
    return LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules, task_type=task_type
    )


def _fmt_eta(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"


class ProgressAndMetrics(TrainerCallback):
    """Logs step, loss, tokens/s and ETA; keeps every logged value for the metrics table."""

    def __init__(self, stage: str, log, step_offset: int = 0):
        self.stage, self.log = stage, log
        self.offset = step_offset  # steps of earlier rounds (iterative DPO): one continuous curve
        self.rows: list[dict] = []
        self.t0 = None
        self.first_step = 0

    def on_train_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()
        self.first_step = state.global_step  # > 0 after a resume
        self.tokens0 = state.num_input_tokens_seen or 0

    def on_log(self, args, state, control, logs=None, **kw):
        logs = logs or {}
        step = state.global_step
        for name, value in logs.items():
            if isinstance(value, (int, float)):
                self.rows.append({"stage": self.stage, "step": step + self.offset, "epoch": state.epoch, "name": name,
                                  "value": float(value)})
        tracking.current().log(step + self.offset, {f"{self.stage}/{name}": value for name, value in logs.items()})  # rank 0's only
        elapsed = time.perf_counter() - self.t0
        done = max(step - self.first_step, 1)
        eta = elapsed / done * (state.max_steps - step)
        tok_s = ((state.num_input_tokens_seen or 0) - self.tokens0) / max(elapsed, 1e-9)
        loss = logs.get("loss", logs.get("train_loss"))
        loss_txt = f"loss {loss:.4f} " if isinstance(loss, (int, float)) else ""
        progress.report(self.stage, step, state.max_steps)
        self.log.info(
            "%s step %d/%d %stokens/s %.0f elapsed %s ETA %s",
            self.stage, step, state.max_steps, loss_txt, tok_s, _fmt_eta(elapsed), _fmt_eta(eta),
        )

    def table(self) -> pa.Table:
        return pa.Table.from_pylist(self.rows, schema=METRICS_SCHEMA)


class MirrorCheckpoints(TrainerCallback):
    """Copies each local checkpoint into the store, marker last, and prunes older remote ones."""

    def __init__(self, ctx, output_dir: Path, step_offset: int = 0):
        self.ctx, self.output_dir = ctx, output_dir
        crash = os.environ.get(CRASH_ENV, "")
        stage, _, step = crash.partition(":")
        # the stage's step: with DPO rounds, earlier rounds' steps plus this trainer's
        self.crash_at = int(step) - step_offset if stage == ctx.stage and step.isdigit() else None

    def on_save(self, args, state, control, **kw):
        dist.barrier()  # every rank has written its part (RNG state) of the local checkpoint
        step = state.global_step
        local, name = self.output_dir / f"checkpoint-{step}", f"checkpoint-{step}"
        if dist.world_size() > 1:
            # a rank on another node than rank 0 wrote its RNG state where rank 0 cannot see it: it uploads
            # that file itself, before rank 0 uploads the rest and the marker
            if dist.node() != dist.broadcast(dist.node()):
                for file in local.glob(f"rng_state_{dist.rank()}.pth"):
                    self.ctx.store.put_file(file, self.ctx.path(CHECKPOINTS, name, file.name))
            dist.barrier()
        if not dist.is_main():
            return
        remote = store_checkpoint(self.ctx, local, name)
        self.ctx.log.info("%s: checkpoint at step %d saved to %s", self.ctx.stage, step, self.ctx.store.url(remote))

    def on_step_end(self, args, state, control, **kw):
        if self.crash_at is not None and state.global_step == self.crash_at:
            raise InjectedCrash(f"{self.ctx.stage}: injected crash at step {state.global_step} ({CRASH_ENV})")


def store_checkpoint(ctx, local: Path, name: str) -> str:
    """Uploads a local checkpoint folder as `checkpoints/<name>`, writes the marker last (only then is
    it resumable), and prunes every other checkpoint of the stage. Returns the remote path."""
    store = ctx.store
    remote = ctx.path(CHECKPOINTS, name)
    store.put_dir(local, remote)
    store.write_bytes(posixpath.join(remote, COMPLETE), b"ok")
    for other in store.list_dirs(ctx.path(CHECKPOINTS)):
        if other != name:
            store.remove(ctx.path(CHECKPOINTS, other))
    return remote


def latest_checkpoint(ctx) -> tuple[int, Path] | None:
    """Downloads the newest complete checkpoint of this stage into scratch; None when there is none."""
    store = ctx.store
    found = None
    if dist.is_main():  # rank 0 picks the checkpoint; every rank resumes from the same one
        done = store.complete_checkpoints(ctx.cfg.run.name, ctx.stage)
        if done:
            found = (max(done), done[max(done)])
    found = dist.broadcast(found)
    if found is None:
        return None
    local = ctx.workdir / "resume" / found[1]
    if dist.is_local_main():  # one download per node, into the scratch its ranks share
        shutil.rmtree(local, ignore_errors=True)
        store.get_dir(ctx.path(CHECKPOINTS, found[1]), local)
    dist.barrier()
    return found[0], local


def fresh_output_dir(ctx) -> Path:
    out = ctx.workdir / "trainer"
    if dist.is_local_main():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    dist.barrier()
    return out


def publish_model(ctx, model, tokenizer, name: str = "model") -> str:
    """Save a full HF folder (LoRA adapters merged) with safetensors, then copy it into the store."""
    if not dist.is_main():
        return name
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    local = ctx.workdir / name
    shutil.rmtree(local, ignore_errors=True)
    model.save_pretrained(local, safe_serialization=True)
    tokenizer.save_pretrained(local)
    ctx.store.put_dir(local, ctx.path(name))
    return name


def fetch_model(ctx, source: Input, output: str = "model") -> str:
    """A local folder with an input stage's model: the store's own folder when the store is local (read
    only, never copied), else a download into scratch (S3)."""
    if ctx.store.is_local:
        return ctx.input_path(source, output)
    local = ctx.workdir / "inputs" / source.stage
    if dist.is_local_main():  # one download per node, into the scratch its ranks share
        shutil.rmtree(local, ignore_errors=True)
        ctx.store.get_dir(ctx.input_path(source, output), local)
    dist.barrier()
    return str(local)


def start_model(ctx) -> str:
    """The model a training stage starts from (and, for DPO, KTO and RL, its reference): its `start` input
    (SFT's model when that stage runs; an RL stage's `init_from` stage), else the configured base model."""
    return fetch_model(ctx, ctx.inputs.start) if ctx.inputs.start else resolve_model(ctx.cfg.model)


def write_metrics(ctx, table: pa.Table, name: str = "metrics.parquet") -> str:
    """The stage's curves (its declared `metrics` table), or with `name` a DPO round's."""
    if dist.is_main():
        ctx.write_output("metrics", table, name)
    return name



def quiet(trainer) -> None:
    """Our progress callback logs through `logging`; the Trainer's stdout printer would duplicate it."""
    trainer.remove_callback(PrinterCallback)


@dataclass
class TrainerRun:
    """The resume / checkpoint / progress wiring every Trainer stage shares (SFT, reward model, DPO)."""

    ctx: object
    out_dir: Path
    progress: ProgressAndMetrics
    resume: tuple[int, Path] | None

    @classmethod
    def start(cls, ctx, step_offset: int = 0) -> TrainerRun:
        resume = latest_checkpoint(ctx)
        if resume:
            ctx.log.info("%s: resuming from checkpoint at step %d", ctx.stage, resume[0])
        return cls(ctx, fresh_output_dir(ctx), ProgressAndMetrics(ctx.stage, ctx.log, step_offset), resume)

    @property
    def callbacks(self) -> list:
        return [self.progress, MirrorCheckpoints(self.ctx, self.out_dir, self.progress.offset)]

    @property
    def resumed_from_step(self) -> int | None:
        return self.resume[0] if self.resume else None

    def build(self, trainer_cls, model, args, rows: list[dict], tokenizer, opts, **extra):
        """The TRL trainer of a policy stage on `rows`, with this run's callbacks and the stage's LoRA."""
        from datasets import Dataset

        # TRL's trainers seed with args.seed (run.seed) before they add the LoRA adapters (tests/test_keys.py)
        return trainer_cls(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                           peft_config=peft_config(opts), callbacks=self.callbacks, **extra)

    def train(self, trainer):
        quiet(trainer)
        return trainer.train(resume_from_checkpoint=str(self.resume[1]) if self.resume else None)

    def publish_policy(self, trainer, tokenizer, opts, metrics: dict[str, float]) -> dict[str, str]:
        """After training a policy: merge LoRA, add held-out verifier accuracy to `metrics` as
        `<stage>/accuracy`, publish the model and the metrics table. Returns the stage's outputs."""
        ctx = self.ctx
        trained = trainer.model.merge_and_unload() if opts.lora.enabled else trainer.model
        if dist.is_main() and (accuracy := held_out_accuracy(ctx, trained, tokenizer, opts)) is not None:
            metrics[f"{ctx.stage}/accuracy"] = accuracy
        return {"model": publish_model(ctx, trained, tokenizer), "metrics": write_metrics(ctx, self.progress.table())}


def held_out_accuracy(ctx, model, tokenizer, opts) -> float | None:
    """Greedy verifier accuracy on the first opts.eval_prompts held-out prompts (logged); None when 0."""
    from rlhf.engines.generation import verifier_accuracy
    from rlhf.data.sources import make_task

    task = make_task(ctx.cfg.data)
    held_out = [] if task.open_ended else task.eval[: opts.eval_prompts]  # open-ended: nothing to verify
    if not held_out:
        return None
    accuracy = verifier_accuracy(model, tokenizer, task, held_out, opts.eval_max_new_tokens)
    ctx.log.info("%s: trained policy held-out accuracy %.3f", ctx.stage, accuracy)
    return accuracy
