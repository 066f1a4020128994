"""Experiment trackers: TensorBoard event files in the store, read back with TensorBoard's own reader;
MLflow runs on a real local MLflow server (started as `rlhf up` starts it), read back with MLflow's client."""

from __future__ import annotations

import logging
import socket
import subprocess
import uuid

import pytest
from conftest import CONFIG, REPO, TRACKED_GRPO, only, process_tree, sft_then_resumed_grpo
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from typer.testing import CliRunner

from rlhf.core import tracking
from rlhf.core.loader import ConfigError, load_config
from rlhf.core.store import ArtifactStore
from rlhf.cli import services
from rlhf.cli.main import app
from rlhf.pipeline.runner import execute_stage
from rlhf.core.tables import METRICS_SCHEMA

TB = "tracking.backends=[tensorboard]"


def events(store: ArtifactStore, run: str, stage: str, tmp_path) -> EventAccumulator:
    local = store.get_dir(store.stage_path(run, stage, tracking.FOLDERS["tensorboard"]), tmp_path / f"tb-{stage}")
    acc = EventAccumulator(str(local), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalar(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_stages_log_params_step_metrics_and_finals_and_a_resumed_stage_continues_its_curves(tiny_cfg, tmp_path, monkeypatch):
    cfg = tiny_cfg(*only("sft", "grpo"), TB, *TRACKED_GRPO)
    store, sft, grpo, loss = sft_then_resumed_grpo(cfg, monkeypatch, uploaded=tracking.FOLDERS["tensorboard"])
    acc = events(store, "tiny", "sft", tmp_path)
    assert scalar(acc, "sft/loss") == pytest.approx(loss)  # every Trainer log line
    assert scalar(acc, "final/sft/accuracy") == {0: pytest.approx(sft["metrics"]["sft/accuracy"])}
    params = acc.Tensors("sft/params/text_summary")[0].tensor_proto.string_val[0].decode()
    assert sft["key"] in params and '"learning_rate": 0.001' in params

    acc = events(store, "tiny", "grpo", tmp_path)
    rewards = [e.step for e in acc.Scalars("grpo/reward_mean")]
    assert rewards == [1, 2, 3, 4]  # the first attempt's iterations and the resumed ones, none twice
    assert scalar(acc, "final/grpo/reward_mean") == {0: pytest.approx(grpo["metrics"]["grpo/reward_mean"])}


def test_no_backend_writes_nothing(tiny_cfg):
    cfg = tiny_cfg(*only("sft"))
    execute_stage(cfg, "sft")
    store = ArtifactStore(cfg.storage)
    assert not store.fs.exists(store.stage_path("tiny", "sft", tracking.FOLDERS["tensorboard"]))


def test_a_backend_that_is_not_installed_fails_validation(monkeypatch, tmp_path):
    # tensorboard is installed here; a module name that cannot exist stands in for a missing one
    monkeypatch.setitem(tracking.NEEDS, "tensorboard", ("no_such_module_rlhf", "pip install tensorboard"))
    with pytest.raises(ConfigError, match=r"tracking.backends: 'tensorboard' needs the no_such_module_rlhf package"):
        load_config(CONFIG, "tiny", [TB, f"storage.url={tmp_path}"])
    result = CliRunner().invoke(app, ["validate", "--profile", "tiny", "--set", TB])
    assert result.exit_code == 2 and "tracking.backends: 'tensorboard' needs" in result.output
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """A real MLflow server from its own environment (setup-mlflow.sh), started and stopped the way `rlhf up`
    and `rlhf down` do it."""
    built = subprocess.run(["bash", str(REPO / "setup-mlflow.sh")], capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, built.stderr[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = tmp_path_factory.mktemp("services")
    cfg = load_config(CONFIG, "tiny", ["tracking.backends=[mlflow]", f"tracking.mlflow.uri=http://127.0.0.1:{port}"])
    uri = services.start_mlflow(cfg, state, log=lambda *_: None)
    pid = int((state / "mlflow.pid").read_text())
    try:  # stopped by `down` even when a check below fails
        assert services.start_mlflow(cfg, state, log=lambda *_: None) == uri  # healthy: reused, not started twice
        assert int((state / "mlflow.pid").read_text()) == pid
        # its job runner is off (`rlhf up` sets MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false): no huey consumers under it
        assert not [cmd for cmd in process_tree(pid).values() if "huey" in cmd], process_tree(pid)
        yield uri
    finally:
        services.down(state, log=lambda *_: None)
    assert not services._alive(pid) and tracking.server_problem(uri) is not None


@pytest.mark.slow
def test_mlflow_pipeline_run_with_a_nested_run_per_stage_and_one_run_after_a_resume(tiny_cfg, mlflow_uri, monkeypatch):
    from mlflow.tracking import MlflowClient

    experiment = f"test-{uuid.uuid4().hex[:8]}"
    cfg = tiny_cfg(*only("sft", "grpo"), "tracking.backends=[mlflow]", f"tracking.mlflow.uri={mlflow_uri}",
                   f"tracking.mlflow.experiment={experiment}", *TRACKED_GRPO)
    store, sft, grpo, _ = sft_then_resumed_grpo(cfg, monkeypatch)

    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if r.data.tags.get("rlhf.role") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.run_name == "tiny" and parents[0].data.tags["rlhf.run"] == "tiny"
    children = {r.data.tags["rlhf.stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert len(runs) == 3 and children.keys() == {"sft", "grpo"}  # the resumed GRPO continued its run
    assert all(r.info.status == "FINISHED" for r in runs)

    run = children["sft"]
    assert run.data.params["key"] == sft["key"] and run.data.params["config.learning_rate"] == "0.001"
    assert run.data.tags["output.model"] == store.url(store.stage_path("tiny", "sft", "model"))
    table = store.read_table(store.stage_path("tiny", "sft", sft["outputs"]["metrics"]), METRICS_SCHEMA).to_pylist()
    logged = {r["step"]: r["value"] for r in table if r["name"] == "loss"}
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "sft/loss")}
    assert history == pytest.approx(logged) and len(logged) >= 3  # every Trainer log line
    final = client.get_metric_history(run.info.run_id, "final/sft/accuracy")
    assert [(m.step, m.value) for m in final] == [(0, pytest.approx(sft["metrics"]["sft/accuracy"]))]

    grpo_run = children["grpo"].info.run_id
    assert sorted(m.step for m in client.get_metric_history(grpo_run, "grpo/reward_mean")) == [1, 2, 3, 4]
    assert children["grpo"].data.params["key"] == grpo["key"] and children["grpo"].data.params["inputs.sft"] == sft["key"]


def test_a_tracker_that_fails_mid_stage_is_dropped_with_one_warning_and_the_stage_goes_on(caplog):
    class Down:
        calls = 0

        def log(self, step, metrics):
            Down.calls += 1
            raise ConnectionError("server gone")

    tracker = tracking.Tracker([Down()])
    with caplog.at_level(logging.WARNING, logger="rlhf.tracking"):
        tracker.log(1, {"loss": 1.0})
        tracker.log(2, {"loss": 0.5})
    assert Down.calls == 1 and tracker.backends == []
    assert [r.getMessage() for r in caplog.records] == ["down: ConnectionError: server gone; this stage logs without it"]
