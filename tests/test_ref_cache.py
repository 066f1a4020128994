"""The durable reference log-prob cache: same numbers as TRL's own reference pass, zero forward passes
on a hit across runs, over-long pairs reported by row, and a key that follows weights and lengths."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from trl import DPOConfig, DPOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

import rlhf.engines.logprobs
from rlhf.core.config import ModelConfig
from rlhf.engines.logprobs import pair_logps, tokenize_pair
from rlhf.core.hardware import native_bf16
from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model
from conftest import only
from rlhf.pipeline.runner import execute_stage
from rlhf.core.store import ArtifactStore
from rlhf.train.refcache import BadPairs
from rlhf.core.tables import REF_LOGPS_SCHEMA

CONV = [
    {"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
     "chosen": [{"role": "assistant", "content": str(2 * i)}],
     "rejected": [{"role": "assistant", "content": f"It is {2 * i + 1}, I think."}]}
    for i in range(6)
]
PLAIN = [{"prompt": f"{i} + 1 =", "chosen": f" {i + 1}", "rejected": f" {i + 2} or so"} for i in range(4)]


@pytest.fixture(scope="module")
def tiny():
    path = resolve_model(ModelConfig(name="tiny"))
    return path, load_tokenizer(path)


def trl_reference(path, tokenizer, rows, tmp_path, max_length=64):
    """TRL's own precompute: DPOTrainer with precompute_ref_log_probs=True and its default method."""
    model = load_causal_lm(path, ModelConfig(name="tiny"))
    args = DPOConfig(output_dir=str(tmp_path / "trl"), precompute_ref_log_probs=True, max_length=max_length,
                     report_to=[], use_cpu=True, bf16=False, activation_checkpointing=False,
                     per_device_train_batch_size=2, precompute_ref_batch_size=3)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    return trainer.train_dataset


@pytest.mark.parametrize("rows", [CONV, PLAIN], ids=["conversational", "plain"])
def test_tokenisation_and_logps_match_trl(tiny, tmp_path, rows):
    path, tok = tiny
    ours = [tokenize_pair(tok, r) for r in rows]
    theirs = trl_reference(path, tok, rows, tmp_path)
    for p, t in zip(ours, theirs):
        assert (p.prompt_ids, p.chosen_ids, p.rejected_ids) == (t["prompt_ids"], t["chosen_ids"], t["rejected_ids"])
    model = load_causal_lm(path, ModelConfig(name="tiny"))
    out = pair_logps(model, tok, ours, max_length=64, batch_size=4)
    assert torch.allclose(out.chosen, torch.tensor(theirs["ref_chosen_logps"], dtype=torch.float64), atol=1e-5)
    assert torch.allclose(out.rejected, torch.tensor(theirs["ref_rejected_logps"], dtype=torch.float64), atol=1e-5)
    assert out.chosen_tokens.tolist() == [len(p.chosen_ids) for p in ours]


def test_batching_and_padding_do_not_change_the_numbers(tiny):
    path, tok = tiny
    model = load_causal_lm(path, ModelConfig(name="tiny"))
    pairs = [tokenize_pair(tok, r) for r in CONV]
    one = pair_logps(model, tok, pairs, max_length=64, batch_size=1, per_token=True)
    many = pair_logps(model, tok, pairs, max_length=64, batch_size=5, per_token=True)
    assert torch.allclose(one.chosen, many.chosen, atol=1e-5) and torch.allclose(one.rejected, many.rejected, atol=1e-5)
    assert [len(x) for x in one.chosen_per_token] == one.chosen_tokens.tolist()
    assert sum(one.chosen_per_token[0]) == pytest.approx(one.chosen[0].item(), abs=1e-4)


