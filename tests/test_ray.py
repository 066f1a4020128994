"""Stages on a Ray cluster (`launch.backend: ray`, rlhf/pipeline/ray_launch.py): a real two-node cluster
on this machine (ray.cluster_utils.Cluster: a head and a second raylet, 1 CPU each), ranks placed one per
node (STRICT_SPREAD), each node with its own scratch folder, so nothing may pass between ranks except
through the store and the process group.

Equivalence as with torchrun (tests/test_distributed.py): 2 ranks at per-device batch b take the same
optimizer steps as 1 process with gradient accumulation 2, so the weights agree to fp32 summation order."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import CONFIG, only, run_cli
from test_distributed import assert_rl_equal, rl_metrics, sft_cfg, weights
from typer.testing import CliRunner

from rlhf.core import cluster
from rlhf.core.config import LaunchConfig
from rlhf.core.loader import ConfigError, load_config
from rlhf.cli.main import app
from rlhf.pipeline.launch import LaunchError
from rlhf.pipeline.preflight import network_problems
from rlhf.pipeline.runner import content_key, execute_stage
from rlhf.train.training import CRASH_ENV

RAY = ["sft.launch.backend=ray", "sft.launch.processes=2", "sft.launch.ray.strategy=STRICT_SPREAD"]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    # Ray runs its workers at nice 15 by default (for nodes shared with other work); on 2 cores shared with
    # other test workers that starves the ranks. Training nodes are dedicated: start them at nice 0.
    os.environ["RAY_worker_niceness"] = "0"
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = c.address
    yield c.address
    os.environ.pop("RAY_ADDRESS", None)
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def live_placement_groups(address: str) -> list[str]:
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        return [pg["placement_group_id"] for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
    finally:
        ray.shutdown()


@pytest.mark.slow  # a Ray cluster (~5 s) and rank actors on 2 cores
def test_sft_on_two_ray_nodes_equals_one_process_and_a_crash_resumes_from_the_store(ray_cluster, tmp_path, write_log, monkeypatch):
    one = str(tmp_path / "one")
    execute_stage(sft_cfg(one, "sft.gradient_accumulation_steps=2"), "sft")

    two = str(tmp_path / "two")
    cfg = sft_cfg(two, *RAY)
    monkeypatch.setenv(CRASH_ENV, "sft:3")  # both ranks stop after step 3; the checkpoint of step 2 is complete
    with pytest.raises(LaunchError, match=r"stage 'sft': rank [01] on node \w+ \(.*\) failed: InjectedCrash: sft: injected crash at step 3"):
        execute_stage(cfg, "sft")
    monkeypatch.delenv(CRASH_ENV)
    assert live_placement_groups(ray_cluster) == []  # released after the failure too
    ckpt = Path(two) / "tiny" / "sft" / "checkpoints" / "checkpoint-2"
    # rank 1 ran on the other node: its RNG state reached the store from there, not through rank 0's disk
    assert (ckpt / "rng_state_0.pth").is_file() and (ckpt / "rng_state_1.pth").is_file() and (ckpt / ".complete").is_file()
    before = write_log()
    manifest = execute_stage(cfg, "sft")
    assert manifest["resumed_from_step"] == 2 and manifest["status"] == "resumed"
    assert manifest["key"] == content_key(sft_cfg(two, "sft.launch.processes=2"), "sft", {})  # placement is not content

    a, b = weights(one), weights(two)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5, msg=k)
    rerun = write_log()[len(before):]
    models = [w for w in rerun if w["op"] == "put_dir" and w["path"].endswith("two/tiny/sft/model")]
    assert len(models) == 1  # rank 0 alone publishes
    assert live_placement_groups(ray_cluster) == []


@pytest.mark.slow  # a Ray cluster (~5 s) and rank actors on 2 cores
def test_grpo_on_two_ray_nodes_equals_one_process(ray_cluster, tmp_path):
    # rollouts sharded by engine batch and gathered, gradients summed across nodes: the same numbers
    assert_rl_equal(tmp_path, "grpo", "grpo.launch.processes=2", "grpo.launch.backend=ray",
                    "grpo.launch.ray.strategy=STRICT_SPREAD")


@pytest.mark.slow  # a Ray cluster (~5 s), rank and actors on 2 cores
def test_grpo_with_its_engine_and_scorers_in_actors_of_their_own_equals_one_process(ray_cluster, tmp_path):
    # GRPO rewarded by a reward model (plus the verifier) with a k3 KL term against the reference: in one
    # process, and with the rank on one node and two actors on the other (SPREAD, half a CPU each): the
    # rollout engine, sampling from the weights rank 0 sends after every update, and the frozen scorers
    # (reference and reward model). lr 1e-3 moves the policy each iteration, so an engine one update
    # behind would draw other samples; a scorer that got other rows would give other rewards or KL.
    rm = [*only("reward_model"), "reward_model.init_from=base"]
    execute_stage(load_config(CONFIG, "tiny", [f"storage.url={tmp_path / 'one'}", *rm]), "reward_model")
    shutil.copytree(tmp_path / "one" / "tiny" / "reward_model", tmp_path / "two" / "tiny" / "reward_model")
    both = ("reward_model.enabled=true", "reward_model.init_from=base", "grpo.reward_source=sum",
            "grpo.reward_function=null", "grpo.beta=0.1")
    assert_rl_equal(tmp_path, "grpo", "grpo.gradient_accumulation_steps=2", "grpo.launch.backend=ray",
                    "grpo.launch.ray.engine=own", "grpo.launch.ray.engine_cpus=0.5", "grpo.launch.ray.scorers=own",
                    "grpo.launch.ray.scorer_cpus=0.5", "grpo.launch.ray.strategy=SPREAD", both=both)
    kl = [v for (step, name), v in rl_metrics(str(tmp_path / "two"), "grpo").items() if name == "kl"]
    assert max(kl) > 0  # the reference was used: its log-probs differ from the moving policy's


@pytest.mark.slow  # a Ray cluster (~5 s), the rank and the engine actor on 2 cores
def test_grpo_on_episodes_sampled_asynchronously_by_an_engine_actor_equals_one_process(ray_cluster, tmp_path):
    # The actor samples each policy turn, called from the rank's sampling thread (rollout.async, max_lag 0:
    # the synchronous loop's samples) while the rank trains; the calculator's process stays in the rank,
    # which sends token ids. The same as one process sampling on its own thread, itself the synchronous loop.
    assert_rl_equal(tmp_path, "grpo", "grpo.gradient_accumulation_steps=2", "grpo.launch.backend=ray",
                    "grpo.launch.ray.engine=own", "grpo.launch.ray.engine_cpus=0.5", "grpo.launch.ray.strategy=SPREAD",
                    both=("grpo.environment={name: calculator, max_turns: 2, max_tokens: 16}", "rollout.async.max_lag=0"))


def test_a_dead_engine_or_scorers_actor_is_named(ray_cluster):
    import ray

    from rlhf.train import remote

    ray.init(address=ray_cluster, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        class Host:
            def generate(self, *args):
                return []

            def pid(self) -> int:
                return os.getpid()

        host = Host.remote()
        assert remote.call(host, "rollout engine", "generate", [], None, (0, 1)) == []
        pid = ray.get(host.pid.remote())
        os.kill(pid, signal.SIGKILL)  # as a lost node
        with pytest.raises(remote.ActorLost, match=r"the RL loop's rollout engine actor died during generate: "):
            remote.RemoteEngine.generate(type("E", (), {"handle": host})(), [], None)
    finally:
        ray.shutdown()


@pytest.mark.slow  # a Ray cluster (~5 s) and rank actors on 2 cores
def test_a_killed_rank_fails_the_stage_naming_it_and_a_rerun_resumes(ray_cluster, tmp_path):
    cfg = sft_cfg(str(tmp_path), *RAY, "sft.max_steps=8", "sft.save_steps=2")
    ckpt = Path(tmp_path) / "tiny" / "sft" / "checkpoints"
    killed = []

    def kill_a_rank():  # SIGKILL rank 1's process once a checkpoint is complete, as a lost node would
        deadline = time.time() + 300
        while time.time() < deadline and not list(ckpt.glob("*/.complete")):
            time.sleep(0.2)
        ps = subprocess.run(["pgrep", "-f", "ray::Rank.run"], capture_output=True, text=True).stdout.split()
        if ps:
            os.kill(int(ps[-1]), signal.SIGKILL)
            killed.append(int(ps[-1]))

    t = threading.Thread(target=kill_a_rank)
    t.start()
    with pytest.raises(LaunchError, match=r"stage 'sft': rank [01] on node \w+ .* died"):
        execute_stage(cfg, "sft")
    t.join()
    assert killed and live_placement_groups(ray_cluster) == []
    assert list(ckpt.glob("*/.complete"))  # what the rerun resumes from
    manifest = execute_stage(cfg, "sft")
    assert manifest["status"] == "resumed" and manifest["resumed_from_step"] >= 2
    assert manifest["metrics"]["sft/steps"] == 8


@pytest.mark.slow  # a Ray cluster (~5 s) and rank actors on 2 cores
def test_validate_prints_the_bundles_and_refuses_what_the_cluster_cannot_place(ray_cluster, tmp_path):
    result = CliRunner().invoke(app, ["validate", "--profile", "tiny", "--set", f"storage.url={tmp_path}", *sum((["--set", s] for s in RAY), [])])
    assert result.exit_code == 0, result.output
    assert "ray_bundles" in result.output and "2 x {CPU: 1.0} (STRICT_SPREAD)" in result.output
    for bad, why in ((["sft.launch.ray.gpus_per_rank=1"], "needs 2 GPU in all, the cluster has 0"),
                     (["sft.launch.processes=3"], "needs 3 CPU in all, the cluster has 2"),
                     (["sft.launch.processes=1", "sft.launch.ray.cpus_per_rank=2", "sft.launch.ray.strategy=PACK"], "bundle 0 ({'CPU': 2.0}) fits on no node")):
        [problem] = network_problems(load_config(CONFIG, "tiny", [f"storage.url={tmp_path}", *RAY, *bad]))
        assert re.match(r"sft\.launch\.ray: the cluster at .* cannot place .*" + re.escape(why), problem), problem
    engine = ["grpo.launch.backend=ray", "grpo.launch.ray.engine=own", "grpo.launch.ray.strategy=STRICT_SPREAD"]
    result = CliRunner().invoke(app, ["validate", "--profile", "tiny", "--set", f"storage.url={tmp_path}", *sum((["--set", s] for s in engine), [])])
    assert result.exit_code == 0 and "1 x {CPU: 1.0} + engine {CPU: 1.0} (STRICT_SPREAD)" in result.output, result.output
    too_many = [f"storage.url={tmp_path}", *engine, "grpo.launch.processes=2"]
    result = CliRunner().invoke(app, ["validate", "--profile", "tiny", *sum((["--set", s] for s in too_many), [])])
    assert result.exit_code == 2, result.output
    assert re.search(r"grpo\.launch\.ray: the cluster at .* cannot place 2 x \{CPU: 1.0\} \+ engine .*needs 3 CPU in all", result.stderr)
    assert not any(Path(tmp_path).iterdir())


@pytest.mark.slow  # the CLI in a subprocess: 2 rank actors on 2 cores
def test_rlhf_run_in_a_subprocess_runs_a_stage_on_ray_without_a_token(ray_cluster, tmp_path):
    """The documented command-line path: `rlhf run` preflights the cluster (in a child process: Ray's client
    does not survive the fork that runs the flow) and then runs the stage's ranks there."""
    sets = sum((["--set", s] for s in [f"storage.url={tmp_path}", *RAY, *only("sft")]), [])
    done = run_cli("run", "--profile", "tiny", "--run-name", "cli", *sets, env={"RAY_ADDRESS": ray_cluster}, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "sft: ran" in done.stdout and (tmp_path / "cli" / "sft" / "manifest.json").is_file()
    assert live_placement_groups(ray_cluster) == []


@pytest.mark.slow  # a stage waiting for a placement that the cluster cannot give while a test holds its CPUs
def test_sigterm_while_a_stage_waits_for_ray_placement_stops_the_run_within_seconds(ray_cluster, tmp_path):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from test_lifecycle import gone, start_run, stop_and_time, wait_until

    ray.init(address=ray_cluster, log_to_driver=False)
    held = placement_group([{"CPU": 1.0}] * 2, strategy="STRICT_SPREAD")  # every CPU of both nodes
    try:
        ray.get(held.ready(), timeout=60)
        run = start_run("waits", tmp_path, *RAY, env={**os.environ, "RAY_ADDRESS": ray_cluster})
        attempt = tmp_path / "waits" / "sft" / "_attempt.json"
        wait_until(attempt.exists, run, "the stage's start")
        # the stage joins the cluster and asks for its placement group, which cannot be placed; waited for, not
        # slept on: a loaded machine was still importing the stage's modules 3 s after its start
        wait_until(lambda: any(pg["state"] == "PENDING" for pg in ray.util.placement_group_table().values()),
                   run, "the stage's placement request")
        assert run.poll() is None
        seconds, out, started = stop_and_time(run, signal.SIGTERM)
        assert run.returncode == 143 and seconds < 10, (run.returncode, seconds, out[-3000:])
        assert "Traceback" not in out and not gone(started)
        assert not (tmp_path / "waits" / "_lock.json").exists()
        deadline = time.time() + 30  # the run's own placement group goes with its driver
        while time.time() < deadline and [pg for pg in ray.util.placement_group_table().values()
                                          if pg["state"] != "REMOVED" and pg["placement_group_id"] != held.id.hex()]:
            time.sleep(0.5)
        assert [pg["placement_group_id"] for pg in ray.util.placement_group_table().values()
                if pg["state"] != "REMOVED"] == [held.id.hex()]
    finally:
        remove_placement_group(held)
        ray.shutdown()


def test_an_unreachable_or_missing_address_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match=r"sft\.launch\.ray\.address: not set: set it or RAY_ADDRESS"):
        load_config(CONFIG, "tiny", [f"storage.url={tmp_path}", *RAY])
    refused = load_config(CONFIG, "tiny", [f"storage.url={tmp_path}", *RAY, "sft.launch.ray.address=127.0.0.1:9"])
    t0 = time.monotonic()
    assert network_problems(refused, timeout=2) == [
        "sft.launch.ray.address: no Ray cluster answers at 127.0.0.1:9 within 2 s (Connection refused)"]
    assert time.monotonic() - t0 < 2
    monkeypatch.setenv("RAY_ADDRESS", "ray://me:s3cr3t@head:10001")
    with pytest.raises(ConfigError, match=r"sft\.launch\.ray\.address: the Ray address \(RAY_ADDRESS\) is not host:port") as e:
        load_config(CONFIG, "tiny", [f"storage.url={tmp_path}", *RAY])
    assert "s3cr3t" not in str(e.value)
    with pytest.raises(ConfigError, match=r"sft\.launch\.ray\.address: string should match pattern"):
        load_config(CONFIG, "tiny", [f"storage.url={tmp_path}", *RAY, "sft.launch.ray.address=ray://x"])
    assert not any(Path(tmp_path).iterdir())


