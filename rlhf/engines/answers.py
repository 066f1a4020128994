"""Answers kept per (policy weights, prompts, sampling settings): `<root>/_cache/answers/<key>/`, shared by
every run in the store, so an evaluation that adds a tenth policy generates only that policy's answers and
`rlhf leaderboard` can rate every policy ever evaluated on the same prompts.

An entry's key hashes what determines its answers and their scores: the policy's weights (a stage's content
key, or a model's fingerprint), the prompts themselves, the sampling settings and batch size (each batch
is seeded by its index), the verifier that scored them, and the generating code with the numeric packages
it imports; for episodes (eval.environment), the environment's settings and, for a class of the user's,
its source. An episode keeps its policy mask and error beside its transcript. `answers.parquet` holds one
row per answer; `manifest.json`, written last, names the policy, the run that generated it, the prompt set
(a digest of the prompts: what the leaderboard groups by) and the counts. An entry without a manifest is
incomplete and never read.

The prompts themselves are kept once per prompt set, `<root>/_cache/prompt_sets/<digest>.json`, so a judge
that reads the question (a reward model rating answers across runs) can score answers it did not see
generated. The digest is recomputed on read: a file whose prompts are not the set it names is not used.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone

import pyarrow as pa

from rlhf.engines.samples import Generation, SamplingParams
from rlhf.core.store import SchemaMismatch
from rlhf.core.tables import ANSWERS_SCHEMA, ANSWERS_SCHEMA_V1

KIND = "answers"
ROLES = ("system", "user", "assistant")


def prompt_set(prompts: list[list[dict]]) -> str:
    """A digest of the prompts in order: the same prompts, the same set, whichever run or file gave them."""
    return hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:16]


def prompts_path(store, digest: str) -> str:
    return store.path("_cache", "prompt_sets", f"{digest}.json")


def keep_prompts(store, prompts: list[list[dict]]) -> str:
    """Stores the prompt set's text once (idempotent: the same digest is the same content)."""
    digest = prompt_set(prompts)
    if store.read_json(prompts_path(store, digest)) is None:
        store.write_json(prompts_path(store, digest), {"prompts": prompts})
    return digest


def read_prompts(store, digest: str) -> list[list[dict]] | None:
    """The prompt set's messages, or None when the store has no text for it or the text is not that set."""
    try:
        obj = store.read_json(prompts_path(store, digest))
    except (ValueError, RecursionError):
        return None
    prompts = obj.get("prompts") if isinstance(obj, dict) else None
    ok = isinstance(prompts, list) and all(
        isinstance(p, list) and p and all(isinstance(m, dict) and set(m) == {"role", "content"}
                                          and m["role"] in ROLES and isinstance(m["content"], str) for m in p)
        for p in prompts)
    return prompts if ok and prompt_set(prompts) == digest else None


def answers_key(weights: dict, prompts: list[list[dict]], params: SamplingParams, batch_size: int, verifier: str,
                code: dict, dtype: str, environment: dict | None = None) -> str:
    """`dtype`: the one the answers were generated in (a stage's key names its training dtype, not eval's).
    `environment`: what identifies the episodes' environment (settings, a user class's source); single
    answers leave it out, so their keys are those of entries written before episodes were kept."""
    parts = {"weights": weights, "prompts": prompt_set(prompts), "params": params.__dict__, "batch_size": batch_size,
             "verifier": verifier, "code": code, "dtype": dtype, **({"environment": environment} if environment else {})}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def read_rows(store, path: str) -> list[dict]:
    """An entry's rows; an entry written before episodes were kept reads as single answers (no mask). Raises
    SchemaMismatch for any other table."""
    try:
        return store.read_table(path, ANSWERS_SCHEMA).to_pylist()
    except SchemaMismatch:
        rows = store.read_table(path, ANSWERS_SCHEMA_V1).to_pylist()
        return [{**r, "policy_mask": None, "env_error": None} for r in rows]


def entry_path(store, key: str) -> str:
    return store.path("_cache", KIND, key)


def rows_ok(rows: list[dict]) -> bool:
    """Rows this code could have written (a shared store's files are checked, not trusted): an index and
    tokens on every row, and an episode's mask of 0s and 1s, one per token."""
    return all(r["prompt_index"] >= 0 and r["response_ids"] is not None
               and (r["policy_mask"] is None or (len(r["policy_mask"]) == len(r["response_ids"])
                                                 and set(r["policy_mask"]) <= {0, 1})) for r in rows)


def read(store, key: str) -> tuple[list[Generation], list[float | None]] | None:
    """The entry's answers (as the engine gave them) and their verifier scores, or None when there is no
    complete entry."""
    path = entry_path(store, key)
    if store.read_json(f"{path}/manifest.json") is None:
        return None
    rows = read_rows(store, f"{path}/answers.parquet")
    if not rows_ok(rows):
        return None  # generated again, and the entry rewritten
    gens = [Generation(r["prompt_index"], r["sample_index"], r["response_ids"], r["logprobs"], r["response"],
                       r["finish_reason"], mask=r["policy_mask"], error=r["env_error"]) for r in rows]
    return gens, [r["verifier_score"] for r in rows]


def write(store, key: str, gens: list[Generation], scores: list[float | None], prompt_ids: list[str], meta: dict) -> None:
    """Answers first, then the manifest (meta: policy, run, prompt set, params, verifier) last."""
    path = entry_path(store, key)
    rows = [{"prompt_index": g.prompt_index, "prompt_id": prompt_ids[g.prompt_index], "sample_index": g.sample_index,
             "response": g.text, "response_ids": g.token_ids, "logprobs": g.logprobs, "finish_reason": g.finish_reason,
             "verifier_score": s, "policy_mask": g.mask, "env_error": g.error} for g, s in zip(gens, scores)]
    store.write_table(f"{path}/answers.parquet", pa.Table.from_pylist(rows, schema=ANSWERS_SCHEMA), ANSWERS_SCHEMA)
    store.write_json(f"{path}/manifest.json", {**meta, "key": key, "answers": len(rows),
                                               "created": datetime.now(timezone.utc).isoformat(timespec="seconds")})
