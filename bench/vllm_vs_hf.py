"""Rollout throughput: the vLLM engine (its own environment, rlhf/engines/vllm_engine.py) vs the HF engine
(transformers generate), same model, prompts, sampling parameters and lengths, one after the other in
one run. Generated tokens per second, engine start excluded (reported apart).

Run: .venv/bin/python bench/vllm_vs_hf.py [--prompts 64 --new-tokens 32 --eager]
(needs ./setup-vllm.sh, or RLHF_VLLM_PYTHON pointing at a vLLM environment)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhf.core.config import DataConfig, ModelConfig  # noqa: E402
from rlhf.engines.engine import HFEngine, SamplingParams  # noqa: E402
from rlhf.core.models import load_causal_lm, load_tokenizer, resolve_model  # noqa: E402
from rlhf.data.tasks import Task  # noqa: E402
from rlhf.engines.vllm_engine import VLLMEngine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=32, help="HF engine batch size")
    p.add_argument("--eager", action="store_true", help="vLLM without torch.compile (faster start)")
    a = p.parse_args()
    cfg = ModelConfig()
    path = resolve_model(cfg)
    tok = load_tokenizer(path)
    prompts = [q.messages() for q in Task(DataConfig(train_size=a.prompts, eval_size=8)).train]
    params = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens, seed=0)

    model = load_causal_lm(path, cfg)
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf = HFEngine(model, tok, a.batch).generate(prompts, params)
    hf_s = time.perf_counter() - t0
    del model

    t0 = time.perf_counter()
    with VLLMEngine(path, tok, dtype="float32", max_model_len=512, enforce_eager=a.eager) as engine:
        start_s = time.perf_counter() - t0
        engine.generate(prompts[:4], params)  # warm-up
        t0 = time.perf_counter()
        vl = engine.generate(prompts, params)
        vllm_s = time.perf_counter() - t0
    hf_tokens, vllm_tokens = sum(len(g.token_ids) for g in hf), sum(len(g.token_ids) for g in vl)
    print(json.dumps({
        "prompts": len(prompts), "max_new_tokens": a.new_tokens, "eager": a.eager,
        "hf_tokens_per_s": round(hf_tokens / hf_s, 1), "vllm_tokens_per_s": round(vllm_tokens / vllm_s, 1),
        "throughput_ratio_vllm_over_hf": round((vllm_tokens / vllm_s) / (hf_tokens / hf_s), 2),
        "vllm_engine_start_s": round(start_s, 1),
    }))


if __name__ == "__main__":
    main()
