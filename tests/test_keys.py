"""Keys that cannot lie: a stage is skipped only when nothing it reads has changed. Data files and model
folders are keyed by content (an edit in place reruns their readers, a touch or a move reruns nothing),
package upgrades and user reward functions reach the keys of the stages that use them, and the reason a
stage reruns is named by `rlhf validate` and `rlhf diff` (rlhf/pipeline/identity.py)."""

from __future__ import annotations

import json
import os
import shutil
import time
from importlib import metadata
from pathlib import Path

import pytest
import torch

from conftest import CONFIG, only, run_cli
from rlhf.core import fingerprint
from rlhf.core.loader import load_config
from rlhf.core.hardware import native_bf16
from rlhf.core.models import tiny_model_dir
from rlhf.pipeline.identity import explain
from rlhf.pipeline.preflight import predicted_identities, predicted_keys
from rlhf.pipeline.runner import execute_stage

SFT_ROWS = [{"prompt": f"What is {i} + 1?", "completion": str(i + 1)} for i in range(12)]
PREF_ROWS = [{"prompt": f"What is {i} + 2?", "chosen": str(i + 2), "rejected": str(i + 3)} for i in range(12)]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {s for s in before if before[s] != after[s]}


def test_an_sft_file_edited_in_place_reruns_sft_and_downstream_and_validate_names_it(tmp_path):
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    sets = [f"storage.url={tmp_path / 'store'}", *only("sft", "ref_logprobs", "dpo"), f"data.sft_path={data}",
            "sft.max_steps=2", "sft.eval_prompts=0"]
    cfg = load_config(CONFIG, "tiny", sets)
    before = predicted_keys(cfg)
    execute_stage(cfg, "sft")
    moved = tmp_path / "moved.jsonl"
    shutil.copy(data, moved)  # the same bytes elsewhere: nothing to rerun
    assert predicted_keys(load_config(CONFIG, "tiny", [*sets, f"data.sft_path={moved}"])) == before
    os.utime(data, (time.time() + 60, time.time() + 60))  # touched: same bytes
    assert predicted_keys(cfg) == before
    write_jsonl(Path(data), [*SFT_ROWS[:-1], {"prompt": "What is 11 + 1?", "completion": "13"}])  # edited in place
    assert changed(before, predicted_keys(cfg)) == {"sft", "ref_logprobs", "dpo"}
    shown = run_cli("validate", "--profile", "tiny", *sum((["--set", s] for s in sets), []))
    assert shown.returncode == 0, shown.stderr
    assert f"# sft: run (replaces the stored result: data file data.sft_path ({data}): content changed)" in shown.stdout
    assert "# ref_logprobs: run\n" in shown.stdout + "\n"  # never ran: nothing to replace


def test_a_preference_file_reaches_exactly_the_stages_that_read_it(tmp_path):
    prefs = write_jsonl(tmp_path / "prefs.jsonl", PREF_ROWS)
    sets = [f"storage.url={tmp_path}", *only("sft", "reward_model", "ref_logprobs", "dpo", "kto"),
            f"data.prefs_path={prefs}"]
    cfg = load_config(CONFIG, "tiny", sets)
    before = predicted_identities(cfg)
    write_jsonl(Path(prefs), [*PREF_ROWS[:-1], {"prompt": "p", "chosen": "a", "rejected": "b"}])
    after = predicted_identities(cfg)
    keys = lambda idents: {s: json.dumps(i, sort_keys=True) for s, i in idents.items()}  # noqa: E731
    assert changed(keys(before), keys(after)) == {"reward_model", "ref_logprobs", "dpo", "kto"}
    assert explain("dpo", before["dpo"], after["dpo"], {"prefs_path": prefs}) == [
        f"data file data.prefs_path ({prefs}): content changed", "upstream ref_logprobs: its key changed"]
    assert "prefs_path" not in before["sft"]["data"]  # a file a stage does not read is not in its key