@pytest.mark.parametrize("want,nodes,strategy,why", [
    ([{"CPU": 1.0}] * 2, [{"CPU": 2.0}], "PACK", None),
    ([{"CPU": 1.0}] * 2, [{"CPU": 2.0}], "STRICT_SPREAD", "STRICT_SPREAD needs 2 nodes that each fit {'CPU': 1.0}, the cluster has 1"),
    ([{"CPU": 1.0, "GPU": 1.0}] * 2, [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0}], "SPREAD", "needs 2 GPU in all, the cluster has 1"),
    ([{"CPU": 3.0}] * 2, [{"CPU": 4.0}, {"CPU": 2.0}], "PACK", "bundle 1 ({'CPU': 3.0}) fits on no node with what the other bundles leave"),
    ([{"CPU": 2.0}] * 3, [{"CPU": 4.0}, {"CPU": 2.0}], "PACK", None),
    # two ranks and an engine bundle with a GPU (launch.ray.engine: own), one node per bundle
    ([{"CPU": 1.0}] * 2 + [{"CPU": 1.0, "GPU": 1.0}], [{"CPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}, {"CPU": 2.0}], "STRICT_SPREAD", None),
    ([{"CPU": 1.0}] * 2 + [{"CPU": 1.0, "GPU": 1.0}], [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}], "STRICT_SPREAD", None),
    ([{"CPU": 4.0}] + [{"CPU": 1.0, "GPU": 1.0}], [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 2.0}], "STRICT_SPREAD",
     "STRICT_SPREAD: bundle 1 ({'CPU': 1.0, 'GPU': 1.0}) fits on no node the other bundles leave free"),
])
def test_placement_by_hand(want, nodes, strategy, why):
    assert cluster.unplaceable(want, nodes, strategy) == why


