"""pipeline.yaml and the typed config: every config file validates; each class of bad input exits 2
with a message naming the key path, before any model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import CONFIG, REPO, run_cli
from rlhf.core.loader import ConfigError, apply_override, derived_quantities, load_config


def config_files() -> list[Path]:
    """Every pipeline config in the repo (the root file and any under docs/ or bench/)."""
    found = [CONFIG, *sorted(REPO.glob("docs/**/*.yaml")), *sorted(REPO.glob("bench/**/pipeline*.yaml"))]
    return [p for p in found if p.is_file()]


def test_every_config_file_and_profile_validates():
    files = config_files()
    assert len(files) > 0
    checked = 0
    for path in files:
        profiles = ["default", *(yaml.safe_load(path.read_text()).get("profiles") or {})]
        for profile in profiles:
            cfg = load_config(path, profile)
            assert cfg.profile == profile
            checked += 1
    assert checked >= 2  # at least the default and tiny profiles of pipeline.yaml


def test_tiny_profile_overrides_base():
    default, tiny = load_config(CONFIG), load_config(CONFIG, "tiny")
    assert default.model.name == "smollm2-135m-instruct"
    assert tiny.model.name == "tiny" and tiny.run.name == "tiny"
    assert tiny.sft.max_steps > 0 and default.sft.max_steps == -1


def test_relative_storage_url_resolves_against_config_folder(tmp_path):
    cfg = load_config(CONFIG)
    assert Path(cfg.storage.url) == REPO / "data" / "artifacts"


def test_validate_reports_several_problems_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, "tiny", ["sft.foo=1", "reward_model.max_length=2"])
    assert any(p.startswith("sft.foo: unknown key") for p in e.value.problems)
    assert "reward_model.max_length: must be >= 8, got 2" in e.value.problems


def test_unknown_profile_and_bad_set_syntax():
    with pytest.raises(ConfigError, match="profile: unknown profile 'huge'; available: default, tiny"):
        load_config(CONFIG, "huge")
    with pytest.raises(ConfigError, match="expected key.path=value"):
        apply_override({}, "sft.learning_rate")
    with pytest.raises(ConfigError, match="sft.learning_rate: is a value, not a section"):
        apply_override({"sft": {"learning_rate": 1}}, "sft.learning_rate.x=1")


def test_validate_prints_resolved_config_and_derived_quantities():
    proc = run_cli("validate", "--profile", "tiny", "--set", "sft.gradient_accumulation_steps=2")
    assert proc.returncode == 0, proc.stderr
    assert "plan (DAG order): sft -> preferences -> reward_model -> ref_logprobs -> dpo -> grpo -> eval" in proc.stdout
    assert "# sft: samples_per_optimizer_step=16, optimizer_steps=8" in proc.stdout


def test_derived_quantities_by_hand():
    # 384 rows, batch 8 x accumulation 2 = 16 per step -> ceil(384 * 1.5 / 16) = 36 steps;
    # reward model on the task's pairs: 384 * (1 - 0.125) = 336 rows / 8 = 42 steps.
    cfg = load_config(CONFIG, "default", ["sft.gradient_accumulation_steps=2", "sft.num_epochs=1.5", "preferences.enabled=false"])
    d = derived_quantities(cfg)
    assert d["sft"]["samples_per_optimizer_step"] == 16 and d["sft"]["optimizer_steps"] == 36
    assert d["reward_model"]["optimizer_steps"] == 42
    # on-policy pairs (known after sampling), all of them train (held-out prompts give the eval pairs):
    # the default caps all_pairs at 3 per prompt -> at most 384 x 3 = 1152 rows, 144 steps; one contrast pair
    # per prompt adds 384 rows for the reward model only: 1536 rows, 192 steps (DPO 1152); best vs worst
    # gives one per prompt -> 48 steps without contrast pairs; all_pairs of K=8 uncapped: 28 per prompt
    d = derived_quantities(load_config(CONFIG, "default"))
    assert d["reward_model"]["optimizer_steps"] == "at most 144"
    assert d["reward_model"]["train_rows"] == "from the preferences stage (at most 1152)"
    assert d["dpo"]["train_rows"] == "from the preferences stage (at most 1152)"
    d = derived_quantities(load_config(CONFIG, "default", ["preferences.contrast_samples=1"]))
    assert d["reward_model"]["optimizer_steps"] == "at most 192"
    assert d["reward_model"]["train_rows"] == "from the preferences stage (at most 1536)"
    d = derived_quantities(load_config(CONFIG, "default", ["preferences.pairing=best_worst", "preferences.max_pairs_per_prompt=null",
                                                          "preferences.contrast_samples=0"]))
    assert d["reward_model"]["optimizer_steps"] == "at most 48"
    d = derived_quantities(load_config(CONFIG, "default", ["preferences.max_pairs_per_prompt=null"]))
    assert d["dpo"]["train_rows"] == f"from the preferences stage (at most {384 * 28})"
    # GRPO: 32 prompts x G=4 = 128 rollouts; minibatch 64, 2 epochs -> 4 optimizer steps per iteration, fewer
    # when uniform groups are skipped (the default's).
    d = derived_quantities(load_config(CONFIG, "default"))
    assert d["grpo"]["optimizer_steps_per_iteration"] == "at most 2"
    d = derived_quantities(load_config(CONFIG, "default", ["grpo.minibatch_size=32", "grpo.skip_uniform_groups=false"]))
    assert d["grpo"]["optimizer_steps_per_iteration"] == 4
    cfg = load_config(CONFIG, "default", ["grpo.epochs=2", "grpo.skip_uniform_groups=false"])
    raw = cfg.model_dump()
    raw["grpo"]["enabled"] = True
    from rlhf.core.config import PipelineConfig

    d = derived_quantities(PipelineConfig.model_validate(raw))
    assert d["grpo"]["rollouts_per_iteration"] == 128 and d["grpo"]["optimizer_steps_per_iteration"] == 4


def test_config_is_frozen():
    from pydantic import ValidationError

    cfg = load_config(CONFIG)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.sft.learning_rate = 1.0
    assert cfg.sft.learning_rate == 5e-5


def laughs(levels: int) -> str:
    """The 'billion laughs' document: each level is nine aliases of the previous one (9^levels nodes)."""
    lines = ['l0: &l0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"l{i}: &l{i} [{','.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nsft: {{job_variables: {{k: *l{levels - 1}}}}}\n"


def test_yaml_bomb_exits_2_quickly_and_small(tmp_path):
    """A 1 KB file standing for 9^10 nodes: refused before anything is expanded (5 s and 500 MB at most)."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(laughs(10))
    proc = run_cli("validate", "--config", str(bomb), timeout=60)
    assert proc.returncode == 2 and "through aliases; at most 100000" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    import time
    import tracemalloc

    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="expands to"):
        load_config(bomb)
    seconds, (_, peak) = time.perf_counter() - t0, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # Bounds on the bomb, not benchmarks: expanding it would take hours and far more than the machine's memory.
    assert seconds < 5.0 and peak < 500e6
    levels = ["&a [1,1,1,1,1,1,1,1,1,1]"] + [f"&{c} [{','.join([f'*{p}'] * 10)}]" for p, c in zip("abcd", "bcde")]
    with pytest.raises(ConfigError, match="expands to 123456 nodes"):  # 1 + 11 + 111 + ... + 111111
        apply_override({}, "sft.job_variables=[" + ", ".join(levels) + "]")


