"""Peak memory, step time, tokens/s and MFU of one optimizer step of each objective (SFT, reward model,
DPO from cached reference log-probs, GRPO with G=4, PPO), on a random-init model of a given shape, next
to rlhf/pipeline/memory.py's prediction for the same settings.

Weights do not matter for memory or speed, so the model is built from a config (no download): the
Qwen2.5-1.5B shape on the GPU, a tiny one on CPU (which only checks that the script runs; CPU has no
max_memory_allocated). Settings as the estimator's test table (tests/test_preflight.py): mixed precision
(float32 master weights, bf16 autocast), gradient checkpointing, 8-bit AdamW (bitsandbytes; plain AdamW
if it is missing, and the prediction follows), 512-token sequences. The losses are the project's own
(rlhf/maths/losses.py, rlhf/maths/rl_math.py); the step is forward + backward + optimizer step, and for the RL
algorithms the no-grad scoring passes (old policy, reference, critic, reward model) that precede the
update. Generation is not timed here (the rollout engine has its own benchmark).
MFU counts model FLOPs only: 6 x params x tokens for a trained pass, 2 x params x tokens for a scoring
pass (no attention term, no recomputation), over the device's dense bf16 peak.

    python bench/gpu/steps.py --shape qwen2.5-1.5b --device cuda --out gpu_steps.json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rlhf.maths import rl_math  # noqa: E402
from rlhf.maths.losses import dpo_loss  # noqa: E402

SHAPES = {
    "qwen2.5-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 49152, "tie_word_embeddings": True},
}
PEAK_FLOPS = {"cuda": 989e12}  # H100/H200 SXM dense bf16 (NVIDIA datasheet); CPU: no MFU
SEQ = 512
RL_PROMPT = 96  # rlhf/pipeline/memory.py RL_PROMPT_TOKENS: RL sequences are 96 prompt + 416 response tokens
BATCH = {"sft": 8, "reward_model": 4, "dpo": 4, "grpo": 8, "ppo": 8}  # sequences / pairs / rollouts per step


def optimizer(params):
    try:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-6), "adamw_bnb_8bit"
    except Exception:  # not installed, or no kernel for this device
        return torch.optim.AdamW(params, lr=1e-6), "adamw_torch"


class Models:
    def __init__(self, shape: dict, device: str, attn: str):
        self.device, self.shape, self.attn = device, shape, attn

    def make(self, kind: str, trained: bool):
        from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification, Qwen2ForTokenClassification

        cls = {"lm": Qwen2ForCausalLM, "seq": Qwen2ForSequenceClassification, "tok": Qwen2ForTokenClassification}[kind]
        cfg = Qwen2Config(**self.shape, max_position_embeddings=4096, attn_implementation=self.attn, pad_token_id=0,
                          **({} if kind == "lm" else {"num_labels": 1}))
        with torch.device(self.device):
            model = cls(cfg).to(torch.float32 if trained else torch.bfloat16)
        if trained:
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
            model.config.use_cache = False
            model.train()
        else:
            model.eval().requires_grad_(False)
        return model

    def params(self) -> int:
        from rlhf.pipeline.memory import _from_config

        return _from_config(self.shape).params()


def token_logps(model, ids: torch.Tensor, start: int) -> torch.Tensor:
    """log p of tokens ids[:, start:] given the prefix: [B, T - start]."""
    logits = model(input_ids=ids, use_cache=False).logits[:, start - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, start:].unsqueeze(-1)).squeeze(-1)


def objectives(m: Models, device: str, autocast):
    """name -> (setup() -> state, step(state) -> None, tokens trained per step, scoring tokens per step)."""
    vocab = m.shape["vocab_size"]
    rand = lambda b, s=SEQ: torch.randint(0, vocab, (b, s), device=device)  # noqa: E731

    def opt_step(opts):
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)

    def sft():
        policy = m.make("lm", True)
        opt, _ = optimizer(policy.parameters())

        def step():
            ids = rand(BATCH["sft"])
            with autocast():
                logits = policy(input_ids=ids, use_cache=False).logits[:, :-1].float()
            F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1)).backward()
            opt_step([opt])
        return step, BATCH["sft"] * SEQ, 0

    def reward_model():
        rm = m.make("seq", True)
        opt, _ = optimizer(rm.parameters())

        def step():
            ids = rand(2 * BATCH["reward_model"])
            with autocast():
                r = rm(input_ids=ids, use_cache=False).logits[:, 0].float()
            (-F.logsigmoid(r[0::2] - r[1::2]).mean()).backward()  # Bradley-Terry, chosen rows even
            opt_step([opt])
        return step, 2 * BATCH["reward_model"] * SEQ, 0

    def dpo():
        policy = m.make("lm", True)
        opt, _ = optimizer(policy.parameters())
        n = BATCH["dpo"]
        ref = torch.randn(2 * n, device=device) - 100  # cached reference log-probs: no reference model

        def step():
            ids = rand(2 * n)
            with autocast():
                lp = token_logps(policy, ids, RL_PROMPT).sum(-1)
            loss, _ = dpo_loss(lp[:n], lp[n:], ref[:n], ref[n:], beta=0.1)
            loss.mean().backward()
            opt_step([opt])
        return step, 2 * n * SEQ, 0

    def grpo():
        policy, reference = m.make("lm", True), m.make("lm", False)
        opt, _ = optimizer(policy.parameters())
        n, g = BATCH["grpo"], 4

        def step():
            ids = rand(n)
            mask = torch.ones(n, SEQ - RL_PROMPT, device=device)
            with torch.no_grad(), autocast():
                old, ref = token_logps(policy, ids, RL_PROMPT), token_logps(reference, ids, RL_PROMPT)
            adv = rl_math.group_advantages(torch.rand(n, device=device), g)[:, None]
            with autocast():
                lp = token_logps(policy, ids, RL_PROMPT)
            pg, _ = rl_math.clipped_surrogate(lp, old, adv, mask, 0.2)
            (rl_math.masked_mean(pg, mask) + 0.04 * rl_math.masked_mean(rl_math.kl_k3(lp, ref, mask), mask)).backward()
            opt_step([opt])
        return step, n * SEQ, 2 * n * SEQ

    def ppo():
        policy, critic = m.make("lm", True), m.make("tok", True)
        reference, rm = m.make("lm", False), m.make("seq", False)
        opts = [optimizer(policy.parameters())[0], optimizer(critic.parameters())[0]]
        n = BATCH["ppo"]

        def step():
            ids = rand(n)
            mask = torch.ones(n, SEQ - RL_PROMPT, device=device)
            with torch.no_grad(), autocast():
                old, ref = token_logps(policy, ids, RL_PROMPT), token_logps(reference, ids, RL_PROMPT)
                values = critic(input_ids=ids, use_cache=False).logits[:, RL_PROMPT - 1 : -1, 0].float()
                score = rm(input_ids=ids, use_cache=False).logits[:, 0].float()
            rewards = rl_math.kl_penalized_rewards(score, rl_math.kl_k1(old, ref), mask, 0.05)
            adv, returns = rl_math.gae(rewards, values, mask, 1.0, 0.95)
            with autocast():
                lp = token_logps(policy, ids, RL_PROMPT)
                v = critic(input_ids=ids, use_cache=False).logits[:, RL_PROMPT - 1 : -1, 0].float()
            pg, _ = rl_math.clipped_surrogate(lp, old, rl_math.whiten(adv, mask), mask, 0.2)
            vl = rl_math.clipped_value_loss(v, values, returns, 0.2)
            (rl_math.masked_mean(pg, mask) + 0.1 * rl_math.masked_mean(vl, mask)).backward()
            opt_step(opts)
        # trained: policy and critic; scoring: old policy, reference, critic, reward model
        return step, 2 * n * SEQ, 4 * n * SEQ

    return {"sft": sft, "reward_model": reward_model, "dpo": dpo, "grpo": grpo, "ppo": ppo}


def predictions(shape: dict, attn: str, optim: str) -> dict[str, float]:
    """rlhf/pipeline/memory.py's totals (GiB) for the same settings, through the same config path as `rlhf validate`."""
    from rlhf.core.loader import load_config
    from rlhf.pipeline.memory import stage_estimates

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(shape))
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "pipeline.yaml", "default", [
        f"model.name={folder}", "model.dtype=bfloat16", "model.mixed_precision=true", f"model.attn_implementation={attn}",
        *[f"{s}.{k}={v}" for s in ("sft", "reward_model", "dpo") for k, v in
          (("optim", optim), ("gradient_checkpointing", "true"), ("max_length", SEQ), ("per_device_batch_size", BATCH[s]))],
        f"ref_logprobs.max_length={SEQ}", f"rollout.max_new_tokens={SEQ - RL_PROMPT}", "rollout.batch_size=8",
        *[f"{s}.{k}={v}" for s in ("grpo", "ppo") for k, v in
          (("enabled", "true"), ("optim", optim), ("gradient_checkpointing", "true"), ("minibatch_size", BATCH[s]))],
        "grpo.group_size=4", "grpo.prompts_per_iteration=2", "grpo.lora.enabled=false",  # the step above trains full weights
        "ppo.prompts_per_iteration=8", "ppo.reward_source=reward_model",
    ])
    est = stage_estimates(cfg)
    return {s: est[s]["total"] for s in BATCH}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--only", nargs="*", choices=sorted(BATCH), help="a subset of the objectives")
    ap.add_argument("--out", type=Path, help="JSON results")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    attn = "sdpa"
    try:
        import flash_attn  # noqa: F401

        attn = "flash_attention_2" if cuda else attn
    except ImportError:
        pass
    m = Models(SHAPES[args.shape], args.device, attn)
    autocast = lambda: torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16)  # noqa: E731
    _, optim = optimizer([torch.nn.Parameter(torch.zeros(4096, device=args.device))])
    predicted = predictions(SHAPES[args.shape], attn, optim)
    rows = []
    for name, build in objectives(m, args.device, autocast).items():
        if args.only and name not in args.only:
            continue
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        step, trained_tokens, scored_tokens = build()
        step()  # warm-up: kernels, optimizer state allocation
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / args.steps
        flops = 6 * m.params() * trained_tokens + 2 * m.params() * scored_tokens
        peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
        rows.append({"stage": name, "peak_gb": peak, "predicted_gb": predicted[name] * 1024**3 / 1e9,
                     "step_s": seconds, "tokens_per_s": (trained_tokens + scored_tokens) / seconds,
                     "mfu": flops / seconds / PEAK_FLOPS["cuda"] if cuda else None})
        step = None  # free this objective's models before the next one
        print(f"{name}: done in {seconds:.3f} s/step", flush=True)
    meta = {"shape": args.shape, "params": m.params(), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "attn": attn, "optim": optim, "seq": SEQ, "batch": BATCH, "torch": torch.__version__,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
    print(f"\n{meta}\n\n| stage | peak GB (measured) | GB (estimator) | s/step | tokens/s | MFU |\n|---|---|---|---|---|---|")
    for r in rows:
        fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
        print(f"| {r['stage']} | {fmt(r['peak_gb'], '.1f')} | {r['predicted_gb']:.1f} | {r['step_s']:.3f} | "
              f"{r['tokens_per_s']:.0f} | {fmt(r['mfu'], '.1%')} |")
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
