"""RL maths for PPO and GRPO as small pure functions: tensors in, tensors (+ metrics) out.

Shapes: B sequences, T response tokens (right-padded); `mask` [B, T] is 1 on real response tokens.
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x over the positions where mask (0/1) is set. Selects rather than multiplies: a NaN or inf
    at a masked-out position (padding) would otherwise leak into the mean, since NaN * 0 is NaN."""
    keep = mask.bool()
    return torch.where(keep, x, torch.zeros_like(x)).sum(dim) / keep.sum(dim).clamp(min=1)


# ---- KL estimators (Schulman 2020, "Approximating KL divergence"), per token ------------------------
def kl_k1(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """log pi - log pi_ref: unbiased for KL(pi || ref) on samples from pi, can be negative."""
    return logp - logp_ref


def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """exp(log ref - log pi) - (log ref - log pi) - 1: unbiased, >= 0, 0 iff the log-probs match
    (DeepSeekMath eq. 4 uses it as GRPO's penalty).

    Computed as expm1(d) - d: exp(d) - 1 - d cancels to nothing in float32 for |d| < 1e-4 (k3 ~ d^2 / 2).
    `mask` zeroes d on padding *before* the exponential: a padded position's log-prob can be below -88,
    where exp overflows to inf, and inf * 0 in a later masked mean (or its gradient) is NaN.
    """
    d = logp_ref - logp
    if mask is not None:
        d = d.masked_fill(~mask.bool(), 0.0)
    return torch.expm1(d) - d


def kl_penalized_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Token rewards r_t = -beta * KL_t, plus the sequence score on the last response token
    (Ziegler et al. 2019 eq. 2; Ouyang et al. 2022). scores: [B]; kl, mask: [B, T] -> [B, T]."""
    rewards = -beta * kl * mask
    last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & mask.bool()  # one True per non-empty row
    return rewards + last * scores[:, None]


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), terminal bootstrap 0.

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1};  returns = A + V.
    Hand-worked: r [1, 0, 0, 10], V [2, 2, 2, 0], gamma 1, lam 0.95:
      A_3 = 10;  A_2 = (0 + 0 - 2) + .95 * 10 = 7.5;  A_1 = (0 + 2 - 2) + .95 * 7.5 = 7.125;
      A_0 = (1 + 2 - 2) + .95 * 7.125 = 7.76875
    Padding positions (mask 0) get 0 and do not propagate.
    """
    b, t = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(b, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    for i in reversed(range(t)):
        m = mask[:, i]
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        a = delta + gamma * lam * next_adv
        adv[:, i] = a * m
        next_value = torch.where(m.bool(), values[:, i], next_value)
        next_adv = torch.where(m.bool(), a, next_adv)
    return adv, (adv + values) * mask


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4, scale: str = "group") -> torch.Tensor:
    """GRPO outcome advantages (Shao et al. 2024, sec. 4.1.2): r - mean_g within each group of G samples
    of one prompt, divided by
      group: the group's std (the paper's (r - mean_g) / (std_g + eps));
      batch: the std of all N rewards (TRL's scale_rewards="batch", from arXiv 2508.08221's Lite PPO);
      none:  nothing (Dr. GRPO, Liu et al. 2025: dividing by std_g up-weights prompts the policy
             almost always gets right or wrong, a question-level difficulty bias).
    std is the sample std (Bessel-corrected, n - 1), as TRL's GRPOTrainer computes it.
    rewards: [N] ordered group by group, N = prompts x G -> [N]."""
    r = rewards.view(-1, group_size)
    centred = r - r.mean(1, keepdim=True)
    if scale == "group":
        centred = centred / (r.std(1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (rewards.std() + eps)
    elif scale != "none":
        raise ValueError(f"scale: expected 'group', 'batch' or 'none', got {scale!r}")
    return centred.view(-1)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] bool, True for every sample of a group whose rewards are not all equal (DAPO's dynamic
    sampling keeps only these, Yu et al. 2025, eq. 11: 0 < |{correct}| < G for 0/1 rewards).
    rewards: [N] ordered group by group. Hand-worked, G = 2: [1, 1, 0, 1, 0, 0] -> [F, F, T, T, F, F]."""
    r = rewards.view(-1, group_size)
    return (r.max(1).values > r.min(1).values).repeat_interleave(group_size)


def clipped_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      clip_eps: float, clip_eps_high: float | None = None, dual_clip: float | None = None
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped objective as a loss per token [B, T] (Schulman et al. 2017, eq. 7).

    ratio clipped to [1 - eps, 1 + eps_high] (DAPO clip-higher when eps_high is set). Dual clip (Ye et
    al. 2020, eq. 5): for A < 0 the objective is floored at c * A, so the loss is at most -c * A.
    advantages: [B, T] (or [B, 1] broadcast).
    """
    ratio = torch.exp(logp - logp_old)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped, clipped = ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + high) * advantages
    objective = torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)
    loss = -objective
    metrics = {
        "clip_fraction": masked_mean((clipped < unclipped).float(), mask),
        "ratio_mean": masked_mean(ratio, mask),
    }
    return loss, metrics


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_tokens: int) -> torch.Tensor:
    """A batch's loss from per-token losses [B, T], by how tokens are weighted:
      dapo:    sum / number of tokens; every token weighs the same (DAPO, Yu et al. 2025, sec. 3.3);
      grpo:    mean over sequences of each sequence's token mean (DeepSeekMath, Shao et al. 2024, eq. 3):
               a long answer's tokens weigh less, so a wrong long answer is pushed down less than a short one;
      dr_grpo: sum / (B * max_tokens), a constant normaliser (Dr. GRPO, Liu et al. 2025).
    Hand-worked: per_token [[1, 2, 0], [3, 0, 0]], mask [[1, 1, 0], [1, 0, 0]], max_tokens 4:
      dapo (1 + 2 + 3) / 3 = 2;  grpo (1.5 + 3) / 2 = 2.25;  dr_grpo 6 / (2 * 4) = 0.75."""
    if loss_type == "dapo":
        return masked_mean(per_token, mask)
    if loss_type == "grpo":
        return masked_mean(per_token, mask, dim=1).mean()
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (mask.shape[0] * max_tokens)
    raise ValueError(f"loss_type: expected 'dapo', 'grpo' or 'dr_grpo', got {loss_type!r}")


