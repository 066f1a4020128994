"""DPO with our durable reference cache vs TRL DPOTrainer's default (a reference forward every step).

Same model, pairs, batch and steps; each variant runs in its own fresh process so peak RSS is its own.
  ours:     reference pass once into the cache (timed separately: the cache build cost), then the DPO
            stage's CachedRefDPOTrainer (no reference model in memory, completion-only scoring) for one epoch
  trl:      DPOTrainer(precompute_ref_log_probs=False): TRL loads a reference copy and runs it each step
Two more variants split the gain in two (--decompose):
  ours_all_positions:  the cache, but TRL's CPU scoring of every position (the cache alone)
  trl_completion_only: TRL's default with our completion-only scoring (what TRL does on CUDA)
Run:  .venv/bin/python bench/dpo_cache.py [--model smollm2-135m-instruct|tiny] [--pairs 64] [--batch 8] [--decompose]
Prints a JSON line per variant and the ratios (ours / trl).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from side_by_side import cache_ratios, run_variants  # noqa: E402  (bench/ is sys.path[0] when run as a script)

VARIANTS = ("ours", "trl", "ours_all_positions", "trl_completion_only")


def variant(name: str, model_name: str, n_pairs: int, batch: int, workdir: str) -> dict:
    import torch
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from rlhf.core.config import DataConfig, ModelConfig
    from rlhf.engines.logprobs import CompletionOnlyScoring, pair_logps, tokenize_pair
    from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model
    from rlhf.data.tasks import Task
    from rlhf.train.dpo_trainer import CachedRefDPOTrainer

    torch.manual_seed(0)
    mcfg = ModelConfig(name=model_name)
    path = resolve_model(mcfg)
    tok = load_tokenizer(path)
    rows = Task(DataConfig(train_size=n_pairs, eval_size=1)).preference_rows()
    model = load_causal_lm(path, mcfg)
    out: dict = {"variant": name, "model": model_name, "pairs": n_pairs, "batch": batch}
    cached = name.startswith("ours")
    if cached:
        t0 = time.perf_counter()
        ref = pair_logps(model, tok, [tokenize_pair(tok, r) for r in rows], max_length=128, batch_size=16)
        out["cache_build_s"] = time.perf_counter() - t0
        rows = [{**r, "ref_chosen_logps": c, "ref_rejected_logps": j} for r, c, j in zip(rows, ref.chosen.tolist(), ref.rejected.tolist())]
    args = DPOConfig(
        output_dir=workdir, max_length=128, per_device_train_batch_size=batch, num_train_epochs=1, learning_rate=5e-6,
        precompute_ref_log_probs=cached, report_to=[], use_cpu=True, bf16=False,
        activation_checkpointing=False, save_strategy="no", logging_steps=1000, disable_tqdm=True, seed=0,
    )

    class AllPositions(CachedRefDPOTrainer):
        def compute_loss_context_manager(self):
            return DPOTrainer.compute_loss_context_manager(self)  # skips CompletionOnlyScoring

    class CompletionOnlyTRL(CompletionOnlyScoring, DPOTrainer):
        pass

    cls = {"ours": CachedRefDPOTrainer, "ours_all_positions": AllPositions, "trl": DPOTrainer,
           "trl_completion_only": CompletionOnlyTRL}[name]
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    out["reference_model_in_memory"] = trainer.ref_model is not None
    t0 = time.perf_counter()
    trainer.train()
    out["epoch_s"] = time.perf_counter() - t0
    out["steps"] = trainer.state.global_step
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--decompose", action="store_true", help="also run ours_all_positions and trl_completion_only")
    p.add_argument("--variant", choices=VARIANTS, help="internal: run one variant in this process")
    p.add_argument("--workdir", default="/tmp/rlhf-bench-dpo")
    a = p.parse_args()
    if a.variant:
        print(json.dumps(variant(a.variant, a.model, a.pairs, a.batch, f"{a.workdir}-{a.variant}")))
        return
    results = run_variants(__file__, ["--model", a.model, "--pairs", str(a.pairs), "--batch", str(a.batch),
                                      "--workdir", a.workdir], VARIANTS if a.decompose else VARIANTS[:2])
    ratios = cache_ratios(results["ours"], results["trl"])
    if a.decompose:
        ratios["cache_alone_epoch_ratio"] = round(results["ours_all_positions"]["epoch_s"] / results["trl"]["epoch_s"], 3)
        ratios["cache_vs_trl_completion_only_epoch_ratio"] = round(
            results["ours"]["epoch_s"] / results["trl_completion_only"]["epoch_s"], 3)
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