def test_rank_environment_by_hand():
    from rlhf.pipeline.ray_launch import rank_envs

    where = [{"node": "a", "ip": "10.0.0.1", "gpus": ["3"]}, {"node": "b", "ip": "10.0.0.2", "gpus": ["0"]},
             {"node": "a", "ip": "10.0.0.1", "gpus": ["1"]}]
    launch = LaunchConfig(processes=3, backend="ray", ray={"gpus_per_rank": 1, "cpus_per_rank": 4})
    envs = rank_envs(where, 29500, launch, {"AWS_REGION": "x"})
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"} and {e["MASTER_PORT"] for e in envs} == {"29500"}
    # node a holds GPUs 1 and 3: rank 0 has GPU 3 (index 1 of "1,3"), rank 2 GPU 1 (index 0)
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == envs[2]["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert (envs[0]["LOCAL_RANK"], envs[2]["LOCAL_RANK"], envs[1]["LOCAL_RANK"]) == ("1", "0", "0")
    assert (envs[0]["LOCAL_WORLD_SIZE"], envs[1]["LOCAL_WORLD_SIZE"]) == ("2", "1")
    assert envs[1]["RLHF_NODE"] == "b" and envs[0]["OMP_NUM_THREADS"] == "4" and envs[1]["AWS_REGION"] == "x"



def _head_processes(addr: str) -> list:
    """The processes of the Ray head at `addr`: each names the GCS address or port on its command line."""
    import psutil

    port = addr.rpartition(":")[2]
    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if addr in line or f"--gcs_server_port={port}" in line or f"--port {port}" in line:
            found.append(p)
    return found


@pytest.mark.slow  # starts and stops a real Ray head (~10 s) and three CLI processes
def test_rlhf_up_ray_head_is_local_token_guarded_and_stopped_by_down(tmp_path):
    from rlhf.cli import services

    state = tmp_path / "state"
    state.mkdir()
    said = []
    addr = services.start_ray(state, cpus=1, log=said.append)
    try:
        assert addr.startswith("127.0.0.1:") and (state / "ray_address").read_text() == addr
        assert len(said) == 1 and addr in said[0] and "RAY_AUTH_MODE=token" in said[0]
        assert services.start_ray(state, cpus=1, log=said.append) == addr and len(said) == 1  # reused, not restarted
        assert services.status(state)["ray_address"] == addr and services.status(state)["ray"]["alive"]
        token = state / "ray_auth_token"
        assert token.stat().st_mode & 0o777 == 0o600 and token.read_text() not in said[0]
        assert any("gcs_server" in " ".join(p.cmdline()) for p in _head_processes(addr))
        # a stage with backend ray and no address finds the head as `up --ray`'s workers do (address + token) ...
        args = ["validate", "--profile", "tiny", "--set", f"storage.url={tmp_path / 'a'}", "--set", "sft.launch.backend=ray"]
        client = {"RAY_ADDRESS": addr, **services.ray_client_env(state)}
        ok = run_cli(*args, "--set", "sft.launch.processes=1", env=client)
        assert ok.returncode == 0 and "1 x {CPU: 1.0} (PACK)" in ok.stdout, ok.stdout + ok.stderr
        # ... and `rlhf run` completes there through the CLI, with the token's environment alone
        ran = run_cli("run", "--profile", "tiny", "--run-name", "token", "--set", f"storage.url={tmp_path / 'a'}",
                      "--set", "sft.launch.backend=ray", "--set", "sft.launch.processes=1",
                      *sum((["--set", o] for o in only("sft")), []), env=client, timeout=300)
        assert ran.returncode == 0 and "sft: ran" in ran.stdout, ran.stdout[-2000:] + ran.stderr[-3000:]
        too_big = run_cli(*args, "--set", "sft.launch.processes=2", env=client)
        assert too_big.returncode == 2 and "needs 2 CPU in all, the cluster has 1" in too_big.stderr, too_big.stderr
        # ... and a client without the token is refused: the head listens beyond loopback (Ray 2.60 has no bind option)
        # (refused within a few tries of the head, not after Ray's 20 one-second retries of a refusal)
        t0 = time.monotonic()
        stranger = run_cli(*args, "--set", "sft.launch.processes=1", env={"RAY_ADDRESS": addr, "RAY_AUTH_MODE": "",
                                                                            "RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")})
        assert stranger.returncode == 2 and time.monotonic() - t0 < 18, (time.monotonic() - t0, stranger.stderr)
        assert f"sft.launch.ray: could not join the cluster at {addr} as a Ray client" in stranger.stderr, stranger.stderr
        assert "RAY_AUTH_MODE=token" in stranger.stderr and "Traceback" not in stranger.stderr
        shown = ok.stdout + ok.stderr + stranger.stdout + stranger.stderr + (state / "ray.log").read_text()
        assert token.read_text() not in shown
    finally:
        t0 = time.monotonic()
        services.down(state, log=said.append)
        stopping = time.monotonic() - t0
    # (not Ray's 30 s drain, which its head waits out on SIGTERM once a client has joined)
    assert stopping < 20, f"rlhf down took {stopping:.1f} s to stop the Ray head"
    assert not (state / "ray_address").exists() and not (state / "ray_auth_token").exists()
    assert "ray" not in services.status(state) and cluster.address_problem(addr, timeout=1) is not None
    deadline = time.time() + 30  # the head's children exit after it
    while _head_processes(addr) and time.time() < deadline:
        time.sleep(0.5)
    assert not _head_processes(addr), [p.cmdline() for p in _head_processes(addr)]
