"""Generation time against the engine's batch size (answers per generate call), in the three shapes of the
default run: the preferences stage (the SFT policy, 8 samples per prompt, temperature 1, inference dtype),
eval (greedy, one answer per prompt, inference dtype) and GRPO's sampling (the DPO policy under LoRA
adapters, float32, 4 samples per prompt, temperature 0.7). Also the LM head's input: a frozen head fed a
slice of the hidden states, as transformers does for `logits_to_keep`, with and without making it
contiguous (rlhf/core/models.py contiguous_lm_head). Each timing twice, side by side in one process.

    .venv/bin/rlhf run --set storage.url=/tmp/store        # a default run: its sft and dpo models
    .venv/bin/python bench/generation_batch.py --store /tmp/store
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, repeats: int = 2) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def head_slices(hidden: int, vocab: int) -> None:
    """The LM head on a [32, 40, H][:, -1:] view: frozen or trainable weight, view or contiguous copy."""
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(vocab, hidden, dtype=dtype)
        view = torch.randn(32, 40, hidden, dtype=dtype)[:, -1:, :]
        for frozen in (False, True):
            weight.requires_grad_(not frozen)
            for name, x in (("view", view), ("contiguous", view.contiguous())):
                with torch.no_grad():
                    ms = [1000 * t for t in timed(lambda: torch.nn.functional.linear(x, weight), 3)]
                print(f"head {str(dtype)[6:]:8} {'frozen' if frozen else 'trainable':9} {name:10} "
                      + " ".join(f"{m:.1f}" for m in ms) + " ms", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a default run's store (local folder)")
    ap.add_argument("--run", default="default")
    ap.add_argument("--sizes", default="32,64,128,256")
    args = ap.parse_args(argv)
    from rlhf.core.loader import load_config
    from rlhf.core.models import inference_model, load_causal_lm, load_tokenizer
    from rlhf.data.sources import make_task
    from rlhf.engines.engine import HFEngine, SamplingParams
    from rlhf.train.rl_loop import load_policy

    cfg = load_config(ROOT / "pipeline.yaml")
    base = Path(args.store) / args.run
    task = make_task(cfg.data)
    tok = load_tokenizer(str(base / "sft" / "model"))
    sizes = [int(s) for s in args.sizes.split(",")]
    shapes = [
        ("preferences", lambda: load_causal_lm(str(base / "sft" / "model"), inference_model(cfg.model)), 64,
         SamplingParams(1.0, 1.0, 16, 8, 5)),
        ("eval", lambda: load_causal_lm(str(base / "dpo" / "model"), inference_model(cfg.model)), 128,
         SamplingParams(0.0, 1.0, 16, 1, 5)),
        ("grpo", lambda: load_policy(cfg.grpo, str(base / "dpo" / "model"), None, cfg.model, 0), 32,
         SamplingParams(0.7, 1.0, 16, 4, 5)),
    ]
    for name, load, n_prompts, params in shapes:
        model = load()
        prompts = [p.messages() for p in random.Random(n_prompts).sample(task.rl, n_prompts)]
        for size in sizes:
            if size > n_prompts * params.n * 2:
                continue
            seconds = timed(lambda: HFEngine(model, tok, size).generate(prompts, params))
            print(f"{name:11} {n_prompts} prompts x {params.n}  batch {size:4}  " + " ".join(f"{s:.2f}" for s in seconds)
                  + " s", flush=True)
    head_slices(576, 49152)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