def test_a_local_model_folder_is_keyed_by_its_files_not_its_name_or_mtime(tmp_path):
    from rlhf.core.config import TinyModelConfig

    folder = tmp_path / "my-model"
    shutil.copytree(tiny_model_dir(TinyModelConfig()), folder)
    cfg = load_config(CONFIG, "tiny", [f"storage.url={tmp_path}", f"model.name={folder}"])
    before = predicted_keys(cfg)
    for p in [folder, *folder.iterdir()]:
        os.utime(p, (time.time() + 60, time.time() + 60))
    assert predicted_keys(cfg) == before  # only the mtime changed
    (folder / "README.md").write_text("notes")  # not a file that determines the outputs
    assert predicted_keys(cfg) == before
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one weight byte replaced, same size
    weights.write_bytes(bytes(data))
    assert changed(before, predicted_keys(cfg)) == set(before)  # every stage reruns
    ident = predicted_identities(cfg)["sft"]
    assert explain("sft", {**ident, "model": {**ident["model"], "files": "0" * 64}}, ident) == [
        f"model weights ({folder}): content changed"]


def test_a_package_upgrade_changes_the_keys_of_the_stages_that_import_it(tmp_path, monkeypatch):
    """Simulated upgrades (the installed metadata answers another version)."""
    cfg = load_config(CONFIG, "tiny", [f"storage.url={tmp_path}", "ppo.enabled=true"])
    before = predicted_identities(cfg)
    real = metadata.version

    def upgraded(name: str, to: dict[str, str]):
        monkeypatch.setattr(fingerprint.metadata, "version", lambda dist: to.get(dist) or real(dist))
        return predicted_identities(cfg)

    trl = upgraded("trl", {"trl": "99.0"})
    assert {s for s in before if before[s]["packages"] != trl[s]["packages"]} == {
        s for s in before if "trl" in before[s]["packages"]}
    assert explain("sft", before["sft"], trl["sft"]) == [f"package trl: {before['sft']['packages']['trl']!r} -> '99.0'"]
    bnb = upgraded("bitsandbytes", {"bitsandbytes": "99.0"})  # only the RL loop imports it
    users = {s for s in before if before[s]["packages"] != bnb[s]["packages"]}
    assert users and "ppo" in users and "grpo" in users and "sft" not in users and "eval" not in users


def test_editing_a_user_reward_function_reruns_the_stages_that_call_it(tmp_path, monkeypatch):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("def bonus():\n    return 0.0\n")
    (pkg / "rewards.py").write_text("from userpkg.helpers import bonus\n\n"
                                    "def exact(prompts, completions, **kw):\n    return [bonus()] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(CONFIG, "tiny", [f"storage.url={tmp_path}", *only("sft", "grpo"), "grpo.reward_source=function",
                                       "grpo.reward_function=userpkg.rewards:exact"])
    before = predicted_identities(cfg)
    assert set(before["grpo"]["functions"]["userpkg.rewards:exact"]) == {"userpkg/rewards.py", "userpkg/helpers.py"}
    (pkg / "helpers.py").write_text("def bonus():\n    return 1.0\n")  # a module the function imports
    after = predicted_identities(cfg)
    assert explain("grpo", before["grpo"], after["grpo"]) == [
        "your code userpkg.rewards:exact: source changed (userpkg/helpers.py)"]
    assert after["sft"] == before["sft"]


