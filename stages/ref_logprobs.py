"""Reference log-prob cache: log pi_ref(y|x) of every chosen and rejected completion, as Parquet.

Content-addressed and durable (TRL keeps these in memory per run; TRL issue 3985, NeMo RL issue 2484):
the cache key hashes the reference weights (a digest of the safetensors files), the tokenizer files, the
pairs' content, max_length, dtype, whether per-token values are kept, and the code (this stage's import
closure, rlhf/engines/logprobs.py among it) with the numeric packages it imports (TRL, whose tokenisation
it mirrors, among them). A complete entry under
`<root>/_cache/ref_logprobs/<key>/` (its manifest.json written last) is reused by any run: zero forward
passes. Output: `ref_logps.parquet` in the stage prefix, a copy of the entry.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rlhf.core import progress
from rlhf.core.config import RefLogprobsConfig
from rlhf.engines.logprobs import pair_logps, tokenize_pair
from rlhf.core.models import inference_model, load_causal_lm, load_tokenizer
from rlhf.data.pairs import stage_pairs
from rlhf.core.stage import StageContext, StageResult
from rlhf.train.refcache import TABLE, read_entry, ref_table, reference_key, screen, write_entry
from rlhf.train.training import start_model
from rlhf.core.tables import REF_LOGPS_SCHEMA


def cache_key(model_dir: Path, rows: list[dict], cfg: RefLogprobsConfig, dtype: str) -> str:
    return reference_key("ref_logprobs", model_dir, rows, dtype, max_length=cfg.max_length, per_token=cfg.per_token)


def run(cfg: RefLogprobsConfig, ctx: StageContext) -> StageResult:
    pcfg = ctx.cfg
    rows, dropped_rows = stage_pairs(ctx)
    model_dir = Path(start_model(ctx))
    tokenizer = load_tokenizer(str(model_dir))
    pairs, problems = screen([tokenize_pair(tokenizer, r) for r in rows], cfg.max_length, pcfg.data.on_bad_row, ctx.log)

    mcfg = inference_model(pcfg.model)  # a frozen forward pass: model.inference_dtype
    key = cache_key(model_dir, rows, cfg, mcfg.dtype)
    entry, table = read_entry(ctx, "ref_logprobs", key, REF_LOGPS_SCHEMA)
    metrics = {"ref_logprobs/pairs": float(len(pairs)), "ref_logprobs/forward_batches": 0.0, "ref_logprobs/cache_hit": 1.0}
    if table is not None:
        ctx.log.info("ref_logprobs: cache hit %s: zero forward passes", key[:12])
    else:
        model = load_causal_lm(str(model_dir), mcfg)
        t0, tokens = time.perf_counter(), [0]

        def on_batch(done: int, batch_tokens: int) -> None:
            tokens[0] += batch_tokens
            metrics["ref_logprobs/forward_batches"] += 1
            rate = tokens[0] / (time.perf_counter() - t0)
            eta = (len(pairs) - done) * (time.perf_counter() - t0) / done
            ctx.log.info("ref_logprobs: %d/%d pairs, %.0f tokens/s, ETA %.0fs", done, len(pairs), rate, eta)
            progress.report(ctx.stage, done, len(pairs))

        with torch.inference_mode():
            out = pair_logps(model, tokenizer, pairs, cfg.max_length, cfg.batch_size, cfg.per_token, on_batch=on_batch)
        seconds = time.perf_counter() - t0
        metrics.update({"ref_logprobs/cache_hit": 0.0, "ref_logprobs/seconds": seconds,
                        "ref_logprobs/tokens_per_s": tokens[0] / seconds})
        table = ref_table(pairs, out)
        write_entry(ctx, entry, key, table, REF_LOGPS_SCHEMA)
    ctx.write_output("ref_logps", table, TABLE)
    return StageResult(
        outputs={"ref_logps": TABLE, "cache_entry": f"_cache/ref_logprobs/{key}"},
        rows={"pairs": table.num_rows, "dropped": dropped_rows + len(problems)},
        metrics=metrics,
    )
