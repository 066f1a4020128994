"""KTO with our durable reference cache vs TRL KTOTrainer's default (reference forwards every step).

Same model, examples, batch and steps; each variant runs in its own fresh process so peak RSS is its own.
  ours: the reference pass once (CachedRefKTOTrainer's precompute: completions and KL-term completions;
        timed separately as the cache build), then training from the cached columns with zero reference
        passes and no reference model in memory
  trl:  KTOTrainer(precompute_ref_log_probs=False): TRL loads a reference copy and runs it on the
        completions and the KL completions every step
Run:  .venv/bin/python bench/kto_cache.py [--model smollm2-135m-instruct|tiny] [--pairs 64] [--batch 8]
Prints a JSON line per variant and the ratios (ours / trl).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from side_by_side import cache_ratios, run_variants  # noqa: E402  (bench/ is sys.path[0] when run as a script)


def variant(name: str, model_name: str, n_pairs: int, batch: int, workdir: str) -> dict:
    import torch
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from rlhf.core.config import DataConfig, ModelConfig
    from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model
    from rlhf.data.tasks import Task
    from stages.kto import CachedRefKTOTrainer

    torch.manual_seed(0)
    mcfg = ModelConfig(name=model_name)
    path = resolve_model(mcfg)
    tok = load_tokenizer(path)
    pairs = Task(DataConfig(train_size=n_pairs, eval_size=1)).preference_rows()
    rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"} for p in pairs
            for side in ("chosen", "rejected")]
    random.Random(0).shuffle(rows)

    def args(precompute: bool, out: str) -> KTOConfig:
        return KTOConfig(output_dir=out, max_length=128, per_device_train_batch_size=batch, num_train_epochs=1,
                         learning_rate=5e-6, precompute_ref_log_probs=precompute, report_to=[], use_cpu=True,
                         bf16=False, activation_checkpointing=False, save_strategy="no", logging_steps=1000,
                         disable_tqdm=True, seed=0)

    out: dict = {"variant": name, "model": model_name, "examples": len(rows), "batch": batch}
    if name == "ours":
        t0 = time.perf_counter()
        filler = CachedRefKTOTrainer(model=load_causal_lm(path, mcfg), args=args(True, workdir + "-fill"),
                                     train_dataset=Dataset.from_list(rows), processing_class=tok)
        out["cache_build_s"] = time.perf_counter() - t0
        ds = filler.train_dataset
        rows = [{**r, "ref_logps": a, "ref_KL_logps": b} for r, a, b in zip(rows, ds["ref_logps"], ds["ref_KL_logps"])]
        del filler
        trainer = CachedRefKTOTrainer(model=load_causal_lm(path, mcfg), args=args(True, workdir),
                                      train_dataset=Dataset.from_list(rows), processing_class=tok)
        assert trainer.ref_forward_batches == 0
    else:
        trainer = KTOTrainer(model=load_causal_lm(path, mcfg), args=args(False, workdir),
                             train_dataset=Dataset.from_list(rows), processing_class=tok)
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
    p.add_argument("--variant", choices=["ours", "trl"], help="internal: run one variant in this process")
    p.add_argument("--workdir", default="/tmp/rlhf-bench-kto")
    a = p.parse_args()
    if a.variant:
        print(json.dumps(variant(a.variant, a.model, a.pairs, a.batch, f"{a.workdir}-{a.variant}")))
        return
    results = run_variants(__file__, ["--model", a.model, "--pairs", str(a.pairs), "--batch", str(a.batch),
                                      "--workdir", a.workdir])
    print(json.dumps(cache_ratios(results["ours"], results["trl"])))


if __name__ == "__main__":
    main()
