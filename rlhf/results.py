"""Evaluation results in DuckDB: views over every run's eval Parquet files, local or S3.

No database file to keep in sync: each query opens an in-memory DuckDB, registers the store's fsspec
filesystem (DuckDB's httpfs cannot be installed offline) and defines one view per table over `<root>/<run>/eval/<table>.parquet` of every run whose eval stage
completed, so results accumulate across runs by construction. Only SELECT,
EXPLAIN and DESCRIBE statements run; anything that could write (DROP, INSERT, COPY ... TO, ATTACH,
INSTALL, SET, ...) is refused before it reaches DuckDB.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa

from rlhf.store import ArtifactStore

S, F, I, B = pa.string(), pa.float64(), pa.int64(), pa.bool_()


def _schema(*fields) -> pa.Schema:
    return pa.schema([pa.field(name, typ) for name, typ in fields])


SCHEMAS = {
    "samples": _schema(("run", S), ("policy", S), ("prompt_id", S), ("sample_index", I), ("prompt", S),
                       ("response", S), ("verifier_score", F), ("correct", B), ("rm_reward", F),
                       ("response_tokens", I), ("log_ratio_to_ref", F), ("finish_reason", S)),
    "battles": _schema(("run", S), ("prompt_id", S), ("sample_index", I), ("judge", S), ("policy_a", S),
                       ("policy_b", S), ("score_a", F)),
    "ratings": _schema(("run", S), ("judge", S), ("policy", S), ("elo", F), ("ci_low", F), ("ci_high", F),
                       ("battles", I), ("accuracy", F)),
    "metrics": _schema(("run", S), ("policy", S), ("name", S), ("value", F)),
    "accuracy_diffs": _schema(("run", S), ("policy_a", S), ("policy_b", S), ("accuracy_diff", F),
                              ("ci_low", F), ("ci_high", F)),
    "run": _schema(("run", S), ("profile", S), ("model", S), ("finished_at", S), ("stage_keys", S), ("config", S)),
}
VIEWS = {"samples": "samples", "battles": "battles", "ratings": "ratings", "metrics": "metrics",
         "accuracy_diffs": "accuracy_diffs", "runs": "run"}
READ_ONLY = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


class QueryRefused(ValueError):
    pass


def connect(store: ArtifactStore) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    prefix = store.root if store.is_local else f"s3://{store.root}"
    if not store.is_local:
        con.register_filesystem(store.fs)
    # Only runs whose eval stage completed (manifest written last) are visible: a half-written eval
    # prefix is never read as results.
    runs = sorted(p.rstrip("/").split("/")[-3] for p in store.fs.glob(store.path("*", "eval", "manifest.json")))
    for view, table in VIEWS.items():
        present = {p.rstrip("/").split("/")[-3] for p in store.fs.glob(store.path("*", "eval", f"{table}.parquet"))}
        files = [f"{prefix}/{run}/eval/{table}.parquet" for run in runs if run in present]
        if files:
            listed = ", ".join(f"'{f}'" for f in files)
            source = f"read_parquet([{listed}], union_by_name = true)"
        else:  # no run has finished an eval yet: an empty view with the right columns
            cols = ", ".join(f"NULL::{_duck_type(f.type)} AS {f.name}" for f in SCHEMAS[table])
            source = f"(SELECT {cols} WHERE false)"
        con.execute(f"CREATE VIEW {view} AS SELECT * FROM {source}")
    return con


def _duck_type(t: pa.DataType) -> str:
    return {pa.string(): "VARCHAR", pa.float64(): "DOUBLE", pa.int64(): "BIGINT", pa.bool_(): "BOOLEAN"}[t]


def check_read_only(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    statements = con.extract_statements(sql)
    if not statements:
        raise QueryRefused("empty query")
    for st in statements:
        if st.type not in READ_ONLY:
            raise QueryRefused(f"only read-only queries (SELECT, EXPLAIN, DESCRIBE) run here; refused a {st.type.name} statement")


def query(store: ArtifactStore, sql: str) -> pa.Table:
    con = connect(store)
    check_read_only(con, sql)
    return con.sql(sql).to_arrow_table()
