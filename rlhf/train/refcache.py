"""The durable reference log-prob cache: entries under `<root>/_cache/<kind>/<key>/`, shared by runs.

An entry's key hashes what determines its numbers (reference_key); its manifest.json is written last, so
an entry without one is incomplete and never read. The ref_logprobs stage (DPO's reference) and the kto
stage (its own KL pairing) keep entries of different kinds; they share this module, not each other.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa

from rlhf.core import codehash, fingerprint
from rlhf.engines.logprobs import TokenizedPair, length_problem
from rlhf.core.tables import REF_LOGPS_SCHEMA
from rlhf.data.userdata import sift

TABLE = "ref_logps.parquet"


class BadPairs(ValueError):
    pass


def rows_fingerprint(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


TOKENIZER_FILES = ("tokenizer*.json", "special_tokens_map.json", "chat_template*")


def reference_key(stage: str, model_dir: Path, rows: list[dict], dtype: str, **settings) -> str:
    """Content key of a reference log-prob cache entry: the weights and tokenizer files themselves (not a
    name), the rows, the dtype, and the code that computes the numbers with the numeric packages it imports
    (the stage's import closure, as its own content key has them: rlhf/core/fingerprint.py)."""
    files = codehash.code_files(f"stages/{stage}.py")
    parts = {
        "weights": fingerprint.folder_digest(model_dir, ("*.safetensors",)),
        "tokenizer": fingerprint.folder_digest(model_dir, TOKENIZER_FILES),
        "data": rows_fingerprint(rows),
        "dtype": dtype,
        "code": codehash.digests(files),
        "packages": fingerprint.packages(codehash.third_party(files)),
        **settings,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def ref_table(pairs: list[TokenizedPair], out) -> pa.Table:
    """REF_LOGPS_SCHEMA rows of `pair_logps` output `out`, in the order of `pairs`."""
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
    label = noun.split()[-1]

    def problem(pair: TokenizedPair) -> str | None:
        why = length_problem(pair, max_length)
        return None if why is None else f"{label} {pair.pair_id}: {why}"

    return sift(pairs, problem, on_bad_row, log, f"{noun}s", error=BadPairs)
