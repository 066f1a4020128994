"""`rlhf leaderboard`: every policy whose answers the store keeps (rlhf/engines/answers.py), rated against
every other policy answered on the same prompts with the same sampling settings (episodes: and the same
environment, whose settings are part of `params`), whichever run evaluated it: Bradley-Terry Elo with
prompt-bootstrap 95% intervals, the length-controlled rating and the judge's length coefficient
(rlhf/maths/style_control.py), and verifier accuracy.

Judges: the verifier scores kept with the answers (right beats wrong, equal is a tie) for verified prompt
sets; with a reward model (`--judge-model <run>/reward_model` or `model:<folder or hub id>`), every prompt
set whose text the store keeps, verified or open-ended: the higher reward wins. A reward model's scores are
kept per (judge, answers entry) under `<root>/_cache/judged/`, so a rerun that adds a policy scores only its
answers.

Written to `<root>/_leaderboard/leaderboard.parquet`, which `rlhf query` exposes as the `leaderboard` view.
Cache manifests come from a shared store: each is type-checked, and one that is not is skipped and named.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from rlhf.engines import answers
from rlhf.engines.answers import KIND
from rlhf.maths.bradley_terry import rate
from rlhf.maths.style_control import rate_length_controlled
from rlhf.core.store import SchemaMismatch
from rlhf.core.tables import LEADERBOARD_SCHEMA, LEADERBOARD_TABLE


def entries(store) -> list[dict]:
    """The complete answer entries of the store: {key, policy, run, prompt_set, params, verified}."""
    out = []
    for path in sorted(store.glob(store.path("_cache", KIND, "*", "manifest.json"))):
        key = path.rstrip("/").split("/")[-2]
        try:
            m = json.loads(store.fs.cat_file(path))
        except (ValueError, RecursionError):
            m = None
        ok = (isinstance(m, dict) and re.fullmatch(r"[0-9a-f]{64}", key) and isinstance(m.get("policy"), str)
              and 0 < len(m["policy"]) <= 400 and isinstance(m.get("run"), str) and isinstance(m.get("params"), dict)
              and isinstance(m.get("prompt_set"), str) and re.fullmatch(r"[0-9a-f]{16}", m["prompt_set"])
              and isinstance(m.get("verified"), bool))
        if not ok:
            print(f"rlhf leaderboard: skipped answers entry {key[:70]!r}: not a valid manifest", file=sys.stderr)
            continue
        out.append({"key": key, "policy": m["policy"], "run": m["run"], "prompt_set": m["prompt_set"],
                    "params": json.dumps(m["params"], sort_keys=True), "verified": m["verified"]})
    return out


def with_rows(store, entry: dict) -> bool:
    """Adds the entry's answers (`rows`); False, with the entry named, when its table is missing or is not
    an answers table (a shared store's files are checked, not trusted)."""
    path = store.path("_cache", KIND, entry["key"], "answers.parquet")
    try:
        rows = answers.read_rows(store, path)
    except (SchemaMismatch, OSError, pa.ArrowException) as e:
        print(f"rlhf leaderboard: skipped answers entry {entry['key'][:16]}: {type(e).__name__}: {str(e)[:200]}",
              file=sys.stderr)
        return False
    ok = answers.rows_ok(rows)
    if not ok:
        print(f"rlhf leaderboard: skipped answers entry {entry['key'][:16]}: rows without an index or tokens, "
              "or with a mask that does not fit them", file=sys.stderr)
    entry["rows"] = rows
    return ok


def groups(found: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Entries by (prompt set, sampling settings), groups of two or more; a name two entries share (a run
    retrained under the same name) gets its key's prefix, so neither hides the other."""
    out: dict[tuple[str, str], list[dict]] = {}
    for e in found:
        out.setdefault((e["prompt_set"], e["params"]), []).append(e)
    for members in out.values():
        names = [e["policy"] for e in members]
        for e in members:
            if names.count(e["policy"]) > 1:
                e["policy"] = f"{e['policy']}@{e['key'][:8]}"
    return {k: sorted(v, key=lambda e: e["policy"]) for k, v in out.items() if len(v) > 1}


@dataclass
class RewardJudge:
    """A reward model as the judge: `name` as the table shows it, `key` what identifies its weights."""
    name: str
    key: str
    model: object
    tokenizer: object
    counts: dict = field(default_factory=lambda: {"scored": 0, "reused": 0})


def judge_problem(spec: str) -> str | None:
    """Why `--judge-model` cannot name a reward model, or None: '<run>/reward_model' or 'model:<id or folder>'."""
    from rlhf.core.config import check_name

    if spec.startswith("model:"):
        ok = re.fullmatch(r"model:[^\s\x00-\x1f]{1,300}", spec)
        return None if ok else f"--judge-model {spec[:80]!r}: model:<hub id or local folder>, without spaces or control characters"
    run, sep, stage = spec.rpartition("/")
    if not sep or stage != "reward_model":
        return f"--judge-model {spec[:80]!r}: expected <run>/reward_model (a run's trained reward model) or model:<hub id or folder>"
    try:
        check_name("run", run)
    except ValueError as e:
        return f"--judge-model: {e}"
    return None


def load_judge(store, spec: str, dtype: str) -> RewardJudge:
    """The reward model `spec` names (checked by judge_problem first); ValueError when it does not exist."""
    from rlhf.core import fingerprint

    if spec.startswith("model:"):
        path = spec.removeprefix("model:")
        ident = {"model": path, **fingerprint.model(path)}
        if ident.get("revision") == "unresolved":
            raise ValueError(f"--judge-model {spec!r}: no model folder there, and not a hub id the cache or hub knows")
    else:
        run = spec.partition("/")[0]
        manifest = store.read_manifest(run, "reward_model")
        if manifest is None or not isinstance(manifest.get("outputs", {}).get("model"), str):
            raise ValueError(f"--judge-model {spec!r}: run {run!r} has no complete reward_model stage in the store "
                             f"({store.url(store.stage_path(run, 'reward_model'))})")
        path = store.stage_path(run, "reward_model", manifest["outputs"]["model"])
        if not store.is_local:
            path = str(store.get_dir(path, tempfile.mkdtemp(prefix="rlhf-judge-")))
        ident = {"stage_key": manifest["key"]}
    from rlhf.train.rewards import load_reward_model  # torch: only once the judge is known to exist

    model, tok = load_reward_model(path, dtype)
    return RewardJudge(f"reward_model:{spec.removeprefix('model:') if spec.startswith('model:') else spec}",
                       hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest(), model, tok)


def judged_path(store, judge: RewardJudge, entry_key: str) -> str:
    return store.path("_cache", "judged", hashlib.sha256(f"{judge.key}/{entry_key}".encode()).hexdigest() + ".json")


def rewards_of(store, judge: RewardJudge, entry: dict, rows: list[dict], prompts: list[list[dict]]) -> list[float]:
    """The judge's reward of each answer of an entry: kept ones when the store has them (and they fit the
    entry), else scored now and kept."""
    import torch

    from rlhf.train.rewards import reward_model_scores

    path = judged_path(store, judge, entry["key"])
    try:
        kept = store.read_json(path)
    except (ValueError, RecursionError):
        kept = None
    values = kept.get("rewards") if isinstance(kept, dict) else None
    if (isinstance(values, list) and len(values) == len(rows)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)):
        judge.counts["reused"] += len(rows)
        return [float(v) for v in values]
    with torch.inference_mode():
        values = reward_model_scores(judge.model, judge.tokenizer, [
            prompts[r["prompt_index"]] + [{"role": "assistant", "content": r["response"] or ""}] for r in rows])
    store.write_json(path, {"judge": judge.name, "answers": entry["key"], "rewards": values})
    judge.counts["scored"] += len(rows)
    return values


def rate_group(store, members: list[dict], rounds: int, seed: int, judge: RewardJudge | None = None) -> list[dict]:
    """The group's rows under one judge (the verifier when `judge` is None): battles on every (prompt,
    sample) all members answered, one per pair of policies. [] when this judge cannot rate the group."""
    if judge is None:  # the verifier rates the entries that carry its scores
        members = [e for e in members if e["verified"]]
        if len(members) < 2:
            return []
    tables = {e["policy"]: e["rows"] for e in members}
    if judge is None:
        value = {p: [r["verifier_score"] for r in rows] for p, rows in tables.items()}
    else:
        prompts = answers.read_prompts(store, members[0]["prompt_set"])
        if prompts is None or not all(0 <= r["prompt_index"] < len(prompts) for rows in tables.values() for r in rows):
            print(f"rlhf leaderboard: prompt set {members[0]['prompt_set']}: the store keeps no text of its prompts "
                  "(answers kept before it did); the reward model cannot judge it", file=sys.stderr)
            return []
        value = {e["policy"]: rewards_of(store, judge, e, tables[e["policy"]], prompts) for e in members}
    by = {p: {(r["prompt_id"], r["sample_index"]): (r, v) for r, v in zip(rows, value[p])} for p, rows in tables.items()}
    shared = sorted(set.intersection(*(set(b) for b in by.values())))
    names = [e["policy"] for e in members]
    a, b, score, la, lb, cluster = [], [], [], [], [], []
    for (i, p), (j, q) in itertools.combinations(enumerate(names), 2):
        for pid in shared:
            (ra, va), (rb, vb) = by[p][pid], by[q][pid]
            if judge is None:  # right beats wrong
                va, vb = float(va is not None and va >= 1.0), float(vb is not None and vb >= 1.0)
            a.append(i), b.append(j), score.append(0.5 if va == vb else float(va > vb))
            la.append(len(ra["response_ids"])), lb.append(len(rb["response_ids"])), cluster.append(pid[0])
    a, b, score = np.array(a), np.array(b), np.array(score)
    raw = rate(a, b, score, names, names[0], rounds, seed, clusters=np.array(cluster))
    lc = rate_length_controlled(a, b, score, np.array(la), np.array(lb), names, names[0], rounds, seed,
                                clusters=np.array(cluster))

    def accuracy(policy: str) -> float | None:
        got = [by[policy][pid][0]["verifier_score"] for pid in shared]
        return None if any(v is None for v in got) else float(np.mean([v >= 1.0 for v in got]))

    return [{"prompt_set": e["prompt_set"], "params": e["params"], "judge": "verifier" if judge is None else judge.name,
             "policy": e["policy"], "run": e["run"],
             "elo": float(raw.elo[k]), "ci_low": float(raw.ci_low[k]), "ci_high": float(raw.ci_high[k]),
             "lc_elo": float(lc.elo[k]), "lc_ci_low": float(lc.ci_low[k]), "lc_ci_high": float(lc.ci_high[k]),
             "length_coef": lc.gamma, "accuracy": accuracy(e["policy"]),
             "answers": len(shared), "battles": int(raw.battles[k].sum())} for k, e in enumerate(members)]


def build(store, rounds: int = 1000, seed: int = 0, judge: RewardJudge | None = None) -> pa.Table:
    """Rates every group (by the verifier where verified, and by `judge` where given) and writes the table
    (read by `rlhf query` as `leaderboard`)."""
    found = groups([e for e in entries(store) if with_rows(store, e)])
    rows = [r for members in found.values() for r in rate_group(store, members, rounds, seed)]
    if judge is not None:
        rows += [r for members in found.values() for r in rate_group(store, members, rounds, seed, judge)]
    elif any(sum(e["verified"] for e in members) < len(members) for members in found.values()):
        print("rlhf leaderboard: open-ended prompt sets (no verifier scores) need a reward model as the judge: "
              "--judge-model <run>/reward_model", file=sys.stderr)
    table = pa.Table.from_pylist(rows, schema=LEADERBOARD_SCHEMA)
    store.write_table(store.path(*LEADERBOARD_TABLE), table, LEADERBOARD_SCHEMA)
    return table
