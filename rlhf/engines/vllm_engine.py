"""vLLM rollout engine behind the `Engine` protocol, running in its own virtualenv.

vLLM pins its own torch, transformers and fastapi, which clash with this project's (one pip resolve cannot hold both),
so the engine is a child process started from that environment's Python (`setup-vllm.sh` builds it;
`rollout.vllm.python` or RLHF_VLLM_PYTHON points at it) running rlhf/engines/vllm_worker.py, and this class talks
to it in JSON lines. Prompts cross as token ids (the chat template is applied here, with the same
tokenizer as the HF engine), so both engines see identical inputs. Outputs are the HF engine's:
token ids, the sampler's log-probs (after temperature / top-p) and finish reasons.

Weight sync: after a policy update the trainer writes its weights (safetensors) to a folder and calls
`sync(folder, probe)`: the engine reloads them in place, then scores a fixed probe sequence, and the
result is compared with the trainer's own log-probs of that sequence; beyond the tolerance the sync is
refused (`WeightSyncError`) instead of generating from stale or corrupted weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rlhf.core.config import RolloutConfig
from rlhf.core.fingerprint import vllm_python_path
from rlhf.engines.engine import Generation, SamplingParams, chat_ids, turn_end

WORKER = Path(__file__).with_name("vllm_worker.py")


class VLLMError(RuntimeError):
    pass


class WeightSyncError(VLLMError):
    pass


def vllm_python(configured: str | None = None) -> Path:
    """The vLLM environment's interpreter: the config, else RLHF_VLLM_PYTHON, else .venv-vllm/."""
    path = vllm_python_path(configured)
    if not path.exists():
        raise VLLMError(f"rollout.vllm.python: no vLLM environment at {path}; build it with ./setup-vllm.sh "
                        "(or point rollout.vllm.python / RLHF_VLLM_PYTHON at one)")
    return path


class VLLMEngine:
    def __init__(self, model_dir: str, tokenizer, *, python: str | None = None, dtype: str = "float32",
                 max_model_len: int = 1024, seed: int = 0, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, enforce_eager: bool = False):
        self.tokenizer = tokenizer
        self.proc = subprocess.Popen([str(vllm_python(python)), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1,
                                     env={**os.environ, "PYTHONPATH": ""})  # the vLLM venv's packages only
        self._call({"op": "load", "model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len, "seed": seed,
                    "tensor_parallel_size": tensor_parallel_size, "gpu_memory_utilization": gpu_memory_utilization,
                    "enforce_eager": enforce_eager})

    def _call(self, req: dict) -> dict:
        if self.proc.poll() is not None:
            raise VLLMError(f"the vLLM worker exited with code {self.proc.returncode}")
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise VLLMError(f"the vLLM worker exited during {req['op']!r} (code {self.proc.wait()}); see its stderr")
        reply = json.loads(line)
        if "error" in reply:
            raise VLLMError(f"vLLM {req['op']}: {reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def prompt_ids(self, prompts: list[list[dict]]) -> list[list[int]]:
        return [chat_ids(self.tokenizer, p) for p in prompts]

    def generate(self, prompts: list[list[dict]], params: SamplingParams, shard: tuple[int, int] = (0, 1),
                 on_batch=None) -> list[Generation]:
        """Generations ordered by (prompt, sample). vLLM schedules its own batches, so a rank's shard is
        every world-th prompt (seeded per request, so samples do not depend on the shard)."""
        mine = list(range(len(prompts)))[shard[0] :: shard[1]]
        reply = self._call({"op": "generate", "prompts": self.prompt_ids([prompts[i] for i in mine]),
                            "temperature": params.temperature, "top_p": params.top_p,
                            "max_tokens": params.max_new_tokens, "n": params.n, "seed": params.seed})
        out = [Generation(mine[g["prompt_index"]], g["sample_index"], g["token_ids"], g["logprobs"],
                          self.tokenizer.decode(g["token_ids"], skip_special_tokens=True),
                          "stop" if g["finish_reason"] == "stop" else "length") for g in reply["generations"]]
        if on_batch is not None:
            on_batch(len(mine) * params.n, len(mine) * params.n)
        return out

    def continue_ids(self, seqs: list[list[int]], params: SamplingParams, stop: tuple[str, ...], seed: int
                     ) -> list[tuple[list[int], list[float], str]]:
        """One more turn of each episode's transcript, as HFEngine.continue_ids: (tokens, the sampler's
        log-probs, 'tool' | 'stop' | 'length'), the turn cut where the HF engine cuts it (engine.turn_end).
        Each sequence is seeded by (seed, its index), so a turn does not depend on how vLLM batches."""
        reply = self._call({"op": "continue", "sequences": seqs, "temperature": params.temperature, "top_p": params.top_p,
                            "max_tokens": params.max_new_tokens, "seed": seed, "stop": list(stop)})
        return [turn_end(self.tokenizer, t["token_ids"], t["logprobs"], stop) for t in reply["turns"]]

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token t | tokens < t) for t >= 1 of each sequence, under the engine's current weights."""
        return self._call({"op": "prompt_logprobs", "sequences": sequences})["logprobs"]

    def sync(self, weights_dir: str, probe: list[int], expected: list[float], tolerance: float) -> float:
        """Reload weights in place, then check them: the engine's log-probs of `probe` must match the
        trainer's (`expected`) within `tolerance` (max abs). Returns that max difference."""
        self._call({"op": "reload", "path": str(weights_dir)})
        got = self.prompt_logprobs([probe])[0]
        diff = max(abs(a - b) for a, b in zip(got, expected))
        if diff > tolerance:
            raise WeightSyncError(f"weight sync check failed: the engine's log-probs of the probe differ from the "
                                  f"trainer's by up to {diff:.4g} (> {tolerance}); refusing to generate from these weights")
        return diff

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":  # python -m rlhf.engines.vllm_engine: says where the vLLM environment is expected
    print(vllm_python())
    sys.exit(0)


def make_vllm(cfg: RolloutConfig, model_dir: str, tok, dtype: str, seed: int) -> VLLMEngine:
    """The engine the rollout settings describe (the rollout stage and the RL loop sample through it)."""
    v = cfg.vllm
    return VLLMEngine(model_dir, tok, python=v.python, dtype=dtype, max_model_len=v.max_model_len, seed=seed,
                      tensor_parallel_size=v.tensor_parallel_size, gpu_memory_utilization=v.gpu_memory_utilization,
                      enforce_eager=v.enforce_eager)
