"""Shared-prefix forward passes (rlhf/engines/prefix.py) vs the plain ones, side by side in one process on
the embedded default model and chain_sum prompts: the same work with and without sharing, alternately,
median of --repeats, after one warm-up of each.

  sample   HFEngine.generate, 8 prompts x 8 samples at T 0.7 (the RL loop's and preferences' shape)
  greedy   HFEngine.generate, 32 prompts, greedy (eval's shape)
  sft      one SFT trainer step's loss + backward on 8 demonstrations (stages/sft.py vs TRL's forward)
  dpo      the same for DPO on 8 pairs (stages/dpo.py, cached reference)
  reward   the same for the reward model on 8 pairs (stages/reward_model.py vs TRL's RewardTrainer)

`--policy PATH` samples from a trained checkpoint (an SFT model answers in ~3 tokens, so the prefill is
most of the work; the base model writes 16-token answers). Prints one JSON line: seconds of each variant
and the ratio shared / plain.

Run: .venv/bin/python bench/shared_prefix.py [--policy data/artifacts/default/sft/model] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhf.core.config import DataConfig, ModelConfig  # noqa: E402
from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model  # noqa: E402
from rlhf.data.tasks import Task  # noqa: E402
from rlhf.engines.engine import HFEngine, SamplingParams  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def trainer_step(trainer, model, rows: list[dict]):
    """One compute_loss + backward of `trainer` on the collated rows (what a training step spends on them)."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])

    def step():
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def trainers(path: str, tmp: str):
    """(name, plain step, shared step) for SFT, DPO and the reward model, on the same rows and weights."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import DPOConfig, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
    from trl.trainer.dpo_trainer import DPOTrainer

    from rlhf.engines.logprobs import CompletionOnlyScoring
    from rlhf.train.dpo_trainer import CachedRefDPOTrainer
    from stages.reward_model import SharedPrefixRewardTrainer
    from stages.sft import CompletionScoredSFTTrainer

    class PlainSFT(CompletionOnlyScoring, SFTTrainer):
        pass

    class PlainDPO(CachedRefDPOTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            return DPOTrainer.compute_loss(self, model, inputs, *args, **kwargs)

    tok = load_tokenizer(path)
    task = Task(DataConfig(train_size=8, eval_size=1))
    common = {"report_to": [], "use_cpu": True, "bf16": False, "max_length": 128}
    sft_rows = task.sft_rows()
    pairs = task.preference_rows()
    dpo_rows = [{**r, "ref_chosen_logps": -3.0, "ref_rejected_logps": -4.0} for r in pairs]
    out = []
    model = load_causal_lm(path, ModelConfig(), trained=True)
    for name, cls in (("plain", PlainSFT), ("shared", CompletionScoredSFTTrainer)):
        t = cls(model=model, args=SFTConfig(output_dir=f"{tmp}/sft-{name}", completion_only_loss=True, **common),
                train_dataset=Dataset.from_list(sft_rows), processing_class=tok)
        out.append(("sft", name, trainer_step(t, model, sft_rows)))
    for name, cls in (("plain", PlainDPO), ("shared", CachedRefDPOTrainer)):
        t = cls(model=model, args=DPOConfig(output_dir=f"{tmp}/dpo-{name}", precompute_ref_log_probs=True,
                                            activation_checkpointing=False, **common),
                train_dataset=Dataset.from_list(dpo_rows), processing_class=tok)
        out.append(("dpo", name, trainer_step(t, model, dpo_rows)))
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    rm.config.pad_token_id = tok.pad_token_id
    for name, cls in (("plain", RewardTrainer), ("shared", SharedPrefixRewardTrainer)):
        t = cls(model=rm, args=RewardConfig(output_dir=f"{tmp}/rm-{name}", **common),
                train_dataset=Dataset.from_list(pairs), processing_class=tok)
        out.append(("reward", name, trainer_step(t, rm, pairs)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--policy", default=None, help="a trained checkpoint to sample from (default: the base model)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    base = resolve_model(ModelConfig())
    policy_path = a.policy or base
    tok, policy = load_tokenizer(policy_path), load_causal_lm(policy_path, ModelConfig()).eval()
    problems = Task(DataConfig(train_size=32, eval_size=1)).train
    prompts = [p.messages() for p in problems]
    jobs = []
    for name, share in (("plain", False), ("shared", True)):
        engine = HFEngine(policy, tok, batch_size=32, share_prompts=share)
        jobs.append(("sample", name, lambda e=engine: e.generate(prompts[:8], SamplingParams(0.7, 1.0, 16, 8, 0))))
        jobs.append(("greedy", name, lambda e=engine: e.generate(prompts, SamplingParams(0.0, 1.0, 16, 1, 0))))
    with tempfile.TemporaryDirectory() as tmp:
        jobs += trainers(base, tmp)
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(a.repeats + 1):  # the first round warms up and is dropped
            for bench, name, fn in jobs:
                with torch.inference_mode() if bench in ("sample", "greedy") else torch.enable_grad():
                    times.setdefault((bench, name), []).append(timed(fn))
    result = {"policy": "base" if a.policy is None else a.policy, "repeats": a.repeats}
    for bench in dict.fromkeys(b for b, _ in times):
        plain, shared = (statistics.median(times[(bench, n)][1:]) for n in ("plain", "shared"))
        result[bench] = {"plain_s": round(plain, 3), "shared_s": round(shared, 3), "ratio_shared_over_plain": round(shared / plain, 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
