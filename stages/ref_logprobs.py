"""Reference log-prob cache: log pi_ref(y|x) of every chosen and rejected completion, as Parquet.

Content-addressed and durable (TRL keeps these in memory per run; TRL issue 3985, NeMo RL issue 2484):
the cache key hashes the reference weights (a digest of the safetensors files), the tokenizer files, the
pairs' content, max_length, dtype, whether per-token values are kept, and the code (this module,
rlhf/logprobs.py and the TRL version whose tokenisation it mirrors). A complete entry under
`<root>/_cache/ref_logprobs/<key>/` (its manifest.json written last) is reused by any run: zero forward
passes. Output: `ref_logps.parquet` in the stage prefix, a copy of the entry.
"""

from __future__ import annotations

import hashlib
import json
import time
from importlib.metadata import version
from pathlib import Path

import pyarrow as pa
import torch

from rlhf import progress
from rlhf.config import RefLogprobsConfig
from rlhf.logprobs import TokenizedPair, length_problem, pair_logps, tokenize_pair
from rlhf.models import load_causal_lm, load_tokenizer, resolve_model
from rlhf.pairs import stage_pairs
from rlhf.runner import StageContext, StageResult
from rlhf.training import fetch_model

REF_LOGPS_SCHEMA = pa.schema(
    [
        pa.field("pair_id", pa.string(), nullable=False),
        pa.field("ref_chosen_logps", pa.float64(), nullable=False),
        pa.field("ref_rejected_logps", pa.float64(), nullable=False),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("chosen_tokens", pa.int32(), nullable=False),
        pa.field("rejected_tokens", pa.int32(), nullable=False),
        pa.field("ref_chosen_token_logps", pa.list_(pa.float32())),  # null unless per_token
        pa.field("ref_rejected_token_logps", pa.list_(pa.float32())),
    ]
)
TABLE = "ref_logps.parquet"


class BadPairs(ValueError):
    pass


def digest_files(folder: Path, patterns: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for pattern in patterns:
        for path in sorted(folder.glob(pattern)):
            h.update(path.name.encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
    return h.hexdigest()


def rows_fingerprint(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def reference_key(model_dir: Path, rows: list[dict], dtype: str, code: list[Path], **settings) -> str:
    """Content key of a reference log-prob cache entry: the weights and tokenizer files themselves (not a
    name), the rows, the dtype, the code that computes the numbers and the TRL version it follows."""
    parts = {
        "weights": digest_files(model_dir, ("*.safetensors",)),
        "tokenizer": digest_files(model_dir, ("tokenizer*.json", "special_tokens_map.json", "chat_template*")),
        "data": rows_fingerprint(rows),
        "dtype": dtype,
        "code": hashlib.sha256(b"".join(p.read_bytes() for p in code)).hexdigest(),
        "trl": version("trl"),
        **settings,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cache_key(model_dir: Path, rows: list[dict], cfg: RefLogprobsConfig, dtype: str) -> str:
    code = [Path(__file__), Path(__file__).parent.parent / "rlhf" / "logprobs.py"]
    return reference_key(model_dir, rows, dtype, code, max_length=cfg.max_length, per_token=cfg.per_token)


def read_entry(ctx, kind: str, key: str, schema: pa.Schema) -> tuple[str, pa.Table | None]:
    """(entry path, its table) for a complete cache entry of `kind` (manifest present), else (path, None)."""
    entry = ctx.store.path("_cache", kind, key)
    if ctx.store.read_json(f"{entry}/manifest.json") is None:
        return entry, None
    return entry, ctx.store.read_table(f"{entry}/{TABLE}", schema)


def write_entry(ctx, entry: str, key: str, table: pa.Table, schema: pa.Schema) -> None:
    ctx.store.write_table(f"{entry}/{TABLE}", table, schema)
    ctx.store.write_json(f"{entry}/manifest.json", {"key": key, "rows": table.num_rows, "run": ctx.cfg.run.name})  # last


def screen(
    pairs: list[TokenizedPair], max_length: int, on_bad_row: str, log, noun: str = "preference pair"
) -> tuple[list[TokenizedPair], list[str]]:
    """Over-long or empty rows, by id: fail on the first screening (data.on_bad_row: fail) or drop and count."""
    kept, problems = [], []
    for pair in pairs:
        problem = length_problem(pair, max_length)
        if problem is None:
            kept.append(pair)
        else:
            problems.append(f"{noun.split()[-1]} {pair.pair_id}: {problem}")
    if problems and on_bad_row == "fail":
        shown = "\n  ".join(problems[:20])
        raise BadPairs(f"{len(problems)} {noun}s are unusable (data.on_bad_row: fail):\n  {shown}")
    for p in problems:
        log.warning("dropped %s", p)
    if not kept:
        raise BadPairs(f"no usable {noun}s left after screening")
    return kept, problems


def to_table(pairs: list[TokenizedPair], out) -> pa.Table:
    per_token = out.chosen_per_token is not None
    return pa.Table.from_pydict(
        {
            "pair_id": [p.pair_id for p in pairs],
            "ref_chosen_logps": out.chosen.tolist(),
            "ref_rejected_logps": out.rejected.tolist(),
            "prompt_tokens": [len(p.prompt_ids) for p in pairs],
            "chosen_tokens": out.chosen_tokens.tolist(),
            "rejected_tokens": out.rejected_tokens.tolist(),
            "ref_chosen_token_logps": out.chosen_per_token if per_token else [None] * len(pairs),
            "ref_rejected_token_logps": out.rejected_per_token if per_token else [None] * len(pairs),
        },
        schema=REF_LOGPS_SCHEMA,
    )


def run(cfg: RefLogprobsConfig, ctx: StageContext) -> StageResult:
    pcfg = ctx.cfg
    rows, dropped_rows = stage_pairs(ctx)
    model_dir = Path(fetch_model(ctx, "sft") if "sft" in ctx.inputs else resolve_model(pcfg.model))
    tokenizer = load_tokenizer(str(model_dir))
    pairs, problems = screen([tokenize_pair(tokenizer, r) for r in rows], cfg.max_length, pcfg.data.on_bad_row, ctx.log)

    key = cache_key(model_dir, rows, cfg, pcfg.model.dtype)
    entry, table = read_entry(ctx, "ref_logprobs", key, REF_LOGPS_SCHEMA)
    metrics = {"ref_logprobs/pairs": float(len(pairs)), "ref_logprobs/forward_batches": 0.0, "ref_logprobs/cache_hit": 1.0}
    if table is not None:
        ctx.log.info("ref_logprobs: cache hit %s: zero forward passes", key[:12])
    else:
        model = load_causal_lm(str(model_dir), pcfg.model)
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
        table = to_table(pairs, out)
        write_entry(ctx, entry, key, table, REF_LOGPS_SCHEMA)
    ctx.store.write_table(ctx.path(TABLE), table, REF_LOGPS_SCHEMA)
    return StageResult(
        outputs={"ref_logps": TABLE, "cache_entry": f"_cache/ref_logprobs/{key}"},
        rows={"pairs": table.num_rows, "dropped": dropped_rows + len(problems)},
        metrics=metrics,
    )
