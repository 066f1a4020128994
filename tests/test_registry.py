"""Typed stage inputs and outputs: each StageSpec declares what it reads, by role, and what it writes, with
each table's schema; stages receive an `Inputs` built from that declaration, write their tables through it,
and read their inputs' tables with the schema the producing stage declares (rlhf/core/registry.py,
rlhf/core/stage.py)."""

from __future__ import annotations

import re
import logging
from pathlib import Path

import pyarrow as pa
import pytest

from conftest import CONFIG, REPO, only
from rlhf.core.loader import load_config
from rlhf.core.registry import NAMES, ROLES, SPECS, role_stages
from rlhf.core.stage import Input, Inputs, StageContext, StageResult
from rlhf.core.store import ArtifactStore, SchemaMismatch
from rlhf.core.tables import BY_NAME

PROFILES = ("default", "tiny", "worked", "iterative", "gsm", "tools")


def manifest(stage: str, key: str, outputs: dict[str, str]) -> dict:
    return {"run": "r", "stage": stage, "key": key, "inputs": {}, "outputs": outputs, "rows": {}, "metrics": {}}


@pytest.mark.parametrize("profile", PROFILES)
def test_every_stage_declares_known_roles_of_earlier_stages(profile):
    cfg = load_config(CONFIG, profile)
    for stage in NAMES:
        roles = SPECS[stage].inputs(cfg)
        assert set(roles) <= set(ROLES), (stage, roles)
        for name in role_stages(roles):
            other, _, upstream = name.rpartition("/")
            assert other or NAMES.index(upstream) < NAMES.index(stage), (stage, name)  # the DAG order holds


def test_the_default_chain_reads_exactly_what_each_stage_uses():
    cfg = load_config(CONFIG)
    assert SPECS["dpo"].inputs(cfg) == {"start": "sft", "pairs": "preferences", "ref_logps": "ref_logprobs"}
    assert SPECS["grpo"].inputs(cfg) == {"start": "dpo"}  # init_from: dpo; SFT's key is part of DPO's
    assert SPECS["eval"].inputs(cfg) == {"policies": ["sft", "dpo", "grpo"], "reference": "sft",
                                         "reward_model": "reward_model"}
    assert SPECS["grpo"].inputs(load_config(CONFIG, overrides=["grpo.init_from=sft"])) == {"start": "sft"}
    assert SPECS["preferences"].inputs(load_config(CONFIG, overrides=["preferences.policy=base"])) == {}


def test_every_table_output_has_a_schema_and_every_schema_is_declared():
    declared = set()
    for spec in SPECS.values():
        names = [a.name for a in spec.outputs]
        assert len(names) == len(set(names)), spec.name
        for a in spec.outputs:
            assert (a.kind in ("table", "tables")) == (a.schema is not None), (spec.name, a)
            declared.add(a.table) if a.table else None
    assert declared == set(BY_NAME)  # a schema no stage declares would be one nobody checks


def test_output_problems_name_undeclared_and_missing_outputs():
    spec = SPECS["preferences"]
    ok = {"pairs": "pairs.parquet", "eval_pairs": "eval_pairs.parquet", "samples": "samples.parquet"}
    assert spec.output_problems(ok) == []  # contrast_pairs is optional
    assert spec.output_problems({**ok, "contrast_pairs": "c.parquet"}) == []
    assert spec.output_problems({"pairs": "p", "extra": "x", "samples": "s"}) == [
        "output 'extra' is not declared", "output 'eval_pairs' is missing"]
    with pytest.raises(KeyError, match="declares no output 'model'"):
        spec.output("model")
    with pytest.raises(KeyError, match="is a model, not a table"):
        SPECS["sft"].table_schema("model")


def test_inputs_by_role_round_trip_and_refuse_unknown_roles():
    manifests = {s: manifest(s, k * 64, {"model": "model/"}) for s, k in (("sft", "a"), ("dpo", "b"), ("old/sft", "c"))}
    roles = {"policies": ["sft", "dpo", "old/sft"], "reference": "sft"}
    inputs = Inputs.build(roles, manifests)
    assert inputs.reference.stage == "sft" and inputs.start is None and inputs.pairs is None
    assert [i.stage for i in inputs.policies] == ["sft", "dpo", "old/sft"]
    assert inputs.keys() == {"sft": "a" * 64, "dpo": "b" * 64, "old/sft": "c" * 64}  # each stage once, DAG order
    assert inputs.named("old/sft").spec_name == "sft" and inputs.named("dpo").has("model")
    assert Inputs.from_json(inputs.to_json()) == inputs  # what a launched stage's ranks rebuild
    with pytest.raises(KeyError, match="'grpo' is not an input of this stage"):
        inputs.named("grpo")
    with pytest.raises(ValueError, match=r"unknown input roles \['sft'\]"):
        Inputs.build({"sft": "sft"}, manifests)


