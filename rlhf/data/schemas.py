"""The eval stage's tables: their Parquet schemas, which `rlhf query` exposes as DuckDB views."""

from __future__ import annotations

import pyarrow as pa

S, F, I, B = pa.string(), pa.float64(), pa.int64(), pa.bool_()


def _schema(*fields) -> pa.Schema:
    return pa.schema([pa.field(name, typ) for name, typ in fields])


SCHEMAS = {
    "samples": _schema(("run", S), ("policy", S), ("prompt_id", S), ("sample_index", I), ("prompt", S),
                       ("response", S), ("verifier_score", F), ("correct", B), ("rm_reward", F),
                       ("response_tokens", I), ("log_ratio_to_ref", F), ("finish_reason", S)),
    "battles": _schema(("run", S), ("prompt_id", S), ("sample_index", I), ("judge", S), ("policy_a", S),
                       ("policy_b", S), ("score_a", F), ("tokens_a", I), ("tokens_b", I)),
    # lc_*: length-controlled Elo (rlhf/maths/style_control.py); length_coef: the judge's preference for
    # longer answers in log-odds per unit of normalised length difference, the same on each of its rows
    "ratings": _schema(("run", S), ("judge", S), ("policy", S), ("elo", F), ("ci_low", F), ("ci_high", F),
                       ("battles", I), ("accuracy", F), ("lc_elo", F), ("lc_ci_low", F), ("lc_ci_high", F),
                       ("length_coef", F), ("length_coef_ci_low", F), ("length_coef_ci_high", F)),
    "metrics": _schema(("run", S), ("policy", S), ("name", S), ("value", F)),
    "accuracy_diffs": _schema(("run", S), ("policy_a", S), ("policy_b", S), ("accuracy_diff", F),
                              ("ci_low", F), ("ci_high", F)),
    "run": _schema(("run", S), ("profile", S), ("model", S), ("finished_at", S), ("stage_keys", S), ("config", S)),
}
