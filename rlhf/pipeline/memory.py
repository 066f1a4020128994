"""Peak-memory estimate per stage, before launch, from the model's shape and the stage's batch settings.

Pure arithmetic, no torch import: `rlhf validate` prints it and every run logs it first. It is an
estimate of the dominant terms, to catch a config that cannot fit, not a measurement:
  weights      P x bytes(dtype) per model held (policy, frozen reference, critic, reward model); a trained
               model under model.mixed_precision holds float32 master weights (4 bytes)
  gradients    P x bytes(dtype) for trained weights (LoRA: the adapters only); 4 bytes under mixed precision
  optimizer    AdamW: 2 states x bytes(dtype) per trained weight (x 4 bytes under mixed precision, so
               16 bytes per weight in all, as in Rajbhandari et al. 2020, sec. 3.1); 8-bit AdamW: 2 bytes
  activations  per layer s*b*h*(34 + 5*a*s/h) bytes at 16 bits (Korthikanti et al. 2022, eq. 1), doubled
               for float32; the 5as/h attention-score term is dropped for flash attention; gradient
               checkpointing keeps 2*s*b*h per layer plus one layer's full activations
  logits       b*s*V float32 values, three times (logits, log-softmax, their gradient) when trained
  KV cache     2 x L x b x s x kv_dim x bytes(dtype) while generating
RL sequence length = RL_PROMPT_TOKENS + rollout.max_new_tokens (chain_sum prompts with the chat template
are about 60 tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlhf.core.config import ModelConfig, PipelineConfig
from rlhf.core.registry import SPECS, plan

GIB = 1024**3
RL_PROMPT_TOKENS = 96
# SmolLM2-135M-Instruct (HuggingFaceTB/SmolLM2-135M-Instruct config.json; the embedded GGUF has the same
# shape): known without converting the GGUF first.
SMOLLM2_135M = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
TINY_VOCAB = 49152  # the tiny model uses the embedded tokenizer


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def linear_in_out(self) -> int:
        """Sum of (in + out) over one layer's linear maps (q, k, v, o, gate, up, down): LoRA's size per rank."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        return 2 * (h + h) + 2 * (h + kv) + 2 * (h + i) + (i + h)

    def params(self) -> int:
        """Llama-family parameter count: embeddings (+ untied head), per layer q/k/v/o, gated MLP, 2 norms."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        layer = h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h
        return self.vocab * h * (1 if self.tied else 2) + self.layers * layer + h


def _from_config(c: dict) -> Shape:
    return Shape(c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                 c.get("num_key_value_heads", c["num_attention_heads"]), c["intermediate_size"], c["vocab_size"],
                 bool(c.get("tie_word_embeddings", False)))


def model_shape(cfg: ModelConfig) -> Shape | None:
    """The shape without loading weights; None when no config.json is at hand (a hub id not yet cached)."""
    if cfg.name == "smollm2-135m-instruct":
        return _from_config(SMOLLM2_135M)
    if cfg.name == "tiny":
        t = cfg.tiny
        return Shape(t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.intermediate_size, TINY_VOCAB, True)
    path = Path(cfg.name).expanduser() / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(cfg.name, "config.json")
            path = Path(cached) if isinstance(cached, str) else path
        except Exception:  # not a repo id either: the stage itself will say what is wrong
            return None
    if not path.is_file():
        return None
    try:
        return _from_config(json.loads(path.read_text()))
    except (KeyError, ValueError):
        return None


def activation_bytes(s: Shape, batch: int, seq: int, dtype_bytes: int, flash: bool, checkpointing: bool) -> int:
    scores = 0 if flash else 5 * s.heads * seq / s.hidden
    full_layer = seq * batch * s.hidden * (34 + scores) * dtype_bytes / 2
    if checkpointing:
        return int(s.layers * 2 * seq * batch * s.hidden * dtype_bytes / 2 + full_layer)
    return int(s.layers * full_layer)


def logits_bytes(s: Shape, batch: int, seq: int, trained: bool) -> int:
    return batch * seq * s.vocab * 4 * (3 if trained else 1)


def trained_model_bytes(s: Shape, dtype_bytes: int, optim: str, lora_rank: int | None, mixed: bool = False) -> dict[str, int]:
    """Weights, gradients and AdamW states of one trained model. `mixed`: float32 master weights,
    gradients and states (a LoRA base stays in the compute dtype; its adapters are the trained part)."""
    p = s.params()
    trained = s.layers * s.linear_in_out() * lora_rank if lora_rank else p
    master = 4 if mixed else dtype_bytes
    state_bytes = 2 if optim == "adamw_bnb_8bit" else 2 * master
    return {"weights": p * (dtype_bytes if lora_rank else master), "gradients": trained * master,
            "optimizer": trained * state_bytes}


def stage_estimates(cfg: PipelineConfig) -> dict[str, dict[str, float]] | None:
    """GiB per enabled stage: the terms above and their total. None when the model's shape is unknown."""
    s = model_shape(cfg.model)
    if s is None:
        return None
    w = 4 if cfg.model.dtype == "float32" else 2
    mixed = cfg.model.mixed_precision
    flash = cfg.model.attn_implementation == "flash_attention_2"
    out: dict[str, dict[str, float]] = {}
    for stage in plan(cfg):
        st = cfg.stage(stage)
        terms: dict[str, int] = {}
        kind = SPECS[stage].kind
        if kind == "trainer":
            rows = st.per_device_batch_size * (2 if stage in ("reward_model", "dpo") else 1)
            lora = st.lora.r if st.lora.enabled else None
            terms.update(trained_model_bytes(s, w, st.optim, lora, mixed))
            terms["activations"] = activation_bytes(s, rows, st.max_length, w, flash, st.gradient_checkpointing)
            # a classifier reward model's head is one scalar; the implicit one scores through the vocabulary
            if stage != "reward_model" or cfg.reward_model.kind == "implicit":
                terms["logits"] = logits_bytes(s, rows, st.max_length, trained=True)
        elif kind == "rl":
            seq = RL_PROMPT_TOKENS + cfg.rollout.max_new_tokens
            lora = st.lora.r if st.lora.enabled else None
            terms.update(trained_model_bytes(s, w, st.optim, lora, mixed))
            # the frozen reference (none with LoRA: the base with adapters off; none without a KL term, as
            # the loop loads it only then) and the reward model
            kl_term = (st.beta if stage == "grpo" else st.kl.beta) > 0 or (stage == "ppo" and st.kl.mode == "adaptive")
            frozen = (0 if lora or not kl_term else 1) + (1 if st.uses_reward_model() else 0)
            if stage == "ppo":  # the critic: a second trained backbone
                critic = trained_model_bytes(s, w, st.optim, None, mixed)
                terms["weights"] += critic["weights"]
                terms["gradients"] += critic["gradients"]
                terms["optimizer"] += critic["optimizer"]
            terms["weights"] += frozen * s.params() * w  # reference (+ reward model)
            micro = st.minibatch_size // st.gradient_accumulation_steps
            terms["activations"] = activation_bytes(s, micro, seq, w, flash, st.gradient_checkpointing)
            terms["activations"] *= 2 if stage == "ppo" else 1
            terms["logits"] = logits_bytes(s, micro, seq, trained=True)
            terms["kv_cache"] = 2 * s.layers * cfg.rollout.batch_size * seq * s.kv_dim * w
        else:  # inference stages: ref_logprobs, rollout, eval
            batch = {"ref_logprobs": 2 * cfg.ref_logprobs.batch_size}.get(stage, getattr(st, "batch_size", 16))
            seq = cfg.ref_logprobs.max_length if stage == "ref_logprobs" else RL_PROMPT_TOKENS + getattr(st, "max_new_tokens", 32)
            terms["weights"] = s.params() * w * (2 if stage == "eval" and cfg.reward_model.enabled else 1)
            terms["activations"] = activation_bytes(s, batch, seq, w, flash, False) // s.layers  # no grad: one layer live
            terms["logits"] = logits_bytes(s, batch, seq, trained=False)
            if stage != "ref_logprobs":
                terms["kv_cache"] = 2 * s.layers * batch * seq * s.kv_dim * w
        gib = {k: round(v / GIB, 2) for k, v in terms.items()}
        gib["total"] = round(sum(terms.values()) / GIB, 2)
        if stage == "dpo":  # what the cached reference saves: TRL's default holds the reference model too
            gib["total_with_reference_model"] = round((sum(terms.values()) + s.params() * w) / GIB, 2)
        out[stage] = gib
    return out