def context(tmp_path: Path, stage: str, inputs: Inputs) -> StageContext:
    cfg = load_config(CONFIG, "tiny", [f"storage.url={tmp_path / 'artifacts'}"])
    return StageContext(cfg, ArtifactStore(cfg.storage), stage, "e" * 64, inputs, tmp_path / "work", logging.getLogger("t"))


def test_tables_are_written_and_read_with_the_declared_schemas(tmp_path):
    prefs = context(tmp_path, "preferences", Inputs())
    row = {"split": "train", "prompt_id": "p1", "sample_index": 0, "response": "4", "response_tokens": 1,
           "finish_reason": "stop", "score": 1.0}
    assert prefs.write_output("samples", [row]) == "samples.parquet"
    with pytest.raises(SchemaMismatch, match="does not match the declared schema"):  # a table of another shape
        prefs.write_output("samples", pa.table({"prompt_id": ["p1"]}))
    with pytest.raises(KeyError, match="declares no output 'rollouts'"):
        prefs.write_output("rollouts", [])
    # a later stage reads it through its input, with the schema the preferences stage declares
    source = Input("preferences", manifest("preferences", "f" * 64, {"samples": "samples.parquet", "pairs": "samples.parquet"}))
    reader = context(tmp_path, "dpo", Inputs(pairs=source))
    assert reader.read_input(reader.inputs.pairs, "samples").to_pylist() == [row]
    with pytest.raises(SchemaMismatch, match="is not the expected"):  # the file under `pairs` is not a pairs table
        reader.read_input(reader.inputs.pairs, "pairs")


def test_a_stage_result_with_an_undeclared_output_writes_no_manifest(tmp_path, monkeypatch):
    import rlhf.pipeline.runner as runner

    cfg = load_config(CONFIG, "tiny", [f"storage.url={tmp_path / 'artifacts'}", *only("sft")])
    monkeypatch.setattr(runner, "run_stage", lambda module, stage_cfg, ctx: StageResult(
        outputs={"model": "model/", "metrics": "metrics.parquet", "weights": "w/"}))
    with pytest.raises(RuntimeError, match=r"stage 'sft': output 'weights' is not declared"):
        runner.execute_stage(cfg, "sft")
    assert ArtifactStore(cfg.storage).read_manifest(cfg.run.name, "sft") is None


def test_an_input_whose_manifest_lacks_a_declared_output_is_named_before_the_stage(tmp_path):
    """A manifest read back from a shared store (or written by an older version) without an output its stage
    declares: the runner names the file and the output, rather than a KeyError inside the next stage."""
    import rlhf.pipeline.runner as runner
    from rlhf.core.manifest import ManifestError

    cfg = load_config(CONFIG, "tiny", [f"storage.url={tmp_path / 'artifacts'}", *only("sft", "eval"),
                                       "eval.policies=[base, sft]", "eval.judge=verifier"])
    store = ArtifactStore(cfg.storage)
    store.write_manifest(cfg.run.name, "sft", {**manifest("sft", "a" * 64, {"metrics": "metrics.parquet"}), "run": cfg.run.name})
    with pytest.raises(ManifestError, match=r"sft/manifest.json: output 'model' is missing \(stage 'sft' of run"):
        runner.inputs_and_identity(cfg, "eval", store)
    # another run's stage as an eval policy: `rlhf validate` names it before anything runs
    from rlhf.pipeline.preflight import policy_problems

    other = load_config(CONFIG, "tiny", [f"storage.url={tmp_path / 'artifacts'}", *only("sft", "eval"), "run.name=b", "eval.judge=verifier",
                                         f"eval.policies=[sft, {cfg.run.name}/sft]"])
    assert policy_problems(other, store) == [f"eval.policies: '{cfg.run.name}/sft': its manifest lists no model output "
                                             f"({store.url(store.stage_path(cfg.run.name, 'sft'))})"]


def test_no_stage_probes_its_inputs_as_a_mapping():
    """Stages and the libraries they call read `ctx.inputs.<role>`, never `"x" in ctx.inputs` or
    `ctx.inputs["x"]`: what a stage reads is what its spec declares (and what its key hashes)."""
    probe = re.compile(r"""in ctx\.inputs\b|ctx\.inputs\[|ctx\.inputs\.(items|get|keys\(\)\[)""")
    found = [f"{p.relative_to(REPO)}:{n}" for p in [*REPO.glob("stages/*.py"), *REPO.glob("rlhf/**/*.py")]
             for n, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]
    assert found == []
