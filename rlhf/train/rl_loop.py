"""One RL loop for PPO and GRPO: rollout -> reward -> logp_old, logp_ref (and values) -> advantages ->
K epochs of clipped updates over minibatches -> experience Parquet -> checkpoint every N iterations.

Algorithm differences live in one Algorithm record each (ALGORITHMS: advantages, extra loss, critic,
reference, KL coefficient, entropy bonus), not in branches of one long method. PPO (Ouyang et al. 2022 / Ziegler et al. 2019): KL-penalised token rewards, a critic
(token-level value head on a copy of the SFT or RM backbone), GAE, clipped value loss, fixed or
adaptive KL coefficient. GRPO (Shao et al. 2024): G samples per prompt, group-normalised outcome
advantages, no critic, k3 KL penalty in the loss. Both: token-level loss averaging over the minibatch,
clip (clip-higher) and optional dual clip. Every iteration's experience is a Parquet table under
`experience/`; resume restarts after the last complete checkpoint and never rewrites earlier tables.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import torch
from trl.trainer.utils import disable_dropout_in_model

from rlhf.core import dist, progress, tracking
from rlhf.maths import rl_math
from rlhf.engines.engine import Engine, HFEngine, SamplingParams, chat_ids
from rlhf.engines.prefix import forward as shared_prefix_forward
from rlhf.engines.prefix import last_logits_only, pad_after_prefix, positions
from rlhf.engines.generation import verifier_accuracy
from rlhf.engines.logprobs import sequence_logps
from rlhf.envs.episodes import EpisodeEngine, episode_stats, play
from rlhf.core.models import autocast, load_causal_lm, load_tokenizer, torch_dtype, weights_dtype
from rlhf.train import remote
from rlhf.train.async_rollout import Draw, Prefetcher
from rlhf.train.rewards import load_reward_model, reward_model_scores, reward_terms, weighted_rewards
from rlhf.core.stage import StageContext, StageResult
from rlhf.data.tasks import assistant
from rlhf.data.sources import PromptSource, make_task
from rlhf.core.tables import METRICS_SCHEMA
from rlhf.train.training import (
    CRASH_ENV,
    InjectedCrash,
    fetch_model,
    latest_checkpoint,
    peft_config,
    publish_model,
    start_model,
    store_checkpoint,
    write_metrics,
)


class RLGuardError(RuntimeError):
    """NaN/Inf or runaway KL: the stage stops; the last complete checkpoint stays intact."""


@dataclass
class Batch:
    """One iteration's experience. B = prompts x samples per prompt, P = longest prompt, T = longest response."""

    input_ids: torch.Tensor  # [B, P + T] prompt (shared prefix | padding | rest: prefix.pad_after_prefix) | right-padded response
    attention_mask: torch.Tensor  # [B, P + T]
    mask: torch.Tensor  # [B, T] 1 on response tokens
    logp_rollout: torch.Tensor  # [B, T] sampler's log-probs
    logp_old: torch.Tensor | None = None  # [B, T] policy before this iteration's updates
    logp_ref: torch.Tensor | None = None  # [B, T] frozen reference policy
    values: torch.Tensor | None = None  # [B, T] critic before updates (PPO)
    advantages: torch.Tensor | None = None  # [B, T]
    returns: torch.Tensor | None = None  # [B, T] (PPO)
    weights: torch.Tensor | None = None  # [B, T] sampler-mismatch importance weights (sampler_correction)

    def rows(self, lo: int, hi: int) -> Batch:
        """Rows [lo, hi) of what a scorer reads (ids, masks), on the CPU: what a scorer actor is sent."""
        return Batch(*(t[lo:hi].cpu() for t in (self.input_ids, self.attention_mask, self.mask, self.logp_rollout)))

    def to(self, device) -> Batch:
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    @property
    def prompt_width(self) -> int:
        return self.input_ids.shape[1] - self.mask.shape[1]


def build_batch(prompt_ids: list[list[int]], gens, pad_id: int) -> Batch:
    """Prompts as [shared prefix | padding | rest] (prefix.pad_after_prefix: left padding when the prompts
    share nothing), then the responses, right-padded."""
    prompts, prompt_mask, _ = pad_after_prefix(prompt_ids, pad_id)
    t_w = max(max(len(g.token_ids) for g in gens), 1)
    b, p_w = len(gens), prompts.shape[1]
    ids = torch.cat([prompts, torch.full((b, t_w), pad_id, dtype=torch.long)], 1)
    attn = torch.cat([prompt_mask, torch.zeros(b, t_w, dtype=torch.long)], 1)
    mask, lp = torch.zeros(b, t_w), torch.zeros(b, t_w)
    for i, g in enumerate(gens):
        if n := len(g.token_ids):
            ids[i, p_w : p_w + n], attn[i, p_w : p_w + n] = torch.tensor(g.token_ids), 1
            # an episode's environment tokens are context, never trained on (mask 0: rlhf/envs/episodes.py)
            mask[i, :n] = 1 if g.mask is None else torch.tensor(g.mask, dtype=mask.dtype)
            lp[i, :n] = torch.tensor(g.logprobs)
    return Batch(ids, attn, mask, lp)


