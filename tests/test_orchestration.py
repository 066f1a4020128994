"""Real orchestration, no mocks: `rlhf up` starts a Prefect server and one process worker per work pool
on 127.0.0.1 and registers the deployments; `prefect deployment run rlhf/full --watch` runs the tiny
pipeline with every stage sent to its pool, artifacts in a real SeaweedFS S3 bucket; a second run skips
every stage; `rlhf down` stops everything it started (also when the test fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, run_cli
from rlhf.config import StorageConfig
from rlhf.store import ArtifactStore

STAGES = ("sft", "reward_model", "ref_logprobs", "dpo", "grpo", "eval")


def test_deployment_run_on_work_pools_with_s3(tmp_path, s3_env, monkeypatch):
    state = tmp_path / "services"
    env = {"PREFECT_HOME": str(tmp_path / "prefect-user"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    prefect = str(Path(sys.executable).parent / "prefect")
    deployment_run = [prefect, "deployment", "run", "rlhf/full", "--param", "profile=tiny",
                      "--param", f"overrides={json.dumps(['storage.url=' + s3_env['url']])}", "--watch"]
    try:
        up = run_cli("up", "--state-dir", str(state), "--poll-seconds", "2")
        assert up.returncode == 0, up.stdout + up.stderr
        status = json.loads(run_cli("status", "--state-dir", str(state)).stdout)
        assert status["healthy"] and status["worker-gpu"]["alive"] and status["worker-cpu"]["alive"]

        first = subprocess.run(deployment_run, capture_output=True, text=True, timeout=900, cwd=REPO, env=os.environ)
        assert first.returncode == 0 and "Completed" in first.stdout, first.stdout[-3000:] + first.stderr[-3000:]
        store = ArtifactStore(StorageConfig(url=s3_env["url"]))
        keys = {s: store.require_manifest("tiny", s)["key"] for s in STAGES}  # every stage complete, in S3
        gpu_log = (state / "worker-gpu.log").read_text()
        assert all(f"{s}: ran in" in gpu_log for s in STAGES)  # the stages ran on the gpu pool's worker

        second = subprocess.run(deployment_run, capture_output=True, text=True, timeout=900, cwd=REPO, env=os.environ)
        assert second.returncode == 0, second.stdout[-3000:]
        gpu_log = (state / "worker-gpu.log").read_text()
        assert all(f"{s}: skipped, complete with key {keys[s][:12]}" in gpu_log for s in STAGES)
        assert {s: store.require_manifest("tiny", s)["key"] for s in STAGES} == keys
    finally:
        down = run_cli("down", "--state-dir", str(state))
    assert down.returncode == 0, down.stderr
    assert not list(state.glob("*.pid"))
    after = json.loads(run_cli("status", "--state-dir", str(state)).stdout)
    assert after["api_url"] is None and not after["healthy"]
