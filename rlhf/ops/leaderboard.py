"""`rlhf leaderboard`: every policy whose answers the store keeps (rlhf/engines/answers.py), rated against
every other policy answered on the same prompts with the same sampling settings, whichever run evaluated
it: Bradley-Terry Elo with prompt-bootstrap 95% intervals, the length-controlled rating and the judge's
length coefficient (rlhf/maths/style_control.py), and verifier accuracy. Judged by the verifier scores kept
with the answers (right beats wrong, equal is a tie), so only verified prompt sets are rated.

Written to `<root>/_leaderboard/leaderboard.parquet`, which `rlhf query` exposes as the `leaderboard` view.
Cache manifests come from a shared store: each is type-checked, and one that is not is skipped and named.
"""

from __future__ import annotations

import itertools
import json
import re
import sys

import numpy as np
import pyarrow as pa

from rlhf.engines.answers import KIND
from rlhf.maths.bradley_terry import rate
from rlhf.maths.style_control import rate_length_controlled
from rlhf.core.tables import LEADERBOARD_SCHEMA, ANSWERS_SCHEMA

TABLE = ("_leaderboard", "leaderboard.parquet")


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


def groups(found: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Verified entries by (prompt set, sampling settings); a name two entries share (a run retrained under the
    same name) gets its key's prefix, so neither hides the other."""
    out: dict[tuple[str, str], list[dict]] = {}
    for e in found:
        if e["verified"]:
            out.setdefault((e["prompt_set"], e["params"]), []).append(e)
    for members in out.values():
        names = [e["policy"] for e in members]
        for e in members:
            if names.count(e["policy"]) > 1:
                e["policy"] = f"{e['policy']}@{e['key'][:8]}"
    return {k: sorted(v, key=lambda e: e["policy"]) for k, v in out.items() if len(v) > 1}


def rate_group(store, members: list[dict], rounds: int, seed: int) -> list[dict]:
    """The group's rows: battles on every (prompt, sample) all members answered, one per pair of policies."""
    tables = {e["policy"]: store.read_table(store.path("_cache", KIND, e["key"], "answers.parquet"), ANSWERS_SCHEMA)
              .to_pylist() for e in members}
    by = {p: {(r["prompt_id"], r["sample_index"]): r for r in rows} for p, rows in tables.items()}
    shared = sorted(set.intersection(*(set(b) for b in by.values())))
    names = [e["policy"] for e in members]
    a, b, score, la, lb, cluster = [], [], [], [], [], []
    for (i, p), (j, q) in itertools.combinations(enumerate(names), 2):
        for pid in shared:
            ra, rb = by[p][pid], by[q][pid]
            ca, cb = ra["verifier_score"] >= 1.0, rb["verifier_score"] >= 1.0
            a.append(i), b.append(j), score.append(0.5 if ca == cb else float(ca))
            la.append(len(ra["response_ids"])), lb.append(len(rb["response_ids"])), cluster.append(pid[0])
    a, b, score = np.array(a), np.array(b), np.array(score)
    raw = rate(a, b, score, names, names[0], rounds, seed, clusters=np.array(cluster))
    lc = rate_length_controlled(a, b, score, np.array(la), np.array(lb), names, names[0], rounds, seed,
                                clusters=np.array(cluster))
    return [{"prompt_set": e["prompt_set"], "params": e["params"], "policy": e["policy"], "run": e["run"],
             "elo": float(raw.elo[k]), "ci_low": float(raw.ci_low[k]), "ci_high": float(raw.ci_high[k]),
             "lc_elo": float(lc.elo[k]), "lc_ci_low": float(lc.ci_low[k]), "lc_ci_high": float(lc.ci_high[k]),
             "length_coef": lc.gamma, "accuracy": float(np.mean([by[e["policy"]][pid]["verifier_score"] >= 1.0 for pid in shared])),
             "answers": len(shared), "battles": int(raw.battles[k].sum())} for k, e in enumerate(members)]


def build(store, rounds: int = 1000, seed: int = 0) -> pa.Table:
    """Rates every group and writes the table (read by `rlhf query` as `leaderboard`)."""
    rows = [r for members in groups(entries(store)).values() for r in rate_group(store, members, rounds, seed)]
    table = pa.Table.from_pylist(rows, schema=LEADERBOARD_SCHEMA)
    store.write_table(store.path(*TABLE), table, LEADERBOARD_SCHEMA)
    return table