@pytest.mark.parametrize("profiles", ["{tiny: 5}", "[tiny]"])
def test_malformed_profiles_name_the_key(tmp_path, profiles):
    path = tmp_path / "p.yaml"
    path.write_text(f"run: {{name: a}}\nprofiles: {profiles}\n")
    with pytest.raises(ConfigError, match="profiles(.tiny)?: must be a mapping"):
        load_config(path, "tiny")


def test_duplicate_keys_and_deep_nesting_are_refused(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("run: {name: a}\nrun: {name: b}\n")
    with pytest.raises(ConfigError, match="duplicate key 'run'"):
        load_config(dup)
    deep = tmp_path / "deep.yaml"
    deep.write_text("sft: {job_variables: " + "{a: " * 200 + "1" + "}" * 200 + "}\n")
    with pytest.raises(ConfigError, match="nested deeper than"):
        load_config(deep)
    with pytest.raises(ConfigError, match="nested deeper than"):
        apply_override({}, "sft.job_variables=" + "[" * 100 + "]" * 100)


@pytest.mark.parametrize("name", ["abc\n", ""])
def test_bad_run_names_are_refused_not_ignored(name, tmp_path):
    proc = run_cli("run", "--run-name", name, "--set", f"storage.url={tmp_path}")
    assert proc.returncode == 2 and "run.name: invalid run name" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_run_names_stay_strings(tmp_path):
    """`--run-name 123` or `2024-01-01` is the name as typed, not a YAML number or date."""
    from typer.testing import CliRunner

    from rlhf.cli.main import app

    for name in ("123", "2024-01-01"):  # in-process: the same typer parsing as the console command
        result = CliRunner().invoke(app, ["report", name, "--set", f"storage.url={tmp_path}", "--out", str(tmp_path / name)])
        assert "run.name" not in result.output, result.output


def test_derived_batch_counts_every_process():
    """Two data-parallel ranks: an optimizer step takes 8 rows x 2 ranks, so 384 rows are 24 steps."""
    d = derived_quantities(load_config(CONFIG, "default", ["sft.launch.processes=2"]))
    assert d["sft"]["samples_per_optimizer_step"] == 16 and d["sft"]["optimizer_steps"] == 24


def test_rl_init_from_adds_its_stage_to_the_inputs_and_needs_it_enabled():
    """grpo.init_from: dpo (the default profile's) starts the RL loop from the DPO policy (SFT -> DPO -> RLVR):
    dpo is an input, so its key is part of GRPO's; a disabled init stage is refused with the key path and the
    way out."""
    from rlhf.core.registry import stage_inputs

    # the default profile's chain: GRPO reads DPO's policy only (SFT's key is part of DPO's)
    assert stage_inputs(load_config(CONFIG), "grpo") == ["dpo"]
    assert stage_inputs(load_config(CONFIG, overrides=["grpo.init_from=sft"]), "grpo") == ["sft"]
    with pytest.raises(ConfigError, match=r"grpo.init_from: 'dpo' needs dpo.enabled: true \(or grpo.init_from: sft\)"):
        load_config(CONFIG, overrides=["dpo.enabled=false", "eval.policies=[base,sft,grpo]"])
    with pytest.raises(ConfigError, match=r"grpo.init_from: 'kto' needs kto.enabled: true"):
        load_config(CONFIG, overrides=["grpo.init_from=kto"])
    with pytest.raises(ConfigError, match=r"ppo.init_from"):
        load_config(CONFIG, overrides=["ppo.enabled=true", "ppo.init_from=rlhf"])


def test_reward_model_kind_auto_follows_the_pairs(tmp_path):
    """kind: auto resolves when the config loads (manifests and keys see the concrete kind): the policy's
    own pairs -> implicit, a user's pairs file -> the kind measured best on human-written pairs, a
    classifier-only option -> classifier; an explicit kind is kept."""
    from rlhf.core.config import USER_PAIRS_KIND

    (tmp_path / "pairs.jsonl").write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n')
    user = ["preferences.enabled=false", f"data.prefs_path={tmp_path / 'pairs.jsonl'}"]
    assert load_config(CONFIG).reward_model.kind == "implicit"  # the default's on-policy pairs
    assert load_config(CONFIG, overrides=user).reward_model.kind == USER_PAIRS_KIND
    assert load_config(CONFIG, overrides=["reward_model.use_margin=true"]).reward_model.kind == "classifier"
    for kind in ("implicit", "classifier"):
        assert load_config(CONFIG, overrides=[*user, f"reward_model.kind={kind}"]).reward_model.kind == kind
    with pytest.raises(ConfigError, match="reward_model.kind"):
        load_config(CONFIG, overrides=["reward_model.kind=bigger"])
