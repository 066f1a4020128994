"""Evaluation results in DuckDB: one view per table over every run's eval Parquet files, local or S3.

No database file to keep in sync: each query opens an in-memory DuckDB and registers one pyarrow
dataset per table over `<root>/<run>/eval/<table>.parquet` of every run whose eval stage completed, so
results accumulate across runs by construction.

Read-only in depth, because a shared bucket is written by other people:
  * no SQL is built from store data: file paths reach pyarrow as a list, never as SQL text, and a
    run folder whose name fails the run-name rule is skipped (and named on stderr);
  * pyarrow reads the files, so DuckDB itself needs no file system: the connection is opened with
    `enable_external_access = false` (no file, URL, ATTACH, COPY ... TO or extension load, whatever the
    statement), extension auto-install/auto-load off, and `lock_configuration = true` (no SET undoes it);
  * every statement of the query must parse (DuckDB's own parser) as a SELECT (DESCRIBE, SHOW and
    SUMMARIZE parse as one); EXPLAIN is refused too, since EXPLAIN ANALYZE executes what it explains.
"""

from __future__ import annotations

import sys

import duckdb
import pyarrow as pa
import pyarrow.dataset as pads

from rlhf.core.config import check_name
from rlhf.core.registry import NAMES as STAGES
from rlhf.core.ledger import ledger_row
from rlhf.core.store import ArtifactStore
from rlhf.core.tables import EVAL_SCHEMAS, LEADERBOARD_SCHEMA, LEADERBOARD_TABLE, LEDGER_SCHEMA

VIEWS = {"samples": "samples", "battles": "battles", "ratings": "ratings", "metrics": "metrics",
         "accuracy_diffs": "accuracy_diffs", "runs": "run"}
# Settings fixed at connect time; lock_configuration makes them final for the connection.
LOCKED_DOWN = {"enable_external_access": False, "autoinstall_known_extensions": False,
               "autoload_known_extensions": False, "allow_community_extensions": False, "lock_configuration": True}


class QueryRefused(ValueError):
    pass


def completed_runs(store: ArtifactStore, table: str) -> list[str]:
    """Runs whose eval stage completed (manifest written last) and that hold `table`: a half-written eval
    prefix is never read as results. Folder names come from a shared store: only valid run names pass."""
    done = {p.rstrip("/").split("/")[-3] for p in store.fs.glob(store.path("*", "eval", "manifest.json"))}
    present = {p.rstrip("/").split("/")[-3] for p in store.fs.glob(store.path("*", "eval", f"{table}.parquet"))}
    runs = []
    for run in sorted(done & present):
        try:
            runs.append(check_name("run", run))
        except ValueError:
            print(f"rlhf query: skipped store folder {run!r}: not a valid run name", file=sys.stderr)
    return runs


def ledger_table(store: ArtifactStore) -> pa.Table:
    """One row per completed stage of every run, from the manifests (rlhf/core/ledger.py). Folder names and
    manifest contents come from a shared store: invalid run or stage names are skipped, every field is
    type-checked, and the run and stage columns are the folder's, not what the file claims."""
    import json

    rows = []
    for path in sorted(store.fs.glob(store.path("*", "*", "manifest.json"))):
        run, stage = path.rstrip("/").split("/")[-3:-1]
        try:
            check_name("run", run)
        except ValueError:
            continue
        if stage not in STAGES:
            continue
        if store.fs.size(path) > 10 * 2**20:  # a manifest is a few KB
            print(f"rlhf query: skipped {run}/{stage}/manifest.json: over 10 MB", file=sys.stderr)
            continue
        try:
            manifest = json.loads(store.fs.cat_file(path))
        except (ValueError, RecursionError):
            print(f"rlhf query: skipped {run}/{stage}/manifest.json: not valid JSON", file=sys.stderr)
            continue
        if isinstance(manifest, dict):
            rows.append({**ledger_row(manifest), "run": run, "stage": stage})
    return pa.Table.from_pylist(rows, schema=LEDGER_SCHEMA)


def eval_tables(store: ArtifactStore, runs: list[str], table: str) -> pads.Dataset:
    """One eval table of these runs in the current schema: files from older versions read the columns they
    lack as nulls (what union_by_name did)."""
    files = [store.stage_path(run, "eval", f"{table}.parquet") for run in runs]
    return pads.dataset(files, schema=EVAL_SCHEMAS[table], format="parquet", filesystem=store.fs)


def connect(store: ArtifactStore) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(config=LOCKED_DOWN)
    for view, table in VIEWS.items():
        con.register(view, eval_tables(store, completed_runs(store, table), table))
    con.register("ledger", ledger_table(store))
    board = store.path(*LEADERBOARD_TABLE)  # written by `rlhf leaderboard`: empty until then
    con.register("leaderboard", pads.dataset([board] if store.fs.exists(board) else [], schema=LEADERBOARD_SCHEMA,
                                             format="parquet", filesystem=store.fs))
    return con


def check_read_only(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    statements = con.extract_statements(sql)
    if not statements:
        raise QueryRefused("empty query")
    for st in statements:
        if st.type != duckdb.StatementType.SELECT:
            raise QueryRefused(f"only read-only queries (SELECT, DESCRIBE, SHOW, SUMMARIZE) run here; refused a {st.type.name} statement")


def query(store: ArtifactStore, sql: str) -> pa.Table:
    con = connect(store)
    check_read_only(con, sql)
    return con.sql(sql).to_arrow_table()