def forward(model, batch: Batch, rows, temperature: float, values: bool = False):
    """Token log-probs (or critic values) of the response positions for the selected rows: [b, T]. The
    policy's passes run the rows' shared prompt prefix once (rlhf/engines/prefix.py)."""
    ids, attn = batch.input_ids[rows], batch.attention_mask[rows]
    pos = positions(attn)  # padding before the prompt's rest: positions count real tokens only
    p_w, t_w = batch.prompt_width, batch.mask.shape[1]
    if values:
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False)
        return out.logits[:, p_w - 1 : p_w - 1 + t_w, 0].float()
    # Only the last t_w + 1 positions predict response tokens: the prompt rows skip the vocabulary projection.
    out, _ = shared_prefix_forward(model, ids, attn, pos, keep_from=p_w - 1, use_cache=False,
                                   **last_logits_only(model, t_w + 1))
    logits = out.logits[:, -(t_w + 1) : -1].float() / max(temperature, 1e-6)
    targets = ids[:, p_w:]
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1), logits


@torch.no_grad()
def score_all(model, batch: Batch, temperature: float, size: int, values: bool = False) -> torch.Tensor:
    """Log-probs (or values) of every row, [B, T]. With several ranks each scores a contiguous share of
    the rows and the shares are gathered, so every rank holds the whole batch's numbers."""
    lo, hi = row_share(len(batch.mask))
    return gathered(score_rows(model, batch, lo, hi, temperature, size, values), batch)


@torch.no_grad()
def score_rows(model, batch: Batch, lo: int, hi: int, temperature: float, size: int, values: bool = False) -> torch.Tensor:
    """Log-probs (or values) of rows [lo, hi), in forward passes of `size` rows: [hi - lo, T]."""
    model.eval()
    chunks = [forward(model, batch, slice(i, min(i + size, hi)), temperature, values) for i in range(lo, hi, size)]
    return torch.cat([c if values else c[0] for c in chunks]) if chunks else batch.mask[:0].clone()