def test_editing_a_user_environment_reruns_the_rl_stage_and_the_eval_that_play_it(tmp_path, monkeypatch):
    (tmp_path / "userenv.py").write_text("class Game:\n    stop = ()\n    def reset(self, problem):\n        pass\n"
                                         "    def step(self, turn):\n        return None, 0.0, True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = "{name: 'userenv:Game', max_turns: 2}"
    cfg = load_config(CONFIG, "tiny", [f"storage.url={tmp_path}", *only("sft", "grpo", "eval"),
                                       f"grpo.environment={env}", f"eval.environment={env}", "eval.policies=[sft, grpo]", "eval.judge=verifier"])
    before = predicted_identities(cfg)
    (tmp_path / "userenv.py").write_text((tmp_path / "userenv.py").read_text().replace("0.0, True", "1.0, True"))
    after = predicted_identities(cfg)
    edited = "your code userenv:Game: source changed (userenv.py)"
    assert explain("grpo", before["grpo"], after["grpo"]) == [edited]
    assert explain("eval", before["eval"], after["eval"]) == [edited, "upstream grpo: its key changed"]
    assert after["sft"] == before["sft"]


class BuiltOnce(Exception):
    pass


def test_lora_adapters_come_from_run_seed_whatever_the_stage_sampled_first(tmp_path, monkeypatch):
    """SFT with LoRA samples held-out answers before it builds its trainer: the adapters must not depend on it
    (TRL seeds with args.seed, our run.seed, before it adds them; sampling forks torch's RNG anyway)."""
    from rlhf.train.training import TrainerRun

    built = []
    real_build = TrainerRun.build

    def build_and_stop(self, *a, **k):
        trainer = real_build(self, *a, **k)
        built.append({n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n})
        raise BuiltOnce  # the adapters as initialised: no need to train

    monkeypatch.setattr(TrainerRun, "build", build_and_stop)

    def adapters(seed: int, sampled: bool) -> dict[str, torch.Tensor]:
        cfg = load_config(CONFIG, "tiny", [f"storage.url={tmp_path / f'{seed}-{sampled}'}", *only("sft"),
                                           "sft.lora.enabled=true", f"run.seed={seed}",
                                           f"sft.eval_prompts={8 if sampled else 0}"])
        with pytest.raises(BuiltOnce):
            execute_stage(cfg, "sft")
        return built.pop()

    plain, sampled, other = adapters(0, False), adapters(0, True), adapters(1, False)
    assert plain and plain.keys() == sampled.keys() == other.keys()
    assert max((plain[n] - sampled[n]).abs().max().item() for n in plain) == 0.0
    assert max((plain[n] - other[n]).abs().max().item() for n in plain) > 0


def test_sampling_leaves_torchs_rng_as_it_was():
    from transformers import AutoModelForCausalLM

    from rlhf.core.config import TinyModelConfig
    from rlhf.core.models import load_tokenizer
    from rlhf.engines.engine import HFEngine, SamplingParams

    path = tiny_model_dir(TinyModelConfig())
    model, tok = AutoModelForCausalLM.from_pretrained(path), load_tokenizer(str(path))
    torch.manual_seed(123)
    state = torch.get_rng_state()
    HFEngine(model, tok).generate([[{"role": "user", "content": "hi"}]] * 3,
                                  SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=5))
    assert torch.equal(torch.get_rng_state(), state)


def test_fingerprints_are_cached_by_content_stamp(tmp_path, monkeypatch):
    f = tmp_path / "x.jsonl"
    f.write_text("a\n")
    first = fingerprint.file_digest(f)
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: reads.append(str(p)) or real_open(p, *a, **k))
    assert fingerprint.file_digest(f) == first and str(f) not in reads  # cached: not read again
    f.write_text("b\n")  # same size, new content
    assert fingerprint.file_digest(f) != first


def test_inference_dtype_reaches_the_inference_stages_and_what_reads_them_not_training():
    """model.inference_dtype: preferences, the reference cache and eval sample or score in it, so their keys
    (and those of the stages that read their outputs) change; SFT never reads it; unset is the training
    dtype; the key records the dtype `auto` resolved to on this machine."""
    load = lambda value: load_config(CONFIG, "default", [f"model.inference_dtype={value}"])  # noqa: E731
    before = predicted_keys(load("float32"))
    after = predicted_identities(load("bfloat16"))
    assert changed(before, predicted_keys(load("bfloat16"))) == {"preferences", "reward_model", "ref_logprobs", "dpo",
                                                                "grpo", "eval"}
    assert {s for s, ident in after.items() if "inference_dtype" in ident["model"]} == {"preferences", "ref_logprobs", "eval"}
    assert predicted_keys(load("null")) == before
    assert predicted_keys(load("auto")) == predicted_keys(load("bfloat16" if native_bf16() else "float32"))
    explained = explain("eval", predicted_identities(load("float32"))["eval"], after["eval"])
    assert any("inference_dtype" in line for line in explained), explained
