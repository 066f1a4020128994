"""rollout.async: the RL loop samples on a thread of its own while the trainer updates. Iteration j samples
with the policy after update j - 1 - max_lag, so max_lag 0 gives the synchronous loop's samples and model
exactly; a resume after a crash samples every iteration's prompts once and never rewrites the experience
of the iterations its checkpoint holds."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import only, run_cli
from rlhf.core.loader import ConfigError
from rlhf.core.store import ArtifactStore
from rlhf.core.tables import EXPERIENCE_SCHEMA, METRICS_SCHEMA
from rlhf.data.sources import make_task
from rlhf.pipeline.runner import execute_stage
from rlhf.train.async_rollout import behaviour_version
from rlhf.train.training import CRASH_ENV, InjectedCrash
from test_rl import _digest, rl_cfg

GRPO = ["grpo.iterations=4", "grpo.prompts_per_iteration=2", "grpo.group_size=4", "grpo.minibatch_size=8",
        "grpo.max_kl=50"]


def test_behaviour_version_by_hand():
    # max_lag 1 from a fresh start: iterations 1 and 2 sample with the initial weights, 3 with update 1's
    assert [behaviour_version(it, 0, 1) for it in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [behaviour_version(it, 0, 0) for it in (1, 2, 3)] == [0, 1, 2]  # the synchronous loop
    # resumed after iteration 4 with max_lag 2: 5 and 6 cannot have versions 2 and 3 (not kept), so 4
    assert [behaviour_version(it, 4, 2) for it in (5, 6, 7, 8)] == [4, 4, 4, 5]


def experience(cfg, it: int, algo: str = "grpo") -> list[dict]:
    store = ArtifactStore(cfg.storage)
    return store.read_table(store.stage_path(cfg.run.name, algo, "experience", f"iter-{it:06d}.parquet"),
                            EXPERIENCE_SCHEMA).to_pylist()


def metric(cfg, name: str, algo: str = "grpo") -> list[float]:
    store = ArtifactStore(cfg.storage)
    rows = store.read_table(store.stage_path(cfg.run.name, algo, "metrics.parquet"), METRICS_SCHEMA).to_pylist()
    return [r["value"] for r in sorted(rows, key=lambda r: r["step"]) if r["name"] == name]


def published(cfg, algo: str = "grpo") -> dict[str, torch.Tensor]:
    from safetensors.torch import load as load_bytes

    store = ArtifactStore(cfg.storage)
    with store.fs.open(store.stage_path(cfg.run.name, algo, "model", "model.safetensors"), "rb") as f:
        return load_bytes(f.read())


PPO = ["ppo.iterations=3", "ppo.prompts_per_iteration=8", "ppo.minibatch_size=8", "ppo.max_kl=50"]


@pytest.mark.parametrize("algo, args", [
    ("grpo", [*GRPO, "grpo.iterations=3"]), ("ppo", PPO),
    # DAPO's dynamic sampling: the sampling thread drops uniform groups and refills them as the loop would
    ("grpo", [*GRPO, "grpo.iterations=3", "grpo.skip_uniform_groups=true", "grpo.refill_rounds=2",
              "grpo.reward_function=reward_fns:uniform_on_sums"]),  # every addition's group is uniform: refilled
])
def test_max_lag_zero_is_the_synchronous_loop_sample_for_sample(tiny_cfg, tmp_path, algo, args):
    runs = {}
    for name, extra in (("sync", []), ("async0", ["rollout.async.max_lag=0"])):
        cfg = rl_cfg(tiny_cfg, algo, *args, *extra, f"storage.url={tmp_path / name}")
        execute_stage(cfg, algo)
        runs[name] = cfg
    sync, lag0 = runs["sync"], runs["async0"]
    for it in (1, 2, 3):
        a, b = experience(sync, it, algo), experience(lag0, it, algo)
        keep = ("prompt_id", "response_ids", "logp_rollout", "logp_old", "reward", "advantage", "policy_version")
        assert [{k: r[k] for k in keep} for r in a] == [{k: r[k] for k in keep} for r in b], it
        assert {r["policy_version"] for r in b} == {it - 1}
    a, b = published(sync, algo), published(lag0, algo)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert metric(lag0, "rollout_lag", algo) == [0.0, 0.0, 0.0]
    if "grpo.refill_rounds=2" in args:  # groups were dropped and refilled, on the sampling thread as in the loop
        assert metric(lag0, "trained_fraction", algo) == metric(sync, "trained_fraction", algo)
        assert min(metric(lag0, "trained_fraction", algo)) < 1.0


def test_max_lag_one_samples_with_the_previous_policy_and_a_resume_keeps_every_prompt_once(tiny_cfg, monkeypatch):
    cfg = rl_cfg(tiny_cfg, "grpo", *GRPO, "grpo.iterations=5", "grpo.save_every=2", "rollout.async.max_lag=1",
                 "grpo.logp_old=rollout")
    store = ArtifactStore(cfg.storage)
    monkeypatch.setenv(CRASH_ENV, "grpo:3")  # after iteration 3, whose update the checkpoint (iteration 2) lacks
    with pytest.raises(InjectedCrash):
        execute_stage(cfg, "grpo")
    path = lambda i: store.stage_path(cfg.run.name, "grpo", "experience", f"iter-{i:06d}.parquet")  # noqa: E731
    before = {i: (_digest(store, path(i)), store.fs.info(path(i)).get("mtime")) for i in (1, 2)}
    assert {r["policy_version"] for r in experience(cfg, 3)} == {1}  # one update behind the trainer

    monkeypatch.delenv(CRASH_ENV)
    m = execute_stage(cfg, "grpo")
    assert m["status"] == "resumed" and m["resumed_from_step"] == 2
    assert {i: (_digest(store, path(i)), store.fs.info(path(i)).get("mtime")) for i in (1, 2)} == before
    # versions per iteration: 0, 0, 1 before the crash; after the resume from 2: 2 (the checkpoint's
    # weights: update 1's were not kept), then 3
    assert [experience(cfg, i)[0]["policy_version"] for i in range(1, 6)] == [0, 0, 2, 2, 3]
    assert metric(cfg, "rollout_lag") == [0.0, 1.0, 0.0, 1.0, 1.0]
    task = make_task(cfg.data)
    for it in range(1, 6):  # each iteration trained its own prompts, each group once
        rows = experience(cfg, it)
        drawn = random.Random(cfg.run.seed * 7919 + it).sample(task.rl, cfg.grpo.prompts_per_iteration)
        assert sorted((r["prompt_id"], r["sample_index"]) for r in rows) == sorted(
            (p.id, s) for p in drawn for s in range(cfg.grpo.group_size)), it


def test_a_sampling_thread_failure_stops_the_stage_with_its_error(tiny_cfg):
    from rlhf.train.rewards import RewardFunctionError

    cfg = rl_cfg(tiny_cfg, "grpo", *GRPO, "rollout.async.max_lag=1", "grpo.logp_old=rollout",
                 "grpo.reward_function=reward_fns:nan_after_first")
    with pytest.raises(RewardFunctionError, match="reward_fns:nan_after_first: returned nan"):
        execute_stage(cfg, "grpo")
    store = ArtifactStore(cfg.storage)
    assert store.read_manifest(cfg.run.name, "grpo") is None


@pytest.mark.parametrize("extra, says", [
    (["grpo.enabled=true"], "grpo.logp_old: rollout"),  # max_lag 1 with a recomputed logp_old and no correction
    (["grpo.enabled=true", "grpo.logp_old=rollout", "grpo.launch.processes=2"], "launch.processes: 1"),
])
def test_what_async_sampling_cannot_do_is_refused_before_any_work(tiny_cfg, extra, says):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        tiny_cfg(*only("grpo"), "rollout.async.max_lag=1", *extra)


def test_the_cli_names_the_missing_correction():
    proc = run_cli("validate", "--profile", "tiny", "--set", "rollout.async.max_lag=2")
    assert proc.returncode == 2 and "rollout.async.max_lag: 2" in proc.stderr and "sampler_correction" in proc.stderr, (
        proc.stdout + proc.stderr)
    ok = run_cli("validate", "--profile", "tiny", "--set", "rollout.async.max_lag=2", "--set",
                 "grpo.sampler_correction=token_truncate")
    assert ok.returncode == 0, ok.stdout + ok.stderr
