"""Reference-cache throughput: our batched reference pass (rlhf/engines/logprobs.py pair_logps: collation,
forward, log-softmax, gather, sums) vs a plain forward of the very same padded batches (model call
only), side by side in one process on the embedded default model. The ratio is what the log-prob
bookkeeping costs on top of the forward that any reference pass must do.

Run: .venv/bin/python bench/ref_throughput.py [--pairs 128 --batch 16]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhf.core.config import DataConfig, ModelConfig  # noqa: E402
from rlhf.engines.logprobs import pair_logps, tokenize_pair  # noqa: E402
from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model  # noqa: E402
from rlhf.data.pairs import preference_pairs  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-length", type=int, default=128)
    a = p.parse_args()
    model_cfg = ModelConfig()
    path = resolve_model(model_cfg)
    tok, model = load_tokenizer(path), load_causal_lm(path, model_cfg).eval()
    rows, _ = preference_pairs(DataConfig(train_size=a.pairs, eval_size=8), logging.getLogger("bench"))
    pairs = [tokenize_pair(tok, r) for r in rows][: a.pairs]

    from trl.trainer.dpo_trainer import DataCollatorForPreference

    collator = DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=a.max_length)
    batches = [collator([{"prompt_ids": x.prompt_ids, "chosen_ids": x.chosen_ids, "rejected_ids": x.rejected_ids}
                         for x in pairs[i : i + a.batch]]) for i in range(0, len(pairs), a.batch)]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)

    def plain() -> None:
        for b in batches:
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)

    def ours() -> None:
        pair_logps(model, tok, pairs, a.max_length, a.batch)

    times = {}
    with torch.inference_mode():
        plain()  # warm-up
        for name, fn in (("plain_forward", plain), ("ours", ours), ("plain_forward_2", plain), ("ours_2", ours)):
            t0 = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - t0
    ours_s = min(times["ours"], times["ours_2"])
    plain_s = min(times["plain_forward"], times["plain_forward_2"])
    print(json.dumps({
        "pairs": len(pairs), "batch": a.batch, "tokens": tokens,
        "ours_tokens_per_s": round(tokens / ours_s), "plain_forward_tokens_per_s": round(tokens / plain_s),
        "throughput_ratio_ours_over_plain": round(plain_s / ours_s, 3),
    }))


if __name__ == "__main__":
    main()