def count_forward_passes(monkeypatch) -> list[int]:
    calls = [0]
    real = rlhf.engines.logprobs.completion_logps

    def counting(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(rlhf.engines.logprobs, "completion_logps", counting)
    return calls


def test_second_run_with_same_key_does_zero_forward_passes(tiny_cfg, monkeypatch):
    calls = count_forward_passes(monkeypatch)
    first = execute_stage(tiny_cfg(*only("ref_logprobs", "dpo"), "run.name=first"), "ref_logprobs")
    assert calls[0] == first["metrics"]["ref_logprobs/forward_batches"] == 2  # 64 pairs / batch 32
    assert first["metrics"]["ref_logprobs/cache_hit"] == 0.0

    calls[0] = 0
    second = execute_stage(tiny_cfg(*only("ref_logprobs", "dpo"), "run.name=second"), "ref_logprobs")
    assert second["status"] == "ran"  # another run: its own stage prefix, but the cache entry is shared
    assert calls[0] == 0 and second["metrics"]["ref_logprobs/forward_batches"] == 0
    assert second["metrics"]["ref_logprobs/cache_hit"] == 1.0
    store = ArtifactStore(tiny_cfg().storage)
    a = store.read_table(store.stage_path("first", "ref_logprobs", "ref_logps.parquet"), REF_LOGPS_SCHEMA)
    b = store.read_table(store.stage_path("second", "ref_logprobs", "ref_logps.parquet"), REF_LOGPS_SCHEMA)
    assert a.equals(b) and a.num_rows == 64

    # A different max_length is a different entry: forward passes again.
    third = execute_stage(tiny_cfg(*only("ref_logprobs", "dpo"), "run.name=third",
                                   "ref_logprobs.max_length=96", "dpo.max_length=96"), "ref_logprobs")
    assert third["metrics"]["ref_logprobs/cache_hit"] == 0.0 and calls[0] == 2
    assert third["outputs"]["cache_entry"] != first["outputs"]["cache_entry"]

    # model.inference_dtype: the tiny profile's `auto` is bfloat16 on a CPU with AVX512_BF16; float32 is an entry
    # of its own, computed again, with numbers near bfloat16's
    calls[0] = 0
    fourth = execute_stage(tiny_cfg(*only("ref_logprobs", "dpo"), "run.name=fourth", "model.inference_dtype=float32"),
                           "ref_logprobs")
    c = store.read_table(store.stage_path("fourth", "ref_logprobs", "ref_logps.parquet"), REF_LOGPS_SCHEMA)
    auto, fp32 = (torch.tensor(t.column("ref_chosen_logps").to_pylist()) for t in (a, c))
    if native_bf16():
        assert fourth["metrics"]["ref_logprobs/cache_hit"] == 0.0 and calls[0] == 2
        assert fourth["outputs"]["cache_entry"] not in (first["outputs"]["cache_entry"], third["outputs"]["cache_entry"])
        assert not torch.equal(auto, fp32)  # computed in another dtype, not read from the other entry
        torch.testing.assert_close(auto, fp32, rtol=0.05, atol=0.5)  # bf16 keeps ~3 significant digits
    else:  # a CPU without AVX512_BF16 or AMX: auto is float32, so this is the first run's entry, read back
        assert fourth["metrics"]["ref_logprobs/cache_hit"] == 1.0 and calls[0] == 0
        assert fourth["outputs"]["cache_entry"] == first["outputs"]["cache_entry"] and torch.equal(auto, fp32)


def test_over_long_pairs_are_reported_by_row(tiny_cfg, tmp_path):
    rows = [{"prompt": "short", "chosen": "a", "rejected": "b"}] * 2 + [
        {"prompt": "word " * 200, "chosen": "a", "rejected": "b"}
    ]
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("\n".join(json.dumps(r) for r in rows))
    common = (*only("ref_logprobs", "dpo"), f"data.prefs_path={prefs}")
    with pytest.raises(BadPairs, match=r"pair row-3: prompt \+ completion is \d+ tokens, over max_length 128"):
        execute_stage(tiny_cfg(*common), "ref_logprobs")
    m = execute_stage(tiny_cfg(*common, "data.on_bad_row=drop"), "ref_logprobs")
    assert m["rows"] == {"pairs": 2, "dropped": 1}


def test_reference_pass_projects_only_from_the_first_completion_position(tiny):
    """pair_logps asks the model for the logits it scores (transformers' logits_to_keep), runs the rows'
    shared prompt prefix once (a first forward of one row, projecting one position), and the numbers equal
    a full-logits computation."""
    path, tok = tiny
    model = load_causal_lm(path, ModelConfig(name="tiny"))
    pairs = [tokenize_pair(tok, r) for r in CONV]
    rows = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[1]))
    out = pair_logps(model, tok, pairs, max_length=64, batch_size=len(pairs))
    hook.remove()
    batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=64)(
        [{"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids, "rejected_ids": p.rejected_ids} for p in pairs])
    ids, comp = batch["input_ids"], batch["completion_mask"]
    first = int(comp.any(0).int().argmax())  # first completion token of any row
    assert rows == [1, ids.shape[1] - first + 1] and rows[1] < ids.shape[1] / 2
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    full = (torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0] * comp[:, 1:]).sum(1).double()
    # rtol 1e-6: float32 rounding (sums near -100); the shared prefix runs as a pass of its own
    torch.testing.assert_close(out.chosen, full[: len(pairs)], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.rejected, full[len(pairs) :], atol=1e-6, rtol=1e-6)
