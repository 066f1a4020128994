"""`rlhf query` is read-only whatever the statement or the store holds: each attack below is run and the
file system is listed before and after (nothing written, exit 2, one clear line)."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, run_cli
from rlhf.core.config import StorageConfig
from rlhf.ops.results import QueryRefused, connect, query
from rlhf.core.store import ArtifactStore
from rlhf.core.tables import EVAL_SCHEMAS

EVIL_RUN = "x']);COPY (SELECT 'injected' AS a) TO 'inj.csv';--"
ATTACKS = [
    "EXPLAIN ANALYZE COPY (SELECT 'echo pwned' AS line) TO 'evil.sh' (HEADER false, QUOTE '')",
    "EXPLAIN ANALYZE DROP VIEW ratings",
    "EXPLAIN ANALYZE CREATE TABLE t AS SELECT 1",
    "EXPLAIN SELECT 1",
    "SET enable_external_access = true",
    "CALL pragma_version()",
    "PRAGMA version",
    "INSTALL httpfs",
    "LOAD httpfs",
    "COPY ratings TO 'out.parquet'",
    "EXPORT DATABASE 'dump'",
    "SELECT 1; COPY (SELECT 1) TO 'second.csv'",
]


def listing(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def write_ratings(root, run: str) -> None:
    """A completed eval written straight to disk (the store's own writer refuses such names)."""
    folder = root / run / "eval"
    folder.mkdir(parents=True)
    rows = [{"run": run, "judge": "verifier", "policy": "sft", "elo": 1000.0, "ci_low": 990.0, "ci_high": 1010.0,
             "battles": 4, "accuracy": 0.5}]
    pq.write_table(pa.Table.from_pylist(rows, schema=EVAL_SCHEMAS["ratings"]), folder / "ratings.parquet")
    (folder / "manifest.json").write_text('{"key": "k"}')


@pytest.mark.parametrize("sql", ATTACKS)
def test_attacks_are_refused_and_write_nothing(tmp_path, monkeypatch, sql):
    store_dir = tmp_path / "store"
    write_ratings(store_dir, "good")
    monkeypatch.chdir(tmp_path)
    before = listing(tmp_path)
    with pytest.raises(QueryRefused, match="only read-only queries"):
        query(ArtifactStore(StorageConfig(url=str(store_dir))), sql)
    assert listing(tmp_path) == before


def test_the_connection_itself_cannot_write_or_load(tmp_path, monkeypatch):
    """Second layer: even a statement that got past the parse check finds no file system or extension."""
    monkeypatch.chdir(tmp_path)
    con = connect(ArtifactStore(StorageConfig(url=str(tmp_path / "store"))))
    before = listing(tmp_path)
    for sql in ("COPY (SELECT 1) TO 'x.csv'", "ATTACH 'x.duckdb'", "LOAD httpfs",
                "SELECT * FROM read_csv('/etc/hostname')"):
        with pytest.raises(duckdb.PermissionException):
            con.execute(sql)
    with pytest.raises(duckdb.InvalidInputException, match="configuration"):
        con.execute("SET enable_external_access = true")
    assert listing(tmp_path) == before


def test_malicious_run_folder_runs_no_sql(tmp_path):
    """A folder name from a shared bucket never becomes SQL: the run is skipped and named, the good one read."""
    store_dir = tmp_path / "store"
    write_ratings(store_dir, "good")
    write_ratings(store_dir, EVIL_RUN)
    before = listing(tmp_path)
    proc = run_cli("query", "SELECT run, elo FROM ratings", "--format", "csv", "--config", str(REPO / "pipeline.yaml"),
                   "--set", f"storage.url={store_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["run,elo", "good,1000.0"]
    assert "skipped store folder" in proc.stderr and "not a valid run name" in proc.stderr
    assert listing(tmp_path) == before and not (REPO / "inj.csv").exists()


def test_store_path_with_quote_and_query_starting_with_comment(tmp_path):
    store_dir = tmp_path / "it's a store"
    write_ratings(store_dir, "good")
    cfg = ["--config", str(REPO / "pipeline.yaml"), "--set", f"storage.url={store_dir}"]
    proc = run_cli("query", "-- the leaderboard\nSELECT policy FROM ratings", "--format", "csv", *cfg, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["policy", "sft"]
    before = listing(tmp_path)
    proc = run_cli("query", ATTACKS[0], *cfg, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["query refused: only read-only queries (SELECT, DESCRIBE, SHOW, "
                                                "SUMMARIZE) run here; refused a EXPLAIN statement"]
    assert listing(tmp_path) == before


def test_describe_and_summarize_still_run(tmp_path):
    store = ArtifactStore(StorageConfig(url=str(tmp_path)))
    write_ratings(tmp_path, "good")
    assert "elo" in [r["column_name"] for r in query(store, "DESCRIBE ratings").to_pylist()]
    assert query(store, "SUMMARIZE ratings").num_rows == len(EVAL_SCHEMAS["ratings"])
    # no run has a samples table: an empty view with the table's columns
    assert query(store, "SELECT count(*) AS n FROM samples").to_pylist() == [{"n": 0}]
