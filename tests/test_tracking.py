"""Experiment trackers: TensorBoard event files in the store, read back with TensorBoard's own reader."""

from __future__ import annotations

import pytest
from conftest import CONFIG, only
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from typer.testing import CliRunner

from rlhf.core import tracking
from rlhf.core.loader import ConfigError, load_config
from rlhf.core.store import ArtifactStore
from rlhf.ops.cli import app
from rlhf.pipeline.runner import execute_stage
from rlhf.train.training import CRASH_ENV, METRICS_SCHEMA, InjectedCrash

TB = "tracking.backends=[tensorboard]"
GRPO = ["grpo.iterations=4", "grpo.save_every=2", "grpo.prompts_per_iteration=2", "grpo.group_size=4",
        "grpo.minibatch_size=8", "grpo.eval_prompts=0"]


def events(store: ArtifactStore, run: str, stage: str, tmp_path) -> EventAccumulator:
    local = store.get_dir(store.stage_path(run, stage, tracking.FOLDER), tmp_path / f"tb-{stage}")
    acc = EventAccumulator(str(local), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalar(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_stages_log_params_step_metrics_and_finals_and_a_resumed_stage_continues_its_curves(tiny_cfg, tmp_path, monkeypatch):
    cfg = tiny_cfg(*only("sft", "grpo"), TB, *GRPO)
    store = ArtifactStore(cfg.storage)
    sft = execute_stage(cfg, "sft")
    acc = events(store, "tiny", "sft", tmp_path)
    table = store.read_table(store.stage_path("tiny", "sft", sft["outputs"]["metrics"]), METRICS_SCHEMA).to_pylist()
    logged = {r["step"]: r["value"] for r in table if r["name"] == "loss"}
    assert scalar(acc, "sft/loss") == pytest.approx(logged) and len(logged) >= 3  # every Trainer log line
    assert scalar(acc, "final/sft/accuracy") == {0: pytest.approx(sft["metrics"]["sft/accuracy"])}
    params = acc.Tensors("sft/params/text_summary")[0].tensor_proto.string_val[0].decode()
    assert sft["key"] in params and '"learning_rate": 0.001' in params

    # GRPO crashes after iteration 2 (checkpointed), then resumes: one curve, each iteration once
    monkeypatch.setenv(CRASH_ENV, "grpo:2")
    with pytest.raises(InjectedCrash):
        execute_stage(cfg, "grpo")
    assert not store.fs.exists(store.stage_path("tiny", "grpo", tracking.FOLDER))  # uploaded with the result only
    monkeypatch.delenv(CRASH_ENV)
    grpo = execute_stage(cfg, "grpo")
    assert grpo["status"] == "resumed"
    acc = events(store, "tiny", "grpo", tmp_path)
    rewards = [e.step for e in acc.Scalars("grpo/reward_mean")]
    assert rewards == [1, 2, 3, 4]  # the first attempt's iterations and the resumed ones, none twice
    assert scalar(acc, "final/grpo/reward_mean") == {0: pytest.approx(grpo["metrics"]["grpo/reward_mean"])}


def test_no_backend_writes_nothing(tiny_cfg):
    cfg = tiny_cfg(*only("sft"))
    execute_stage(cfg, "sft")
    store = ArtifactStore(cfg.storage)
    assert not store.fs.exists(store.stage_path("tiny", "sft", tracking.FOLDER))


def test_a_backend_that_is_not_installed_fails_validation(monkeypatch, tmp_path):
    # tensorboard is installed here; a module name that cannot exist stands in for a missing one
    monkeypatch.setitem(tracking.NEEDS, "tensorboard", ("no_such_module_rlhf", "pip install tensorboard"))
    with pytest.raises(ConfigError, match=r"tracking.backends: 'tensorboard' needs the no_such_module_rlhf package"):
        load_config(CONFIG, "tiny", [TB, f"storage.url={tmp_path}"])
    result = CliRunner().invoke(app, ["validate", "--profile", "tiny", "--set", TB])
    assert result.exit_code == 2 and "tracking.backends: 'tensorboard' needs" in result.output
    assert not any(tmp_path.iterdir())
