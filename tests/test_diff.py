"""`rlhf diff`: which stages of two runs differ and why, from their manifests."""

from __future__ import annotations

import shutil

from typer.testing import CliRunner

from conftest import CONFIG, only
from rlhf.cli.main import app
from rlhf.ops.diff import stage_diff
from rlhf.pipeline.identity import flatten
from rlhf.pipeline.runner import execute_stage


def manifest(key: str, **parts) -> dict:
    base = {"key": key, "code_version": "c1", "config": {"beta": 0.1, "lora": {"r": 16}}, "model": {"name": "m"},
            "data": {"seed": 0}, "seed": 0, "inputs": {"sft": "k-sft"}, "metrics": {"loss": 1.0}}
    return {**base, **parts}


def test_stage_diff_names_each_changed_part_by_hand():
    assert flatten({"a": {"b": 1}, "c": [1]}, "x") == {"x.a.b": 1, "x.c": [1]}
    a = manifest("k1")
    assert stage_diff("dpo", a, manifest("k1"))["status"] == "same"
    b = manifest("k2", config={"beta": 0.2, "lora": {"r": 16}}, inputs={"sft": "k-sft2"}, metrics={"loss": 0.5})
    d = stage_diff("dpo", a, b)
    assert d["status"] == "differs"
    assert d["reasons"] == ["dpo.beta: 0.1 -> 0.2", "upstream sft: its key changed"]
    assert d["metrics"] == [("loss", 1.0, 0.5)]
    d = stage_diff("dpo", a, manifest("k3", code_version="c2", seed=1, data={"seed": 0, "train_size": 9}))
    assert d["reasons"] == ["run.seed: 0 -> 1", "data.train_size: '(unset)' -> 9", "code version: 'c1' -> 'c2'"]
    assert stage_diff("dpo", None, a)["status"] == "only in B"


def test_diff_of_two_tiny_runs_names_the_changed_key_and_the_stages_it_reaches(tiny_cfg, tmp_path):
    """B is A with ref_logprobs.batch_size changed: ref_logprobs and dpo (downstream) differ, sft does not;
    the only reasons are that key and the upstream key. B's sft is A's copied (a rerun would skip it)."""
    stages = ("sft", "ref_logprobs", "dpo")
    common = (*only(*stages), "preferences.enabled=false", "sft.max_steps=2", "dpo.max_steps=2")
    a = tiny_cfg("run.name=a", *common)
    for stage in stages:
        execute_stage(a, stage)
    root = tmp_path / "artifacts"
    shutil.copytree(root / "a" / "sft", root / "b" / "sft")
    b = tiny_cfg("run.name=b", *common, "ref_logprobs.batch_size=4")
    for stage in stages:
        execute_stage(b, stage)
    result = CliRunner().invoke(app, ["diff", "a", "b", "-c", str(CONFIG), "--profile", "tiny", "--set", f"storage.url={root}",
                                      *sum((["--set", o] for o in common), [])])
    assert result.exit_code == 0, result.output
    blocks = {block.split(":")[0]: block for block in result.stdout.split("\n\n")[1:]}
    assert blocks["sft"].startswith("sft: same")
    ref = [line.strip() for line in blocks["ref_logprobs"].splitlines()[1:] if "->" in line or "upstream" in line]
    assert ref == [f"ref_logprobs.batch_size: {a.ref_logprobs.batch_size} -> 4"]
    dpo = [line.strip() for line in blocks["dpo"].splitlines()[1:] if "->" in line or "upstream" in line]
    assert dpo == ["upstream ref_logprobs: its key changed"]
    missing = CliRunner().invoke(app, ["diff", "a", "nope", "-c", str(CONFIG), "--set", f"storage.url={root}"])
    assert missing.exit_code == 2 and "no run 'nope'" in missing.stderr

    # the ledger: a row per completed stage, from the manifests (issue 20), through rlhf query
    from rlhf.ops.results import query
    from rlhf.core.store import ArtifactStore

    store = ArtifactStore(a.storage)
    rows = query(store, "SELECT stage, wall_seconds, cpu_seconds, peak_rss_mb, device, packages_hash, tokens "
                        "FROM ledger WHERE run = 'a' ORDER BY stage").to_pylist()
    assert [r["stage"] for r in rows] == ["dpo", "ref_logprobs", "sft"]
    assert all(r["wall_seconds"] > 0 and r["cpu_seconds"] > 0 and r["peak_rss_mb"] > 100 for r in rows)
    assert all(r["device"] for r in rows) and len({r["packages_hash"] for r in rows}) == 1
    assert rows[2]["tokens"] > 0  # sft/tokens_seen
    # a hostile store: an invalid run folder is skipped, odd manifest values become nulls
    (root / "x y" / "sft").mkdir(parents=True)
    (root / "x y" / "sft" / "manifest.json").write_text('{"timings": {"seconds": 1}}')
    (root / "c" / "sft").mkdir(parents=True)
    (root / "c" / "sft" / "manifest.json").write_text('{"run": "a", "timings": {"seconds": Infinity, "peak_rss_mb": "9"}, "ledger": [1]}')
    (root / "c" / "dpo").mkdir(parents=True)
    (root / "c" / "dpo" / "manifest.json").write_text("[" * 100000)
    rows = query(store, "SELECT run, stage, wall_seconds, peak_rss_mb FROM ledger WHERE run NOT IN ('a', 'b')").to_pylist()
    assert rows == [{"run": "c", "stage": "sft", "wall_seconds": None, "peak_rss_mb": None}]
