"""trackio and W&B (offline) backends on tiny runs, read back with each library's own reader: trackio's
SQLiteStorage, and W&B's protobuf Record over the run file (wandb 0.31 ships no reader for its offline
files, so the test splits them into records by hand: a 7-byte file header, then LevelDB-log records in
32 KiB blocks, each with a 7-byte header of CRC, length and type)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from conftest import CONFIG, TRACKED_GRPO, only, sft_then_resumed_grpo
from trackio.sqlite_storage import SQLiteStorage
from wandb.proto.wandb_internal_pb2 import Record

from rlhf.core import tracking
from rlhf.core.loader import ConfigError, load_config
from rlhf.core.store import ArtifactStore
from rlhf.pipeline.preflight import network_problems
from rlhf.pipeline.runner import execute_stage

FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
BLOCK = 32768


def wandb_records(path: Path) -> list[Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, out, buf = 7, [], b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # block trailer or padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            out.append(Record.FromString(buf))
            buf = b""
    return out


def wandb_run(store: ArtifactStore, run: str, stage: str, tmp_path) -> dict:
    """Every offline attempt of the stage's W&B run in the store, merged as `wandb sync` would."""
    local = store.get_dir(store.stage_path(run, stage, tracking.FOLDERS["wandb"]), tmp_path / f"wandb-{stage}")
    files = sorted(local.glob("offline-run-*/run-*.wandb"))
    out = {"attempts": len(files), "ids": set(), "groups": set(), "job_types": set(), "history": [], "config": {}, "summary": {}}
    for f in files:
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                out["ids"].add(r.run.run_id)
                out["groups"].add(r.run.run_group)
                out["job_types"].add(r.run.job_type)
                out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
            elif kind == "config":
                out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
            elif kind == "history":
                out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
            elif kind == "summary":
                out["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update})
    return out


def curve(rows: list[dict], name: str, step: str = "step") -> dict[int, float]:
    """trackio's rows carry `step`, W&B's history `_step`."""
    return {r[step]: r[name] for r in rows if name in r}


def test_trackio_and_wandb_runs_per_stage_with_params_curves_finals_and_one_run_after_a_resume(tiny_cfg, tmp_path, monkeypatch):
    project = f"rlhf-test-{uuid.uuid4().hex[:8]}"
    cfg = tiny_cfg(*only("sft", "grpo"), "tracking.backends=[trackio, wandb]", f"tracking.trackio.project={project}",
                   f"tracking.wandb.project={project}", *TRACKED_GRPO)
    store, sft, grpo, logged = sft_then_resumed_grpo(cfg, monkeypatch, uploaded=tracking.FOLDERS["wandb"])

    # trackio: one run per stage, grouped by the pipeline run, the resumed GRPO included
    names = {s: f"tiny.{s}.{m['key'][:12]}" for s, m in (("sft", sft), ("grpo", grpo))}
    assert sorted(SQLiteStorage.get_runs(project)) == sorted(names.values())
    rows = SQLiteStorage.get_logs(project, names["sft"])
    assert curve(rows, "sft/loss") == pytest.approx(logged)  # every Trainer log line
    assert curve(rows, "final/sft/accuracy") == {0: pytest.approx(sft["metrics"]["sft/accuracy"])}
    config = SQLiteStorage.get_run_config(project, names["sft"])
    assert config["key"] == sft["key"] and config["config.learning_rate"] == "0.001" and config["_Group"] == "tiny"
    rewards = [r["step"] for r in SQLiteStorage.get_logs(project, names["grpo"]) if "grpo/reward_mean" in r]
    assert rewards == [1, 2, 3, 4]  # the first attempt's iterations and the resumed ones, none twice

    # W&B offline: files under <stage>/wandb/ in the store; one run id per stage across attempts
    w = wandb_run(store, "tiny", "sft", tmp_path)
    assert w["ids"] == {tracking.wandb_run_id("tiny", "sft", sft["key"])} and w["groups"] == {"tiny"}
    assert w["job_types"] == {"sft"} and w["config"]["key"] == sft["key"]
    assert curve(w["history"], "sft/loss", "_step") == pytest.approx(logged)
    assert w["summary"]["final/sft/accuracy"] == pytest.approx(sft["metrics"]["sft/accuracy"])
    assert w["summary"]["output.model"] == store.url(store.stage_path("tiny", "sft", "model"))
    w = wandb_run(store, "tiny", "grpo", tmp_path)
    assert w["attempts"] == 2 and w["ids"] == {tracking.wandb_run_id("tiny", "grpo", grpo["key"])}
    assert sorted(curve(w["history"], "grpo/reward_mean", "_step")) == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_two_process_stage_logs_to_one_run_from_the_runner_and_rank_0(tiny_cfg, tmp_path):
    # the runner closes its trackio/W&B run while the launched workers log to it, and reopens it after
    project = f"rlhf-test-{uuid.uuid4().hex[:8]}"
    cfg = tiny_cfg(*only("sft"), "tracking.backends=[trackio, wandb]", f"tracking.trackio.project={project}",
                   f"tracking.wandb.project={project}", "sft.launch.processes=2", "sft.per_device_batch_size=4",
                   "sft.max_steps=4", "sft.logging_steps=1", "sft.eval_prompts=2")
    sft = execute_stage(cfg, "sft")
    name = f"tiny.sft.{sft['key'][:12]}"
    assert SQLiteStorage.get_runs(project) == [name]
    rows = SQLiteStorage.get_logs(project, name)
    assert sorted(curve(rows, "sft/loss")) == [1, 2, 3, 4]  # rank 0's steps
    assert curve(rows, "final/sft/accuracy") == {0: pytest.approx(sft["metrics"]["sft/accuracy"])}  # the runner's
    assert SQLiteStorage.get_run_config(project, name)["key"] == sft["key"]
    w = wandb_run(ArtifactStore(cfg.storage), "tiny", "sft", tmp_path)
    assert w["ids"] == {tracking.wandb_run_id("tiny", "sft", sft["key"])}
    assert sorted(curve(w["history"], "sft/loss", "_step")) == [1, 2, 3, 4] and w["config"]["key"] == sft["key"]
    assert w["summary"]["final/sft/accuracy"] == pytest.approx(sft["metrics"]["sft/accuracy"])


def test_online_wandb_without_a_key_or_a_server_fails_validation(monkeypatch, tmp_path):
    online = ["tracking.backends=[wandb]", "tracking.wandb.mode=online", f"storage.url={tmp_path}"]
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc from `wandb login`
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"tracking.wandb.mode: online, but no W&B API key: set WANDB_API_KEY"):
        load_config(CONFIG, "tiny", online)
    monkeypatch.setenv("WANDB_API_KEY", "secret-value-never-shown")
    cfg = load_config(CONFIG, "tiny", online)  # the key is there; loading asks no server
    [problem] = network_problems(cfg)  # preflight does
    assert problem.startswith("tracking.wandb.mode: online, but no W&B server answers at http://127.0.0.1:9")
    assert "secret-value-never-shown" not in problem
    monkeypatch.setenv("WANDB_BASE_URL", "http://me:s3cr3t@127.0.0.1:9/path")  # shown as scheme://host:port only
    [problem] = network_problems(cfg)
    assert "no W&B server answers at http://127.0.0.1:9 (" in problem and "s3cr3t" not in problem
    assert not any(tmp_path.iterdir())
    load_config(CONFIG, "tiny", ["tracking.backends=[wandb]", f"storage.url={tmp_path}"])  # offline needs neither


def test_handoff_closes_single_writer_runs_while_the_workers_log_and_reopens_them():
    calls = []

    class SingleWriter:
        def pause(self):
            calls.append("pause")

        def resume(self):
            calls.append("resume")

    class Broken(SingleWriter):
        def pause(self):
            raise ConnectionError("gone")

    class Server:  # many writers allowed (MLflow, TensorBoard): untouched
        pass

    one, broken, server = SingleWriter(), Broken(), Server()
    tracker = tracking.Tracker([one, broken, server])
    with tracker.handoff():
        calls.append("workers")
    assert calls == ["pause", "workers", "resume"]
    assert tracker.backends == [one, server]  # the one that failed is dropped, as any failing backend is
