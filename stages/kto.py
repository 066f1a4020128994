"""KTO from a durable reference log-prob cache (TRL KTOTrainer; Ethayarajh et al. 2024).

Trains the policy (from SFT, else the base model) on unpaired desirable / undesirable completions:
`data.unpaired_path` ({prompt, completion, label}) or the preference pairs split in two.

KTO needs two reference numbers per example: log pi_ref(y|x), and for the KL term z0 the log-prob of the
example's prompt with its batch neighbour's completion (TRL rotates completions within each fixed-order
batch of per_device_batch_size). Because that pairing is made by TRL's own preprocessing, the cache is
filled inside this stage by TRL's own `compute_ref_log_probs`, run on the initial policy before training
(the reference *is* the initial policy, so no second model is ever loaded), rather than by a separate
stage that would have to mirror TRL's private pairing. The entry is content-addressed like DPO's
(rlhf/train/refcache.py): `<root>/_cache/kto_ref_logprobs/<key>/`, its manifest written last, and the key
covers the reference weights and tokenizer files, the examples in order, max_length, the batch size that
fixes the KL pairing, dtype, and the stage's code with the numeric packages it imports. Any run with the same key does zero reference
forward passes, so a sweep over beta or the class weights pays the reference pass once.
Outputs: `model/`, `metrics.parquet`, `ref_logps.parquet` (a copy of the entry).
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import torch
from datasets import Dataset
from torch.utils.data import DataLoader
from trl import KTOConfig as TRLKTOConfig
from trl import KTOTrainer

from rlhf.core.config import KTOConfig
from rlhf.engines.logprobs import CompletionOnlyScoring, completion_only_scoring, tokenize_pair
from rlhf.core.models import load_causal_lm, load_tokenizer
from rlhf.data.pairs import onpolicy_pairs, unpaired_examples
from rlhf.core.stage import StageContext, StageResult
from rlhf.train.training import TrainerRun, start_model, trainer_kwargs
from rlhf.train.refcache import TABLE, read_entry, reference_key, screen, write_entry
from rlhf.core.tables import KTO_REF_SCHEMA

COLUMNS = ("ref_logps", "ref_KL_logps")


class CachedRefKTOTrainer(CompletionOnlyScoring, KTOTrainer):
    """KTOTrainer whose reference log-probs come from the dataset (a cache hit), or else are computed once
    with TRL's own `compute_ref_log_probs` without TRL's per-process datasets cache (we keep our own)."""

    ref_forward_batches = 0

    def __init__(self, *args, on_ref_batch=None, **kwargs):
        self.on_ref_batch = on_ref_batch  # (done, total) after each reference batch; set before TRL's init runs it
        super().__init__(*args, **kwargs)

    def _precompute_ref_logps(self, dataset, name, batch_size):
        wanted = list(COLUMNS) if self.calculate_KL else ["ref_logps"]
        present = [c for c in wanted if c in dataset.column_names]
        if present == wanted:
            return dataset
        if present:
            raise ValueError(f"{name} dataset has {present} but not {wanted}: a partial reference cache")
        logps, kl_logps = [], []
        loader = DataLoader(dataset, batch_size=batch_size, collate_fn=self.data_collator, shuffle=False)
        for batch in loader:
            batch = {k: v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            with completion_only_scoring():
                logp, kl_logp = self.compute_ref_log_probs(self.model, batch)
            logps += logp.double().cpu().tolist()
            kl_logps += kl_logp.double().cpu().tolist() if kl_logp is not None else [None] * len(logp)
            self.ref_forward_batches += 1
            if self.on_ref_batch is not None:
                self.on_ref_batch(self.ref_forward_batches, len(loader))
        dataset = dataset.add_column("ref_logps", logps)
        return dataset.add_column("ref_KL_logps", kl_logps) if self.calculate_KL else dataset


def screen_examples(tokenizer, rows: list[dict], max_length: int, on_bad_row: str, log) -> tuple[list[dict], list[str]]:
    """Empty or over-long completions reported by example id; KTO tokenises a completion exactly as DPO
    tokenises each side of a pair, so the pair tokeniser screens it with chosen = rejected."""
    tokenized = [tokenize_pair(tokenizer, {"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"],
                                           "pair_id": r["example_id"]}) for r in rows]
    kept, problems = screen(tokenized, max_length, on_bad_row, log, noun="KTO example")
    ids = {t.pair_id for t in kept}
    return [r for r in rows if r["example_id"] in ids], problems


def with_cache(rows: list[dict], table: pa.Table) -> list[dict]:
    cached = {r["example_id"]: r for r in table.to_pylist()}
    if set(cached) != {r["example_id"] for r in rows}:
        raise ValueError("cache entry does not cover exactly these examples: the cache key is missing an input")
    return [{**r, **{c: cached[r["example_id"]][c] for c in COLUMNS}} for r in rows]


def to_table(dataset: Dataset) -> pa.Table:
    kl = dataset["ref_KL_logps"] if "ref_KL_logps" in dataset.column_names else [None] * len(dataset)
    return pa.Table.from_pydict(
        {"example_id": dataset["example_id"], "label": dataset["label"], "ref_logps": dataset["ref_logps"], "ref_KL_logps": kl},
        schema=KTO_REF_SCHEMA,
    )


def run(cfg: KTOConfig, ctx: StageContext) -> StageResult:
    pcfg = ctx.cfg
    rows, dropped = unpaired_examples(pcfg.data, ctx.log, onpolicy_pairs(ctx) if ctx.inputs.pairs else None)
    init = Path(start_model(ctx))
    tokenizer = load_tokenizer(str(init))
    rows, problems = screen_examples(tokenizer, rows, cfg.max_length, pcfg.data.on_bad_row, ctx.log)

    key = reference_key("kto", init, rows, pcfg.model.dtype, max_length=cfg.max_length,
                        kl_batch_size=cfg.per_device_batch_size if cfg.needs_kl() else None)
    entry, cached = read_entry(ctx, "kto_ref_logprobs", key, KTO_REF_SCHEMA)
    hit = cached is not None
    if hit:
        ctx.log.info("kto: reference cache hit %s: zero reference forward passes", key[:12])
        rows = with_cache(rows, cached)
    model = load_causal_lm(str(init), pcfg.model, trained=not cfg.lora.enabled)

    tr = TrainerRun.start(ctx)
    args = TRLKTOConfig(
        **trainer_kwargs(cfg, tr.out_dir, pcfg.run.seed, pcfg.model.dtype),
        max_length=cfg.max_length,
        beta=cfg.beta,
        loss_type=cfg.loss_type,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
        precompute_ref_log_probs=True,  # with the override above: the cache, or one pass on the initial policy
    )
    t0 = time.perf_counter()

    def on_ref_batch(done: int, total: int) -> None:
        elapsed = time.perf_counter() - t0
        ctx.log.info("kto: reference log-probs, batch %d/%d, %.1f s/batch, ETA %.0fs", done, total, elapsed / done,
                     elapsed / done * (total - done))

    trainer = tr.build(CachedRefKTOTrainer, model, args, rows, tokenizer, cfg, on_ref_batch=on_ref_batch)
    if trainer.ref_model is not None:  # guards the TRL behaviour this stage depends on
        raise RuntimeError("KTOTrainer built a reference model although the reference log-probs are precomputed")
    table = to_table(trainer.train_dataset)
    if not hit:
        ctx.log.info("kto: reference log-probs of %d examples in %d batches, cached as %s",
                     table.num_rows, trainer.ref_forward_batches, key[:12])
        write_entry(ctx, entry, key, table, KTO_REF_SCHEMA)
    ctx.write_output("ref_logps", table, TABLE)

    result = tr.train(trainer)
    metrics = {
        "kto/train_loss": float(result.training_loss),
        "kto/steps": float(trainer.state.global_step),
        "kto/ref_forward_batches": float(trainer.ref_forward_batches),
        "kto/cache_hit": float(hit),
    }
    last = {r["name"]: r["value"] for r in tr.progress.rows if r["name"].startswith(("rewards/", "kl"))}
    metrics.update({f"kto/{k}": v for k, v in last.items()})
    outputs = {**tr.publish_policy(trainer, tokenizer, cfg, metrics), "ref_logps": TABLE,
               "cache_entry": f"_cache/kto_ref_logprobs/{key}"}
    n_good = sum(r["label"] for r in rows)
    return StageResult(
        outputs=outputs,
        rows={"desirable": n_good, "undesirable": len(rows) - n_good, "dropped": dropped + len(problems)},
        metrics=metrics,
        resumed_from_step=tr.resumed_from_step,
    )
