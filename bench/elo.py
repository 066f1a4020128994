"""Ratings and results at scale, on this machine.

  1. 100k battles among 10 policies: Bradley-Terry fit + 1000 bootstrap rounds (target < 10 s).
  2. A DuckDB aggregate over 1M battle rows in Parquet through the results views (target < 1 s).
Run: .venv/bin/python bench/elo.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhf.maths.bradley_terry import rate  # noqa: E402
from rlhf.core.config import StorageConfig  # noqa: E402
from rlhf.ops.results import query  # noqa: E402
from rlhf.core.store import ArtifactStore  # noqa: E402
from rlhf.core.tables import EVAL_SCHEMAS  # noqa: E402


def battles(n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    true = rng.normal(1000, 150, k)
    a = rng.integers(0, k, n)
    b = (a + rng.integers(1, k, n)) % k
    p = 1 / (1 + 10 ** ((true[b] - true[a]) / 400))
    u = rng.random(n)
    return a, b, np.where(u < 0.1, 0.5, (rng.random(n) < p).astype(float))


def main() -> None:
    names = [f"p{i}" for i in range(10)]
    a, b, s = battles(100_000, 10)
    t0 = time.perf_counter()
    r = rate(a, b, s, names, anchor="p0", rounds=1000)
    fit_s = time.perf_counter() - t0

    n = 1_000_000
    with tempfile.TemporaryDirectory() as root:
        store = ArtifactStore(StorageConfig(url=root))
        a, b, s = battles(n, 10, seed=1)
        table = pa.table({
            "run": ["bench"] * n, "prompt_id": [f"eval-{i % 5000}" for i in range(n)], "sample_index": np.zeros(n, np.int64),
            "judge": ["verifier"] * n, "policy_a": np.array(names)[a], "policy_b": np.array(names)[b], "score_a": s,
        }, schema=EVAL_SCHEMAS["battles"])
        store.write_table(store.stage_path("bench", "eval", "battles.parquet"), table, EVAL_SCHEMAS["battles"])
        store.write_manifest("bench", "eval", {"key": "bench"})
        sql = "select policy_a, policy_b, count(*) n, avg(score_a) win_rate from battles group by 1, 2 order by 1, 2"
        t0 = time.perf_counter()
        out = query(store, sql)
        query_s = time.perf_counter() - t0
    print(json.dumps({
        "bt_fit_plus_1000_bootstrap_100k_battles_10_policies_s": round(fit_s, 3),
        "max_ci95_width_elo": round(float((r.ci_high - r.ci_low).max()), 1),
        "duckdb_group_by_1M_battles_s": round(query_s, 3),
        "result_rows": out.num_rows,
    }))


if __name__ == "__main__":
    main()
