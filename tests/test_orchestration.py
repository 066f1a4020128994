"""Real orchestration, no mocks: `rlhf up` starts a Prefect server and one process worker per work pool
on 127.0.0.1 and registers the deployments; `prefect deployment run rlhf/full` runs the tiny pipeline
with every stage sent to its pool and artifacts in a real SeaweedFS S3 bucket.

Faults, as a cluster has them: the gpu pool's worker is SIGKILLed (with its flow-run process) once
during SFT and once during GRPO, each time after a checkpoint landed. The lost stage run is marked
Crashed by the heartbeat automation, the pipeline run fails, no stage without a manifest counts as
complete, `rlhf up` restarts the worker; a new deployment run resumes SFT from its checkpoint, and
`prefect flow-run retry` of the second failed run skips the completed stages without sending them to a
worker and resumes GRPO, and every stage ends complete.
`rlhf down` stops everything it started (also when the test fails)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, process_tree, run_cli
from rlhf.core.config import StorageConfig
from rlhf.core.store import ArtifactStore

STAGES = ("sft", "preferences", "reward_model", "ref_logprobs", "dpo", "grpo", "eval")
PREFECT = str(Path(sys.executable).parent / "prefect")
# Long enough that each stage is still running a few seconds after its first checkpoint.
pytestmark = pytest.mark.slow  # about 9 minutes: two heartbeat windows and 14 stage runs through real workers
OVERRIDES = ["sft.max_steps=16", "sft.save_steps=4", "grpo.iterations=6", "grpo.save_every=2"]


def wait_for(predicate, timeout: float, what: str, run: subprocess.Popen | None = None):
    """Poll until predicate() holds. With `run`, a run that ends first fails at once with its output; the
    deadline is then only a guard against a hang: on 2 shared cores the six stage runs before GRPO's first
    checkpoint have taken from 5 to over 10 minutes, so a tight wall-clock bound made this test flaky."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if run is not None and run.poll() is not None:
            raise AssertionError(f"the run ended (exit {run.returncode}) before {what}:\n{run.stdout.read()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def complete_checkpoint(store: ArtifactStore, stage: str) -> bool:
    return bool(store.fs.glob(store.stage_path("tiny", stage, "checkpoints", "*", ".complete")))


def kill_gpu_worker(state: Path) -> None:
    """SIGKILL the worker and every process under it (the stage's flow run may sit in a session of its
    own), as when a node dies: nothing gets to clean up."""
    for pid in process_tree(int((state / "worker-gpu.pid").read_text())):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def flow_run_state(api: str, run_id: str) -> str:
    """The run's state type, asked of the server's REST API (`prefect flow-run inspect` is a Python process
    of 1.3 CPU-s a call, and the retried run is polled every half second)."""
    try:
        with urllib.request.urlopen(f"{api}/flow_runs/{run_id}", timeout=10) as r:
            return json.loads(r.read())["state"]["type"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def test_deployment_runs_survive_killed_workers_with_s3(tmp_path, s3_env, monkeypatch):
    state = tmp_path / "services"
    env = {"PREFECT_HOME": str(tmp_path / "prefect-user"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    overrides = json.dumps(["storage.url=" + s3_env["url"], *OVERRIDES])
    deployment_run = [PREFECT, "deployment", "run", "rlhf/full", "--param", "profile=tiny",
                      "--param", f"overrides={overrides}", "--watch"]
    store = ArtifactStore(StorageConfig(url=s3_env["url"]))
    gpu_log = lambda: (state / "worker-gpu.log").read_text()  # noqa: E731  (appended across restarts)
    cpu_log = lambda: (state / "worker-cpu.log").read_text()  # noqa: E731  (the rlhf/full runs)
    up = lambda: run_cli("up", "--state-dir", str(state), "--poll-seconds", "2")  # noqa: E731
    try:
        started = up()
        assert started.returncode == 0, started.stdout + started.stderr
        status = json.loads(run_cli("status", "--state-dir", str(state)).stdout)
        assert status["healthy"] and status["worker-gpu"]["alive"] and status["worker-cpu"]["alive"]

        # 1. Kill during SFT, after its first checkpoint: the run fails, SFT is not complete.
        first = subprocess.Popen(deployment_run, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        wait_for(lambda: complete_checkpoint(store, "sft"), 1200, "an SFT checkpoint", first)
        kill_gpu_worker(state)
        out, _ = first.communicate(timeout=300)  # the heartbeat automation crashes the lost stage run
        assert first.returncode != 0 and "Failed" in out, out[-3000:]
        assert "stage 'sft' on work pool 'gpu' ended Crashed: no heartbeat" in cpu_log()  # the parent's error
        assert store.read_manifest("tiny", "sft") is None  # checkpoints, no manifest: not complete
        assert all(store.read_manifest("tiny", s) is None for s in STAGES)

        # 2. Worker back; a new run resumes SFT; kill again during GRPO after its first checkpoint.
        assert up().returncode == 0
        second = subprocess.Popen(deployment_run, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  cwd=REPO)
        wait_for(lambda: complete_checkpoint(store, "grpo"), 1800, "a GRPO checkpoint", second)
        kill_gpu_worker(state)
        out, _ = second.communicate(timeout=300)
        assert second.returncode != 0 and "Failed" in out, out[-3000:]
        assert "stage 'grpo' on work pool 'gpu' ended Crashed: no heartbeat" in cpu_log()
        assert store.require_manifest("tiny", "sft")["resumed_from_step"] in (4, 8, 12)
        assert store.read_manifest("tiny", "grpo") is None and store.read_manifest("tiny", "eval") is None
        done = {s: store.require_manifest("tiny", s)["key"] for s in ("sft", "preferences", "reward_model", "ref_logprobs", "dpo")}

        # 3. Worker back; `prefect flow-run retry` of the failed run: completed stages skip, GRPO resumes.
        # (`rlhf deploy`, the cluster path, re-registers the same deployments on the running server.)
        assert up().returncode == 0
        deployed = run_cli("deploy")
        assert deployed.returncode == 0 and "registered rlhf/full" in deployed.stdout, deployed.stderr[-2000:]
        run_id = out.split("UUID:")[1].split()[0]
        gpu_at_retry = len(gpu_log())
        retry = subprocess.run([PREFECT, "flow-run", "retry", run_id], capture_output=True, text=True, cwd=REPO)
        assert retry.returncode == 0, retry.stdout + retry.stderr
        api = (state / "api_url").read_text().strip()  # the server `up` (re)started above
        final = lambda: (now := flow_run_state(api, run_id)) in ("COMPLETED", "FAILED", "CRASHED") and now  # noqa: E731
        assert wait_for(final, 1800, "the retried run") == "COMPLETED", gpu_log()[-3000:]
        assert store.require_manifest("tiny", "grpo")["resumed_from_step"] in (2, 4)
        # Completed stages are skipped by the orchestrating run itself, with no stage run sent to the gpu pool
        # for them (on a cluster a pod or a GPU node's start-up each): the gpu worker gets grpo and eval only.
        tail = gpu_log()[gpu_at_retry:]
        assert all(f"{s}: skipped, complete with key {k[:12]}; not sent to work pool 'gpu'" in cpu_log()
                   for s, k in done.items())
        assert tail.count("submitting flow run") == 2, tail[-3000:]  # grpo and eval only
        assert "grpo: resuming after iteration" in tail and "skipped, complete with key" not in tail, tail[-3000:]
        keys = {s: store.require_manifest("tiny", s)["key"] for s in STAGES}  # every stage complete, in S3
        assert {s: keys[s] for s in done} == done
        # (A fresh run that skips every stage is tests/test_flow.py's first test; not repeated here.)
    finally:
        down = run_cli("down", "--state-dir", str(state))
    assert down.returncode == 0, down.stderr
    assert not list(state.glob("*.pid"))
    after = json.loads(run_cli("status", "--state-dir", str(state)).stdout)
    assert after["api_url"] is None and not after["healthy"]