def row_share(rows: int) -> tuple[int, int]:
    """This rank's contiguous share [lo, hi) of a batch's rows."""
    per = -(-rows // dist.world_size())
    return min(dist.rank() * per, rows), min((dist.rank() + 1) * per, rows)


def gathered(mine: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Every rank's share of the rows, in rank order, masked: the whole batch's numbers on every rank."""
    if dist.world_size() == 1:  # no device -> CPU -> device round trip for a gather of one
        return mine * batch.mask
    return torch.cat([part.to(batch.mask.device) for part in dist.all_gather(mine.cpu())]) * batch.mask


# ---- algorithm table ------------------------------------------------------------------------------
def ppo_advantages(cfg, batch: Batch, scores: torch.Tensor, beta: float) -> None:
    kl = rl_math.kl_k1(batch.logp_old, batch.logp_ref) if batch.logp_ref is not None else torch.zeros_like(batch.mask)
    rewards = rl_math.kl_penalized_rewards(scores, kl, batch.mask, beta)
    adv, batch.returns = rl_math.gae(rewards, batch.values, batch.mask, cfg.gamma, cfg.lam)
    batch.advantages = rl_math.whiten(adv, batch.mask)


def grpo_advantages(cfg, batch: Batch, scores: torch.Tensor, beta: float) -> None:
    seq = rl_math.group_advantages(scores, cfg.group_size, scale=cfg.scale_rewards)
    batch.advantages = seq[:, None] * batch.mask


def grpo_extra_loss(cfg, batch: Batch, rows, logp, mask, beta):
    if batch.logp_ref is None or cfg.beta == 0:
        return None, {}
    k3 = rl_math.kl_k3(logp, batch.logp_ref[rows], mask)
    return cfg.beta * k3, {"k3": rl_math.masked_mean(k3, mask)}


def ppo_next_beta(cfg, beta: float, kl: float, n_steps: int) -> float:
    if cfg.kl.mode != "adaptive":
        return beta
    return rl_math.adaptive_kl_beta(beta, kl, cfg.kl.target, cfg.kl.horizon, n_steps)  # Ziegler et al. 2019


@dataclass(frozen=True)
class Algorithm:
    """What differs between the RL algorithms; the loop reads these fields and never tests a name."""

    name: str
    advantages: Callable  # (cfg, batch, scores, beta) -> None: sets batch.advantages (and returns)
    extra_loss: Callable  # (cfg, batch, rows, logp, mask, beta) -> (per-token loss term or None, its metrics)
    critic: bool  # a value model is trained beside the policy
    initial_beta: Callable  # (cfg) -> float: the KL coefficient at iteration 1
    next_beta: Callable  # (cfg, beta, kl, n_steps) -> float: after each iteration (adaptive KL)
    entropy_coef: Callable  # (cfg) -> float: weight of the entropy bonus in the loss
    loss_type: Callable  # (cfg) -> str: how per-token losses add up (rl_math.aggregate_loss)


ALGORITHMS = {a.name: a for a in (
    Algorithm("ppo", ppo_advantages, lambda *a: (None, {}), critic=True,
              initial_beta=lambda cfg: cfg.kl.beta, next_beta=ppo_next_beta, entropy_coef=lambda cfg: cfg.entropy_coef,
              loss_type=lambda cfg: "dapo"),
    Algorithm("grpo", grpo_advantages, grpo_extra_loss, critic=False,
              initial_beta=lambda cfg: cfg.beta, next_beta=lambda cfg, beta, kl, n: beta, entropy_coef=lambda cfg: 0.0,
              loss_type=lambda cfg: cfg.loss_type),
)}


@dataclass
class Step:
    """What an update needs besides the batch: the algorithm, its config, the models and their optimizers."""

    algo: Algorithm
    cfg: object
    it: int
    models: dict  # "policy" (and "critic")
    optimizers: dict
    beta: float
    temperature: float
    amp: Callable  # the mixed-precision context for forward passes
    max_new_tokens: int  # the sampler's budget: dr_grpo's constant normaliser


# ---- rewards ----------------------------------------------------------------------------------------
def stage_reward_model(ctx: StageContext):
    model, tokenizer = load_reward_model(fetch_model(ctx, ctx.inputs.reward_model), ctx.cfg.model.dtype)
    return model.to(ctx_device()), tokenizer


def make_reward(cfg, task: PromptSource, scorers):
    """Returns reward(problems, gens) -> ([B] weighted reward, {term: [B] values}) for the configured terms
    (cfg.reward_specs()); the reward model scores through `scorers` (in this process, or in their own Ray actor)."""
    terms = reward_terms(cfg.reward_specs(), task, scorers.rm_scores if cfg.uses_reward_model() else None)

    def reward(problems, gens) -> tuple[torch.Tensor, dict[str, list[float]]]:
        total, parts = weighted_rewards(terms, problems, [g.text for g in gens], [g.token_ids for g in gens])
        return torch.tensor(total), parts

    return reward


def load_policy(cfg, init: str, resume: Path | None, model_cfg, seed: int):
    """The trained policy: full weights, or (lora.enabled) the init model with LoRA adapters (Hu et al.
    2021), drawn from `seed` (run.seed); a resume loads the checkpoint's weights or adapters."""
    if not cfg.lora.enabled:
        return load_causal_lm(str(resume / "policy") if resume else init, model_cfg, trained=True)
    from peft import PeftModel, get_peft_model

    base = load_causal_lm(init, model_cfg)  # frozen: stays in the compute dtype under mixed precision
    if resume:
        return PeftModel.from_pretrained(base, str(resume / "policy"), is_trainable=True)
    torch.manual_seed(seed)
    return get_peft_model(base, peft_config(cfg))


def reference_logps(policy, scorers, batch: Batch, temperature: float, size: int) -> torch.Tensor:
    """The reference's log-probs of every row: each rank scores its share through the scorers (in this
    process, or in their actor) and the shares are gathered; with LoRA (no scorers) the policy with its
    adapters off."""
    if scorers is not None:
        lo, hi = row_share(len(batch.mask))
        return gathered(scorers.ref_logps(batch.rows(lo, hi), temperature, size).to(batch.mask.device), batch)
    with policy.disable_adapter():  # LoRA: the frozen base weights are the reference
        return score_all(policy, batch, temperature, size)


# ---- checkpoints ------------------------------------------------------------------------------------
def save_checkpoint(ctx, it: int, policy, critic, tok, optimizers, state: dict) -> None:
    local = ctx.workdir / "ckpt"
    shutil.rmtree(local, ignore_errors=True)
    policy.save_pretrained(local / "policy", safe_serialization=True)
    tok.save_pretrained(local / "policy")
    if critic is not None:
        critic.save_pretrained(local / "critic", safe_serialization=True)
    torch.save({k: o.state_dict() for k, o in optimizers.items()}, local / "optimizer.pt")
    (local / "state.json").write_text(json.dumps({**state, "iteration": it}))
    store_checkpoint(ctx, local, f"iter-{it:06d}")
    ctx.log.info("%s: checkpoint after iteration %d", ctx.stage, it)


def make_optimizer(cfg, params):
    if cfg.optim == "adamw_bnb_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=cfg.learning_rate)
    return torch.optim.AdamW(params, lr=cfg.learning_rate, fused=cfg.optim == "adamw_torch_fused")


def guard(algo: str, it: int, name: str, value: float, limit: float | None = None) -> None:
    if not math.isfinite(value):
        raise RLGuardError(f"{algo} iteration {it}: {name} is {value}; stopping, the last complete checkpoint is kept")
    if limit is not None and value > limit:
        raise RLGuardError(f"{algo} iteration {it}: {name} = {value:.3f} exceeds max_kl {limit}; stopping, "
                           "the last complete checkpoint is kept")


# ---- the loop ---------------------------------------------------------------------------------------
def run_rl(algo: str, cfg, ctx: StageContext) -> StageResult:
    spec, pcfg, roll = ALGORITHMS[algo], ctx.cfg, ctx.cfg.rollout
    init = start_model(ctx)
    found = latest_checkpoint(ctx)
    resume = found[1] if found else None
    tok = load_tokenizer(init)
    device = ctx_device()
    policy = load_policy(cfg, init, resume, pcfg.model, pcfg.run.seed).to(device)
    use_ref = cfg.uses_reference()
    # The frozen models (reference, reward model) in this process, or in their own Ray actor. With LoRA
    # the reference is the policy with its adapters off (`reference_logps`): no second model.
    scorers = remote.RemoteScorers(h) if (h := dist.scorer_actor()) is not None else LocalScorers(cfg, ctx, init)
    ref = scorers if "reference" in cfg.frozen_models() else None
    critic = None
    if spec.critic:
        from transformers import AutoModelForTokenClassification

        base = fetch_model(ctx, ctx.inputs.reward_model) if cfg.critic_init == "reward_model" else init
        torch.manual_seed(pcfg.run.seed)  # the value head is randomly initialised: the same seed, the same head
        critic = AutoModelForTokenClassification.from_pretrained(str(resume / "critic") if resume else base, num_labels=1,
                                                                 dtype=torch_dtype(weights_dtype(pcfg.model, True))).to(device)
        critic.config.pad_token_id = tok.pad_token_id
    for model in (policy, critic):
        if model is not None:
            # No dropout (TRL's PPO does the same): the ratio pi/pi_old and the value loss must compare one
            # function, not two random masks; it also keeps a sharded run equal to a one-process run.
            disable_dropout_in_model(model)
            dist.broadcast_parameters(model)  # identical replicas on every rank, as DDP would make them
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        if cfg.lora.enabled:  # frozen embeddings: checkpointed blocks need inputs that require grad
            policy.enable_input_require_grads()
    models = {"policy": policy, **({"critic": critic} if critic is not None else {})}
    optimizers = {"policy": make_optimizer(cfg, [p for p in policy.parameters() if p.requires_grad])}
    if critic is not None:
        optimizers["critic"] = make_optimizer(cfg, critic.parameters())
    state = {"iteration": 0, "beta": spec.initial_beta(cfg)}
    if resume:
        for k, sd in torch.load(resume / "optimizer.pt", weights_only=True).items():
            optimizers[k].load_state_dict(sd)
        state = json.loads((resume / "state.json").read_text())
        ctx.log.info("%s: resuming after iteration %d", algo, state["iteration"])
    first = state["iteration"] + 1

    task = make_task(pcfg.data)
    reward = make_reward(cfg, task, scorers)
    env = cfg.environment  # multi-turn episodes (PPO and GRPO alike: GAE skips the masked tokens)
    amp = lambda: autocast(pcfg.model, device.type)  # noqa: E731

    def build_engine(model, tokenizer):
        engine = make_engine(ctx, model, tokenizer, init, resume is not None, task)
        return EpisodeEngine(engine, env, roll.batch_size) if env is not None else engine

    def draw(engine, it: int) -> tuple:
        """Iteration `it`'s experience, sampled by `engine` (in the loop, or on the sampling thread): its
        prompts, samples and scores (with skip_uniform_groups, the informative groups after any refill) and
        what the metrics say of everything sampled (the first draw's mean reward and terms, the count)."""
        rng = random.Random(pcfg.run.seed * 7919 + it)  # prompts of iteration `it`, whatever happened before
        problems = rng.sample(task.rl, cfg.prompts_per_iteration)
        params = SamplingParams(roll.temperature, roll.top_p, roll.max_new_tokens, cfg.samples_per_prompt(),
                                pcfg.run.seed * 7919 + it)
        gens, scores = generate_and_score(engine, problems, params, reward)
        sampled = {"n": len(gens), "reward": scores.mean().item(),
                   "terms": {f"reward/{k}": sum(g.rewards[k] for g in gens) / len(gens) for k in gens[0].rewards}}
        if env is not None:
            sampled["terms"].update(episode_stats(gens))
        if getattr(cfg, "skip_uniform_groups", False):
            gens, scores = informative(gens, scores, cfg.group_size)
            problems, gens, scores, drawn = refill(cfg, engine, reward, rng, task, problems, gens, scores, params)
            sampled["n"] += drawn  # trained_fraction counts every sample drawn; reward_mean stays the first draw's
        return problems, gens, scores, sampled

    engine, prefetch = None, None
    if roll.async_ is None:
        engine = build_engine(policy, tok)
    else:  # sampling on its own thread, with its own copy of the policy (and of the tokenizer it mutates)
        prefetch = Prefetcher(policy, lambda model: build_engine(model, copy.deepcopy(tok)), draw, first,
                              cfg.iterations, roll.async_.max_lag, amp, roll.async_.threads)
    try:  # the sampling thread stops with the loop, however it ends
        t_start = time.perf_counter()
        for it in range(first, cfg.iterations + 1):
            t0 = time.perf_counter()
            if prefetch is None:
                with amp():
                    d = Draw(*draw(engine, it), version=it - 1)
            else:
                d = prefetch.take(it)
            wait = time.perf_counter() - t0  # asynchronous: how long the trainer waited for its samples
            problems, gens, scores = d.problems, d.gens, d.scores.to(device)
            n_sampled, reward_sampled, term_means = d.sampled["n"], d.sampled["reward"], d.sampled["terms"]
            if not gens:  # skip_uniform_groups, every group uniform: nothing to learn from this iteration's samples
                ctx.log.info("%s iteration %d: every group's rewards are equal (mean %.3f); no update",
                             algo, it, reward_sampled)
                if dist.is_main():
                    write_metrics_row(ctx, it, algo, {"reward_mean": reward_sampled, **term_means, "trained_fraction": 0.0,
                                                      "kl_beta": state["beta"], "rollout_lag": it - 1 - d.version,
                                                      "seconds": time.perf_counter() - t0})
                end_iteration(algo, cfg, ctx, it, policy, critic, tok, optimizers, state, prefetch)
                continue
            probs = [problems[g.prompt_index] for g in gens]
            prompt_ids = [chat_ids(tok, p.messages()) for p in probs]
            batch = build_batch(prompt_ids, gens, tok.pad_token_id).to(device)
            with amp():
                # the sampler's log-probs already are the pre-update policy's (config says when that holds)
                batch.logp_old = (batch.logp_rollout * batch.mask if cfg.logp_old == "rollout"
                                  else score_all(policy, batch, roll.temperature, cfg.minibatch_size))
                if use_ref:
                    batch.logp_ref = reference_logps(policy, ref, batch, roll.temperature, cfg.minibatch_size)
                if critic is not None:
                    batch.values = score_all(critic, batch, roll.temperature, cfg.minibatch_size, values=True)
            spec.advantages(cfg, batch, scores, state["beta"])
            if cfg.sampler_correction != "none":
                batch.weights = rl_math.sampler_correction(batch.logp_old, batch.logp_rollout, batch.mask,
                                                           cfg.sampler_correction, cfg.sampler_correction_cap)
            kl_seq = ((rl_math.kl_k1(batch.logp_old, batch.logp_ref) * batch.mask).sum(1).mean().item()
                      if batch.logp_ref is not None else 0.0)
            guard(algo, it, "mean KL", kl_seq, cfg.max_kl)

            stats = update(Step(spec, cfg, it, models, optimizers, state["beta"], roll.temperature, amp,
                                roll.max_new_tokens), batch)
            if cfg.logp_old == "recompute":  # with the sampler's own log-probs there is no second opinion
                stats.update(logp_mismatch(batch))
            if batch.weights is not None:
                stats["sampler_weight_mean"] = rl_math.masked_mean(batch.weights, batch.mask).item()
            if prefetch is not None:
                if d.sync_diff is not None:
                    stats["sync_max_abs_diff"] = d.sync_diff
                stats["sample_wait_s"] = wait
            elif (diff := engine.sync(policy)) is not None:  # an engine with its own copy of the weights
                stats["sync_max_abs_diff"] = diff
            state["beta"] = spec.next_beta(cfg, state["beta"], kl_seq, len(gens))
            tokens = int(batch.mask.sum())
            seconds = time.perf_counter() - t0
            metrics = {"reward_mean": reward_sampled, **term_means, "reward_trained_mean": scores.mean().item(),
                       "trained_fraction": len(gens) / n_sampled,
                       "reward_std": scores.std().item() if len(scores) > 1 else 0.0,
                       "kl": kl_seq, "kl_beta": state["beta"], "response_length": tokens / len(gens),
                       "tokens_per_s": tokens / seconds, "seconds": seconds, "rollout_lag": it - 1 - d.version, **stats}
            if dist.is_main():
                write_iteration(ctx, it, algo, gens, probs, batch, scores, metrics, d.version)
            eta = (time.perf_counter() - t_start) / (it - first + 1) * (cfg.iterations - it)
            ctx.log.info("%s iteration %d/%d reward %.3f KL %.4f clip %.3f %.1fs/it ETA %.0fs", algo, it, cfg.iterations,
                         metrics["reward_mean"], kl_seq, stats.get("clip_fraction", 0.0), seconds, eta)
            end_iteration(algo, cfg, ctx, it, policy, critic, tok, optimizers, state, prefetch)

        if engine is not None:
            engine.close()
            engine = None
        return finish(algo, cfg, ctx, policy, tok, task, first, env)
    finally:
        if engine is not None:  # a failed iteration: the environment's process goes with the stage, not at exit
            engine.close()
        if prefetch is not None:
            stopped = sys.exc_info()[0]  # SystemExit, KeyboardInterrupt: a stop signal
            prefetch.close(wait=stopped is None or issubclass(stopped, Exception))


def informative(gens: list, scores: torch.Tensor, group_size: int) -> tuple[list, torch.Tensor]:
    """The samples and scores of the groups whose rewards are not all equal (rl_math.informative_groups)."""
    keep = rl_math.informative_groups(scores, group_size)
    return [g for g, k in zip(gens, keep.tolist()) if k], scores[keep]


def refill(cfg, engine, reward, rng, task, problems, gens, scores, params):
    """DAPO's dynamic sampling with refill (Yu et al. 2025, sec. 3.2): while fewer than
    prompts_per_iteration groups are informative and refill rounds remain, sample the missing number of
    groups on prompts this iteration has not drawn and keep their informative ones. Returns the grown
    problem list (generations index into it), generations, scores and how many samples were drawn."""
    drawn = 0
    for r in range(1, cfg.refill_rounds + 1):
        missing = cfg.prompts_per_iteration - len(gens) // cfg.group_size
        used = {p.id for p in problems}
        unused = [p for p in task.rl if p.id not in used]
        if missing <= 0 or not unused:
            break
        extra = rng.sample(unused, min(missing, len(unused)))
        more, more_scores = generate_and_score(engine, extra, dataclasses.replace(params, seed=params.seed + 1_000_003 * r), reward)
        drawn += len(more)
        more, more_scores = informative(more, more_scores, cfg.group_size)
        gens = gens + [dataclasses.replace(g, prompt_index=g.prompt_index + len(problems)) for g in more]
        scores = torch.cat([scores, more_scores])
        problems = problems + extra
    return problems, gens, scores, drawn


def end_iteration(algo, cfg, ctx, it, policy, critic, tok, optimizers, state, prefetch=None) -> None:
    """What every iteration ends with, trained or skipped: the policy's new version to the sampling thread
    (first: it samples while the checkpoint is written), progress, the periodic checkpoint, the test hook."""
    if prefetch is not None:
        prefetch.publish(it, policy)
    progress.report(ctx.stage, it, cfg.iterations)
    if (it % cfg.save_every == 0 or it == cfg.iterations) and dist.is_main():
        save_checkpoint(ctx, it, policy, critic, tok, optimizers, state)
    if os.environ.get(CRASH_ENV) == f"{algo}:{it}":  # test hook, as in the Trainer stages
        raise InjectedCrash(f"{algo}: injected crash after iteration {it} ({CRASH_ENV})")


def logp_mismatch(batch: Batch) -> dict[str, float]:
    """|sampler log-prob - trainer log-prob| over response tokens, before the update: 0 up to numerics
    when both compute the same distribution (top_p < 1 renormalises the sampler's, so it is not 0 then).
    A jump flags stale engine weights or a kernel mismatch, which bias the importance ratio."""
    diff = (batch.logp_rollout - batch.logp_old).abs() * batch.mask
    return {"logp_mismatch_mean": (diff.sum() / batch.mask.sum().clamp(min=1)).item(), "logp_mismatch_max": diff.max().item()}


class SyncedVLLM:
    """The vLLM engine of the RL loop: the policy's weights reach it through a local safetensors folder
    after every update, and every sync is checked on a fixed probe (rlhf/engines/vllm_engine.py)."""

    def __init__(self, ctx, policy, tok, init: str, stale: bool, problem):
        from rlhf.engines.vllm_engine import make_vllm

        self.ctx, self.roll = ctx, ctx.cfg.rollout
        self.folder = ctx.workdir / "engine-weights"
        # probe: a fixed prompt and its gold answer
        self.probe = chat_ids(tok, problem.messages() + [assistant(problem.answer or "OK")], generation_prompt=False)
        self.engine = make_vllm(self.roll, init, tok, ctx.cfg.model.dtype, ctx.cfg.run.seed)
        if stale:  # resumed: the engine started from `init`, the policy from a checkpoint
            self.sync(policy)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, params, shard=(0, 1), on_batch=None):
        return self.engine.generate(prompts, params, shard, on_batch)

    def continue_ids(self, seqs, params, stop, seed):  # episodes (ppo/grpo.environment)
        return self.engine.continue_ids(seqs, params, stop, seed)

    @torch.no_grad()
    def sync(self, policy) -> float:
        policy.eval()
        policy.save_pretrained(self.folder, safe_serialization=True)
        device = next(policy.parameters()).device
        with autocast(self.ctx.cfg.model, device.type):  # the trainer's own numerics, mixed precision included
            expected = sequence_logps(policy, self.probe)
        return self.engine.sync(str(self.folder), self.probe, expected, self.roll.vllm.sync_tolerance)

    def close(self) -> None:
        self.engine.close()


def make_engine(ctx, policy, tok, init: str, resumed: bool, task: PromptSource, local: bool = False) -> Engine:
    """The configured engine over `policy`; with `launch.ray.engine: own` (not `local`) the engine actor the
    Ray launcher started for this stage."""
    if not local and (handle := dist.engine_actor()) is not None:
        return remote.RemoteEngine(handle, policy, tok)
    if ctx.cfg.rollout.engine == "vllm":
        return SyncedVLLM(ctx, policy, tok, init, resumed, task.train[0])
    return HFEngine(policy, tok, ctx.cfg.rollout.batch_size)


def engine_host(cfg, ctx: StageContext):
    """What the engine actor of `launch.ray.engine: own` runs (rlhf/pipeline/ray_launch.py): a copy of the
    policy as the RL loop builds it and the configured engine over it. Returns (engine, policy copy, the
    mixed-precision context); the trainer's weights arrive by sync before the first sample."""
    init = start_model(ctx)
    tok = load_tokenizer(init)
    policy = load_policy(cfg, init, None, ctx.cfg.model, ctx.cfg.run.seed).to(ctx_device()).eval().requires_grad_(False)
    task = make_task(ctx.cfg.data)
    return (make_engine(ctx, policy, tok, init, False, task, local=True), policy,
            lambda: autocast(ctx.cfg.model, ctx_device().type))


class LocalScorers:
    """The RL loop's frozen models, `cfg.frozen_models()`: the reference policy (the loop's init model) and
    the reward model, scoring under the trainer's mixed-precision context. Each rank holds one, or the
    scorers' actor of `launch.ray.scorers: own` does (rlhf/pipeline/ray_launch.py) and the ranks reach it
    through remote.RemoteScorers, which has the same two methods."""

    def __init__(self, cfg, ctx: StageContext, init: str | None = None):
        frozen = cfg.frozen_models()
        if init is None and "reference" in frozen:
            init = start_model(ctx)
        self.device = ctx_device()
        self.ref = (load_causal_lm(init, ctx.cfg.model).to(self.device).eval().requires_grad_(False)
                    if "reference" in frozen else None)
        self.rm = stage_reward_model(ctx) if "reward_model" in frozen else None
        self.amp = lambda: autocast(ctx.cfg.model, self.device.type)

    def ref_logps(self, batch: Batch, temperature: float, size: int) -> torch.Tensor:
        """Every row of `batch` (a rank's share), on the CPU."""
        with self.amp():
            return score_rows(self.ref, batch.to(self.device), 0, len(batch.mask), temperature, size).cpu()

    def rm_scores(self, conversations: list) -> list[float]:
        with self.amp():
            return reward_model_scores(*self.rm, conversations)


def ctx_device() -> torch.device:
    """This rank's GPU when there is one (torchrun's LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def generate_and_score(engine, problems, params: SamplingParams, reward) -> tuple[list, torch.Tensor]:
    """Samples and rewards of the iteration, ordered by (prompt, sample). Each rank generates and scores
    its share of the engine's batches (the engine seeds each batch by its global index, so the union
    is the one-process output) and the shares are gathered: advantages always see whole groups."""
    episodic = isinstance(engine, EpisodeEngine)
    shard = (dist.rank(), dist.world_size())
    mine = (engine.episodes(problems, params, shard) if episodic
            else engine.generate([p.messages() for p in problems], params, shard=shard))
    mine_scores = []
    if mine:
        total, parts = reward([problems[g.prompt_index] for g in mine], mine)
        if episodic:  # the environment's own rewards join the configured terms
            parts = {**parts, "env": [g.rewards.get("env", 0.0) for g in mine]}
            total = total + torch.tensor(parts["env"], dtype=total.dtype)
        mine_scores = total.tolist()  # each sample carries its reward's terms (metrics, the experience table)
        mine = [dataclasses.replace(g, rewards={k: v[i] for k, v in parts.items()}) for i, g in enumerate(mine)]
    pairs = sorted((pair for part in dist.all_gather(list(zip(mine, mine_scores))) for pair in part),
                   key=lambda pair: (pair[0].prompt_index, pair[0].sample_index))
    return [g for g, _ in pairs], torch.tensor([score for _, score in pairs])


def update(step: Step, batch: Batch) -> dict:
    """K epochs over shuffled minibatches, one optimizer step each; per-token losses add up within a
    minibatch as the algorithm's loss_type says (rl_math.aggregate_loss). With gradient_accumulation_steps
    > 1 a minibatch runs as that many micro-batches whose losses are weighted by their share of its tokens
    (or sequences, rl_math.loss_weight): the same gradient as the whole minibatch at once.
    With several ranks the minibatch splits into accumulation steps x ranks micro-batches, rank r takes
    every r-th, and the gradients (and the share-weighted metrics) are summed across ranks."""
    cfg, models, optimizers = step.cfg, step.models, step.optimizers
    loss_type = step.algo.loss_type(cfg)
    sums: dict[str, float] = {}
    steps = 0
    g = torch.Generator().manual_seed(step.it)
    for model in models.values():
        model.train()
    for _ in range(cfg.epochs):
        order = torch.randperm(len(batch.mask), generator=g)
        for start in range(0, len(order), cfg.minibatch_size):
            rows = order[start : start + cfg.minibatch_size]
            total = rl_math.loss_weight(batch.mask[rows], loss_type).clamp(min=1)
            for opt in optimizers.values():
                opt.zero_grad()
            out: dict[str, float] = {}
            world = dist.world_size()
            for micro in rows.chunk(cfg.gradient_accumulation_steps * world)[dist.rank() :: world]:
                share = (rl_math.loss_weight(batch.mask[micro], loss_type) / total).item()
                for k, v in micro_step(step, batch, micro, share).items():
                    out[k] = out.get(k, 0.0) + share * v
            if world > 1:
                out = {k: sum(part[k] for part in dist.all_gather(out)) for k in out}
            for name, model in models.items():
                dist.sum_gradients([p for p in model.parameters() if p.requires_grad])
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizers[name].step()
            for k, v in out.items():
                sums[k] = sums.get(k, 0.0) + v
            steps += 1
    return {k: v / steps for k, v in sums.items()}


def micro_step(step: Step, batch: Batch, rows, share: float) -> dict:
    """Forward and backward of one micro-batch, its losses scaled by `share`; returns its unscaled metrics.
    `amp()` is the mixed-precision context: forward passes only, backward outside it (PyTorch's advice)."""
    cfg, models, name, it = step.cfg, step.models, step.algo.name, step.it
    mask = batch.mask[rows]
    with step.amp():
        logp, logits = forward(models["policy"], batch, rows, step.temperature)
    per_token, m = rl_math.clipped_surrogate(logp, batch.logp_old[rows], batch.advantages[rows], mask,
                                             cfg.clip_eps, getattr(cfg, "clip_eps_high", None), cfg.dual_clip)
    if batch.weights is not None:  # as TRL: the policy-gradient term only, before the KL term joins
        per_token = per_token * batch.weights[rows]
    extra, extra_m = step.algo.extra_loss(cfg, batch, rows, logp, mask, step.beta)
    if extra is not None:  # as TRL: the KL term joins the per-token loss before it is aggregated
        per_token = per_token + extra
    entropy = rl_math.masked_mean(rl_math.entropy_from_logits(logits.detach()), mask)
    if (coef := step.algo.entropy_coef(cfg)) > 0:
        per_token = per_token - coef * rl_math.entropy_from_logits(logits)
    loss = rl_math.aggregate_loss(per_token, mask, step.algo.loss_type(cfg), step.max_new_tokens)
    guard(name, it, "policy loss", loss.item())
    guard(name, it, "ratio", m["ratio_mean"].item())
    (share * loss).backward()
    out = {"policy_loss": loss.item(), "entropy": entropy.item(), **{k: v.item() for k, v in {**m, **extra_m}.items()}}
    if "critic" in models:
        with step.amp():
            v = forward(models["critic"], batch, rows, step.temperature, values=True)
        vl = rl_math.masked_mean(rl_math.clipped_value_loss(v, batch.values[rows], batch.returns[rows], cfg.value_clip), mask)
        guard(name, it, "value loss", vl.item())
        (share * cfg.vf_coef * vl).backward()
        out["value_loss"] = vl.item()
    return out


def write_iteration(ctx, it, algo, gens, probs, batch: Batch, scores, metrics, version: int) -> None:
    def tok_list(t, i):
        return None if t is None else t[i, : len(gens[i].token_ids)].tolist()

    rows = [{
        "iteration": it, "prompt_id": probs[i].id, "sample_index": g.sample_index, "prompt": probs[i].question,
        "response": g.text, "response_ids": g.token_ids, "logp_rollout": g.logprobs, "logp_old": tok_list(batch.logp_old, i),
        "logp_ref": tok_list(batch.logp_ref, i), "reward": float(scores[i]), "rewards": list(g.rewards.items()),
        "advantage": float(batch.advantages[i].sum() / max(len(g.token_ids), 1)), "finish_reason": g.finish_reason,
        "policy_mask": g.mask, "env_error": g.error, "policy_version": version,
    } for i, g in enumerate(gens)]
    ctx.write_output("experience", rows, f"experience/iter-{it:06d}.parquet")  # one file of the declared folder
    write_metrics_row(ctx, it, algo, metrics)


def write_metrics_row(ctx, it: int, algo: str, metrics: dict) -> None:
    tracking.current().log(it, {f"{algo}/{k}": v for k, v in metrics.items()})
    m = [{"stage": algo, "step": it, "epoch": None, "name": k, "value": float(v)} for k, v in metrics.items()]
    ctx.store.write_table(ctx.path("iterations", f"iter-{it:06d}.parquet"), pa.Table.from_pylist(m, schema=METRICS_SCHEMA), METRICS_SCHEMA)


def finish(algo, cfg, ctx, policy, tok, task, first, env=None) -> StageResult:
    if not dist.is_main():  # rank 0 evaluates and publishes; the launcher uses its result only
        return StageResult(outputs={})
    tables = [ctx.store.read_table(p, METRICS_SCHEMA) for p in ctx.store.glob(ctx.path("iterations", "*.parquet"))]
    table = pa.concat_tables(tables)
    last = {r["name"]: r["value"] for r in table.to_pylist() if r["step"] == cfg.iterations}
    first_it = {r["name"]: r["value"] for r in table.to_pylist() if r["step"] == 1}
    metrics = {f"{algo}/{k}": v for k, v in last.items()}
    metrics[f"{algo}/reward_mean_first"] = first_it.get("reward_mean", float("nan"))
    held_out = [] if task.open_ended else task.eval[: cfg.eval_prompts]  # open-ended: nothing to verify
    if held_out:
        metrics[f"{algo}/accuracy"] = verifier_accuracy(policy, tok, task, held_out, cfg.eval_max_new_tokens)
        ctx.log.info("%s: policy held-out accuracy %.3f", algo, metrics[f"{algo}/accuracy"])
    if held_out and env is not None:  # with its environment: greedy episodes, the verifier on each transcript
        gens = play(HFEngine(policy, tok), held_out, SamplingParams(0.0, 1.0, cfg.eval_max_new_tokens), env)
        metrics[f"{algo}/episode_success"] = sum(task.score(g.text, held_out[g.prompt_index]) >= 1.0
                                                 for g in gens) / len(gens)
        metrics.update({f"{algo}/held_out_{k}": v for k, v in episode_stats(gens).items()})
        ctx.log.info("%s: held-out episode success %.3f", algo, metrics[f"{algo}/episode_success"])
    outputs = {"model": publish_model(ctx, policy, tok), "metrics": write_metrics(ctx, table), "experience": "experience/"}
    return StageResult(outputs=outputs, rows={"iterations": cfg.iterations, "rollouts": cfg.iterations * cfg.rollouts_per_iteration()},
                       metrics=metrics, resumed_from_step=first - 1 if first > 1 else None)
