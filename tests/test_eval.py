"""Eval stage and results: battles and Elo per judge, Parquet tables with schemas, a PNG chart,
DuckDB views that accumulate across runs (local and S3), and refusal of writing queries."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from conftest import IMPORT_TIMES, heavy_imports, only, run_cli
from rlhf.core.config import EvalConfig, StorageConfig
from rlhf.ops.results import QueryRefused, query
from rlhf.pipeline.runner import execute_stage
from rlhf.core.models import inference_model
from rlhf.core.store import ArtifactStore
from stages.eval import battles, distinct, score_distinct
from rlhf.core.tables import EVAL_SCHEMAS

BASE_AND_SFT = (*only("sft", "eval"), "eval.policies=[base, sft]", "eval.judge=verifier")


def test_battle_judging_by_hand():
    cfg = EvalConfig(policies=["base", "sft", "dpo"], judge="both", tie_margin=0.5)
    correct = {"base": np.array([0.0, 1.0]), "sft": np.array([1.0, 1.0]), "dpo": np.array([0.0, 0.0])}
    rewards = {"base": np.array([0.0, 2.0]), "sft": np.array([0.4, 1.0]), "dpo": np.array([3.0, 0.0])}
    tokens = {"base": [9, 4], "sft": [3, 3], "dpo": [5, 1]}
    rows = battles(cfg, correct, rewards, [("eval-0", 0), ("eval-1", 0)], tokens)
    got = {(r["judge"], r["policy_a"], r["policy_b"], r["prompt_id"]): r["score_a"] for r in rows}
    lengths = {(r["policy_a"], r["policy_b"], r["prompt_id"]): (r["tokens_a"], r["tokens_b"]) for r in rows}
    assert lengths[("base", "dpo", "eval-1")] == (4, 1) and lengths[("sft", "dpo", "eval-0")] == (3, 5)
    assert got[("verifier", "base", "sft", "eval-0")] == 0.0  # wrong vs right
    assert got[("verifier", "base", "sft", "eval-1")] == 0.5  # both right: tie
    assert got[("verifier", "sft", "dpo", "eval-0")] == 1.0
    assert got[("verifier", "base", "dpo", "eval-0")] == 0.5  # both wrong: tie
    assert got[("reward_model", "base", "sft", "eval-0")] == 0.5  # |0 - 0.4| <= 0.5
    assert got[("reward_model", "base", "sft", "eval-1")] == 1.0  # 2.0 vs 1.0
    assert got[("reward_model", "sft", "dpo", "eval-0")] == 0.0
    assert len(rows) == 2 * 3 * 2  # judges x pairs x prompts


def test_distinct_rows_by_hand():
    # policies a, b, a again on prompt 0, one new, b again: three rows scored, each answer mapped back to its own
    rows, where = distinct([(0, "12"), (1, "7"), (0, "12"), (0, "13"), (1, "7")])
    assert rows == [0, 1, 3] and where == [0, 1, 0, 2, 1]
    assert distinct([]) == ([], [])
    # the scorer sees each distinct answer once; every policy gets a value per sample, in its own order
    gens = {"sft": ["12", "7"], "dpo": ["12", "9"], "grpo": ["7", "12"]}
    seen = []
    got = score_distinct(gens, ["sft", "dpo", "grpo"], lambda g: g, lambda xs: seen.extend(xs) or [int(x) * 10 for x in xs])
    assert seen == ["12", "7", "9"]
    assert got == {"sft": [120, 70], "dpo": [120, 90], "grpo": [70, 120]}


def test_eval_stage_tables_chart_and_accumulating_views(tiny_cfg, tmp_path):
    for run in ("run-a", "run-b"):
        cfg = tiny_cfg(*BASE_AND_SFT, f"run.name={run}")
        execute_stage(cfg, "sft")
        m = execute_stage(cfg, "eval")
    assert m["rows"]["samples"] == 16 and m["rows"]["battles"] == 8 and m["rows"]["ratings"] == 2
    assert m["inputs"].keys() == {"sft"}
    assert m["rows"]["answers_reused"] == 16  # run-a kept them: the same base, and SFT under the same key
    # model.inference_dtype (the tiny profile's `auto`: bfloat16 on an AVX512_BF16 CPU): in another dtype, eval
    # reruns and reuses none of the kept answers
    other = "float32" if inference_model(cfg.model).dtype == "bfloat16" else "bfloat16"
    redo = execute_stage(tiny_cfg(*BASE_AND_SFT, "run.name=run-b", f"model.inference_dtype={other}"), "eval")
    assert redo["status"] == "ran" and redo["rows"]["answers_generated"] == 16 and redo["rows"]["answers_reused"] == 0
    m = execute_stage(cfg, "eval")  # the profile's dtype again: every answer reused
    assert m["rows"]["answers_reused"] == 16 and m["rows"]["samples"] == 16
    store = ArtifactStore(cfg.storage)
    for name, schema in EVAL_SCHEMAS.items():
        store.read_table(store.stage_path("run-b", "eval", f"{name}.parquet"), schema)  # asserts the schema
    # the log-ratio to the reference (SFT): 0 on SFT's own samples, measured on base's
    drift = query(store, "select policy, min(log_ratio_to_ref) lo, max(log_ratio_to_ref) hi from samples "
                         "where run = 'run-b' group by policy order by policy").to_pylist()
    assert drift[1] == {"policy": "sft", "lo": 0.0, "hi": 0.0} and drift[0]["lo"] < drift[0]["hi"], drift
    ratings = query(store, "select run, policy, elo from ratings where policy = 'sft' order by run").to_pylist()
    assert [r["run"] for r in ratings] == ["run-a", "run-b"] and all(r["elo"] == 1000.0 for r in ratings)
    assert query(store, "select count(distinct run) as n from runs").to_pylist() == [{"n": 2}]
    png = tmp_path / "chart.png"
    png.write_bytes(store.fs.cat_file(store.stage_path("run-b", "eval", "ratings.png")))
    with Image.open(png) as im:
        assert im.size == (500, 320) and len(set(im.getdata())) > 10  # a drawn chart, not a blank canvas

    # A run whose eval never completed (no manifest) is not visible to queries.
    store.fs.rm(store.stage_path("run-b", "eval", "manifest.json"))
    assert query(store, "select distinct run from ratings").to_pylist() == [{"run": "run-a"}]


@pytest.mark.parametrize("sql", [
    "DROP VIEW ratings", "INSERT INTO ratings VALUES (1)", "COPY (SELECT 1) TO '/tmp/x.csv'",
    "ATTACH '/tmp/x.duckdb'", "INSTALL httpfs", "SELECT 1; DROP VIEW ratings", "CREATE TABLE t AS SELECT 1",
])
def test_writing_queries_are_refused(tmp_path, sql):
    store = ArtifactStore(StorageConfig(url=str(tmp_path)))
    with pytest.raises(QueryRefused, match="only read-only queries"):
        query(store, sql)
    proc = run_cli("query", sql, "--set", f"storage.url={tmp_path}")
    assert proc.returncode == 2 and "query refused" in proc.stderr


def test_query_reads_results_from_s3(s3_env):
    store = ArtifactStore(StorageConfig(url=s3_env["url"]))
    rows = [{"run": "s3run", "judge": "verifier", "policy": p, "elo": e, "ci_low": e - 10, "ci_high": e + 10,
             "battles": 4, "accuracy": a} for p, e, a in (("base", 950.0, 0.2), ("sft", 1000.0, 0.6))]
    store.write_table(store.stage_path("s3run", "eval", "ratings.parquet"), pa.Table.from_pylist(rows, schema=EVAL_SCHEMAS["ratings"]), EVAL_SCHEMAS["ratings"])
    store.write_manifest("s3run", "eval", {"run": "s3run", "stage": "eval", "key": "e" * 64, "inputs": {}, "outputs": {},
                                           "rows": {}, "metrics": {}})
    out = query(store, "select policy, elo from ratings order by elo desc").to_pylist()
    assert out == [{"policy": "sft", "elo": 1000.0}, {"policy": "base", "elo": 950.0}]
    proc = run_cli("query", "select policy from ratings order by elo", "--format", "json", "--set", f"storage.url={s3_env['url']}",
                   env=IMPORT_TIMES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not heavy_imports(proc.stderr), heavy_imports(proc.stderr)  # DuckDB over Parquet: torch was 1.7 of its 2.6 s
    assert '"policy": "base"' in proc.stdout
