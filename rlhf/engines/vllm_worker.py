"""The vLLM side of `rlhf.engines.vllm_engine.VLLMEngine`: runs inside the separate vLLM virtualenv (setup-vllm.sh),
never inside the project's own environment (vLLM pins its own torch, transformers and fastapi).

Standard library and vllm only: no rlhf import. One JSON request per line on stdin, one JSON reply per
line on the original stdout; everything else anything prints (vLLM's logs, C libraries) is moved to
stderr first, so the reply channel carries replies only.
  {"op": "load", "model": PATH, "dtype": ..., "max_model_len": N, "seed": S, "tensor_parallel_size": T,
   "gpu_memory_utilization": F}                                  -> {"ok": true}
  {"op": "generate", "prompts": [[ids]], "temperature", "top_p", "max_tokens", "n", "seed"}
                                                                  -> {"generations": [...]}
  {"op": "continue", "sequences": [[ids]], "temperature", "top_p", "max_tokens", "seed", "stop": [str]}
                                                                  -> {"turns": [{token_ids, logprobs}]}
  {"op": "prompt_logprobs", "sequences": [[ids]]}                 -> {"logprobs": [[float]]} (token 1..)
  {"op": "reload", "path": PATH}                                  -> {"ok": true} (weights in place)
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _embeddings_and_head(worker):
    model = worker.model_runner.get_model()
    inner = getattr(model, "model", None)
    return getattr(inner, "embed_tokens", None), getattr(model, "lm_head", None)


def _is_tied(worker) -> bool:
    embed, head = _embeddings_and_head(worker)
    return embed is not None and head is not None and head.weight.data_ptr() == embed.weight.data_ptr()


def _refresh_tied_head(worker) -> None:
    """vLLM 0.32's in-place reload skips `lm_head.weight` of a tied model (the checkpoint has none), so
    the head's post-load processing never reruns: on CPU it keeps a GEMM closure over the old weights
    (`cpu_linear`), and the logits came from stale embeddings (measured: probe log-probs off by 1.3 after
    an update of the embeddings; the weight-sync check caught it). Rerun the head's processing."""
    embed, head = _embeddings_and_head(worker)
    head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # from here on, stdout is stderr
    sys.stdout = sys.stderr
    # One process: the engine core in this process, so weight reloads and probes see one model.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm, tied = None, False
    for line in sys.stdin:
        req = json.loads(line)
        try:
            op = req["op"]
            if op == "load":
                llm = LLM(model=req["model"], dtype=req["dtype"], max_model_len=req["max_model_len"], seed=req["seed"],
                          tensor_parallel_size=req["tensor_parallel_size"],
                          gpu_memory_utilization=req["gpu_memory_utilization"],
                          # the log-probs of the distribution sampled from (after temperature / top-p), as the
                          # HF engine reports them
                          logprobs_mode="processed_logprobs", enable_prefix_caching=False,
                          enforce_eager=req["enforce_eager"])
                tied = llm.collective_rpc(_is_tied)[0]
                reply = {"ok": True, "tied_embeddings": tied}
            elif op == "generate":
                greedy = req["temperature"] == 0
                params = SamplingParams(n=req["n"], temperature=req["temperature"], top_p=1.0 if greedy else req["top_p"],
                                        max_tokens=req["max_tokens"], seed=req["seed"], logprobs=0)
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False)
                gens = []
                for i, out in enumerate(outs):
                    for s, c in enumerate(out.outputs):
                        lps = [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)]
                        gens.append({"prompt_index": i, "sample_index": s, "token_ids": list(c.token_ids),
                                     "logprobs": lps, "finish_reason": c.finish_reason})
                reply = {"generations": gens}
            elif op == "continue":  # one more turn of each episode; seeded per sequence, not per batch
                greedy = req["temperature"] == 0
                params = [SamplingParams(temperature=req["temperature"], top_p=1.0 if greedy else req["top_p"],
                                         max_tokens=req["max_tokens"], seed=req["seed"] * 1_000_003 + i, logprobs=0,
                                         stop=req["stop"] or None, include_stop_str_in_output=True)
                          for i in range(len(req["sequences"]))]
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["sequences"]], params, use_tqdm=False)
                reply = {"turns": [{"token_ids": list(o.outputs[0].token_ids),
                                    "logprobs": [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
                                   for o in outs]}
            elif op == "prompt_logprobs":
                params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["sequences"]], params, use_tqdm=False)
                reply = {"logprobs": [[step[tok].logprob for step, tok in zip(o.prompt_logprobs[1:], seq[1:])]
                                      for o, seq in zip(outs, req["sequences"])]}
            elif op == "reload":
                llm.collective_rpc("reload_weights", kwargs={"weights_path": req["path"]})
                if tied:
                    llm.collective_rpc(_refresh_tied_head)
                reply = {"ok": True}
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as e:  # the client raises it with the worker's traceback
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