def loss_weight(mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """What a micro-batch's share of its minibatch's loss is proportional to, so that micro-batches
    weighted by their shares give the whole minibatch's `aggregate_loss`: its tokens (dapo) or its
    sequences (grpo, dr_grpo: both are means over sequences)."""
    return mask.sum() if loss_type == "dapo" else mask.new_tensor(float(mask.shape[0]))


def sampler_correction(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, mode: str,
                       cap: float) -> torch.Tensor:
    """Importance weights [B, T] for sampler/trainer mismatch (Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"): the rollouts come from the sampler's distribution
    (vLLM's kernels, another precision), the loss assumes the trainer's. Ratio pi_trainer / pi_sampler,
    per token or per sequence (the product over its tokens), then
      *_truncate: min(ratio, cap) (TIS);  *_mask: ratio where ratio <= cap, else 0 (MIS: drop the token or sequence).
    TRL's vllm_importance_sampling_mode, with its C_max as `cap`. Padding gets weight 0. Hand-worked:
    logp_old [[-1, -2]], logp_rollout [[-1.5, -1]], cap 1.5: token ratios e^0.5 = 1.649, e^-1 = 0.368;
    token_truncate [1.5, 0.368], token_mask [0, 0.368]; sequence ratio e^-0.5 = 0.607 on both tokens."""
    diff = (logp_old - logp_rollout) * mask
    level, _, how = mode.partition("_")
    if level not in ("token", "sequence") or how not in ("truncate", "mask"):
        raise ValueError(f"mode: expected token_truncate, token_mask, sequence_truncate or sequence_mask, got {mode!r}")
    ratio = torch.exp(diff.sum(1, keepdim=True) if level == "sequence" else diff)
    ratio = ratio.clamp(max=cap) if how == "truncate" else torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    return ratio.expand_as(mask) * mask


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2) per token (PPO2 value clipping)."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of the categorical distribution: [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def adaptive_kl_beta(beta: float, kl: float, target: float, horizon: int, n_steps: int) -> float:
    """Ziegler et al. 2019, sec. 2.2: e = clip(KL / target - 1, -0.2, 0.2); beta <- beta (1 + e n / H).

    Deviation: n / H is capped at 1, so one update moves beta by at most 20% either way. The paper's
    rule assumes n << H; with n > 5H (beta 0.1, H 100, n 600, e -0.2 gives 0.1 * (1 - 1.2) = -0.02)
    the coefficient would turn negative and reward moving away from the reference.
    """
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * min(n_steps / horizon, 1.0))
