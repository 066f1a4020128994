"""`rlhf run --profile tiny` through the real Prefect flow (temporary local API), run twice: the second
run skips every stage by content key."""

from __future__ import annotations

import pytest

import json
import re
import shlex
import time

from conftest import CONFIG, IMPORT_TIMES, REPO, heavy_imports, run_cli
from rlhf.core.loader import load_config
from rlhf.core.registry import SPECS, output_path
from rlhf.core.store import ArtifactStore

STAGES = ("sft", "preferences", "reward_model", "ref_logprobs", "dpo", "grpo", "eval")


def readme_queries() -> list[tuple[list[str], str]]:
    """(argv after `rlhf`, first output line) for each `$ .venv/bin/rlhf query ...` shown in the README."""
    text = (REPO / "README.md").read_text()
    found = re.findall(r"^\$ \.venv/bin/rlhf (query .*)\n(.*)$", text, flags=re.M)
    return [(shlex.split(cmd), header) for cmd, header in found]


@pytest.mark.slow
def test_tiny_run_then_identical_rerun_skips_everything(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL")  # the README's first command: no API given, `rlhf run` starts its own
    store_url = str(tmp_path / "artifacts")
    args = ("run", "--profile", "tiny", "--run-name", "flowtest", "--set", f"storage.url={store_url}")
    first = run_cli(*args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for stage in STAGES:
        assert f"{stage}: ran" in first.stdout, first.stdout[-3000:]
    logs = first.stdout + first.stderr
    assert "Task run 'sft[flowtest]'" in logs and "sft step" in logs and "ETA" in logs  # progress reaches Prefect logs

    store = ArtifactStore(load_config(CONFIG, "tiny", [f"storage.url={store_url}"]).storage)
    keys = {s: store.require_manifest("flowtest", s)["key"] for s in STAGES}
    for stage in STAGES:  # each manifest lists the outputs its registry entry declares, each exists where it says,
        outputs = store.require_manifest("flowtest", stage)["outputs"]  # and each table has its declared schema
        assert SPECS[stage].output_problems(outputs) == [], stage
        for name, rel in outputs.items():
            where, artifact = output_path(store, "flowtest", stage, name, rel), SPECS[stage].output(name)
            assert store.fs.exists(where), (stage, name, where)
            files = [where] if artifact.kind == "table" else store.glob(f"{where.rstrip('/')}/*.parquet") if (
                artifact.kind == "tables") else []
            assert files or artifact.kind not in ("table", "tables"), (stage, name)
            for f in files:
                store.read_table(f, artifact.schema)  # raises SchemaMismatch

    t0 = time.perf_counter()
    second = run_cli(*args, env=IMPORT_TIMES)
    elapsed = time.perf_counter() - t0
    assert second.returncode == 0, second.stderr[-3000:]
    # deciding that nothing is left to do needs none of the heavy libraries (they took 12 of its 16 s), nor the
    # task's prompts (reasoning-gym's import and their generation were half of its 2.3 s)
    assert not heavy_imports(second.stderr), heavy_imports(second.stderr)
    for stage in STAGES:
        assert f"{stage}: skipped" in second.stdout
    # every predicted key matches its manifest: the CLI ends before Prefect (no temporary API, no flow run)
    assert "nothing to run (no Prefect flow run started)" in second.stdout, second.stdout[-3000:]
    assert "Beginning flow run" not in second.stdout + second.stderr
    assert {s: store.require_manifest("flowtest", s)["key"] for s in keys} == keys
    print(f"fully skipped rerun: {elapsed:.1f} s")  # shown with -rP

    # The run report: the flow stored one beside the stages. Without it the rerun goes through the flow,
    # which skips every stage in its own words and stores the report again.
    report_md = store.path("flowtest", "_report", "report.md")
    assert store.fs.exists(report_md)
    store.remove(report_md)
    third = run_cli(*args)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "skipped, complete with key" in third.stdout + third.stderr and "nothing to run" not in third.stdout
    for stage in STAGES:
        assert f"{stage}: skipped" in third.stdout
    assert store.fs.exists(report_md) and {s: store.require_manifest("flowtest", s)["key"] for s in keys} == keys
    # `rlhf report` writes the report anew on demand.
    out = tmp_path / "report"
    proc = run_cli("report", "flowtest", "--set", f"storage.url={store_url}", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = (out / "report.md").read_text()
    for stage in STAGES:
        assert f"| {stage} | complete |" in report
    cache_entry = store.require_manifest("flowtest", "ref_logprobs")["outputs"]["cache_entry"]
    assert f"- `cache_entry`: {store.url(store.path(cache_entry))}\n" in report  # the shared cache, not the stage's folder
    assert re.search(r"\| sft \| complete \| \d+ s \| \d+\.\d GiB \|", report)  # the stage's peak RSS
    assert "### Leaderboard" in report and "![Elo with 95% bootstrap intervals](ratings.png)" in report
    from PIL import Image

    for png in ("sft.png", "dpo.png", "grpo.png", "ratings.png"):
        assert f"({png})" in report
        with Image.open(out / png) as image:
            assert image.width >= 500 and image.height >= 200
            assert len(set(image.convert("L").getdata())) > 8  # drawn content, not a blank canvas
    missing = run_cli("report", "nosuchrun", "--set", f"storage.url={store_url}")
    assert missing.returncode == 2 and "no run 'nosuchrun'" in missing.stderr

    # The README's example queries run against this run's results and print the header shown there.
    queries = readme_queries()
    assert len(queries) == 3
    for argv, header in queries:
        proc = run_cli(*argv, "--set", f"storage.url={store_url}")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[0].split() == header.split(), (proc.stdout, header)

    # The run's own reward model judges the kept answers on the cross-run leaderboard, beside the verifier.
    board = run_cli("leaderboard", "--format", "json", "--rounds", "50", "--judge-model", "flowtest/reward_model",
                    "--set", f"storage.url={store_url}")
    assert board.returncode == 0, board.stderr
    assert {r["judge"] for r in json.loads(board.stdout)} == {"verifier", "reward_model:flowtest/reward_model"}
    assert int(re.search(r"(\d+) answers scored, 0 reused", board.stderr).group(1)) > 0, board.stderr


def test_run_refuses_bad_config_before_any_work(tmp_path):
    proc = run_cli("run", "--profile", "tiny", "--set", f"storage.url={tmp_path}", "--set", "sft.max_steps=0")
    assert proc.returncode == 2 and "sft.max_steps: must be -1 (use num_epochs) or >= 1, got 0" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_run_refuses_bad_user_data_before_any_work(tmp_path):
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    store = tmp_path / "store"
    user_pairs = ["--set", f"data.prefs_path={prefs}", "--set", "preferences.enabled=false"]  # the user's pairs, not on-policy ones
    proc = run_cli("run", "--profile", "tiny", "--set", f"storage.url={store}", *user_pairs)
    assert proc.returncode == 2
    assert f"{prefs} line 2: missing columns: expected {{prompt, chosen, rejected}}" in proc.stderr
    assert not store.exists()  # nothing ran, nothing was written
    dropped = run_cli("validate", "--profile", "tiny", *user_pairs, "--set", "data.on_bad_row=drop")
    assert dropped.returncode == 0 and "data.prefs_path: 1 usable rows, 1 dropped" in dropped.stdout


def test_progress_reaches_a_prefect_progress_artifact():
    """The stage loops' rlhf.core.progress reports become one progress artifact per stage run, updated to 100.
    The flow here only hosts the listener; prefect_test_harness is a real temporary Prefect API."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId
    from prefect.testing.utilities import prefect_test_harness

    from flows.rlhf_flow import ProgressArtifact
    from rlhf.core import progress

    @flow
    def stage_like() -> str:
        listener = ProgressArtifact(min_interval=0.0)
        with progress.listening(listener):
            for step in range(1, 5):
                progress.report("sft", step, 4)
        return str(listener.id)

    # 30 s (Prefect's default) timed out once in CI on 2 busy cores; `rlhf run` gives its temporary API 120 s too
    with prefect_test_harness(server_startup_timeout=120):
        artifact_id = stage_like()
        with get_client(sync_client=True) as client:
            found = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))
    assert len(found) == 1 and found[0].type == "progress" and float(found[0].data) == 100.0
    assert found[0].description == "stage sft"
