"""Preference losses as small pure functions: tensors in, (per-pair loss, metrics) out.

These are the reference implementations that the DPO stage is checked against: TRL's DPOTrainer
computes the training loss, and tests/test_dpo.py asserts it equals `dpo_loss` on the same batch.

Shapes: every input is [B] (one value per preference pair).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sigmoid(delta: torch.Tensor, *, beta: float, **_) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, eq. 7): -log sigmoid(beta * delta), delta = chosen minus rejected log-ratio."""
    return -F.logsigmoid(beta * delta)


def _ipo(delta_avg: torch.Tensor, *, beta: float, **_) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17): (delta - 1 / (2 tau))^2 with tau = beta. Log-ratios are averaged over
    completion tokens, as TRL does and as the IPO authors confirmed their results were computed."""
    return (delta_avg - 1 / (2 * beta)) ** 2


def _robust(delta: torch.Tensor, *, beta: float, label_smoothing: float, **_) -> torch.Tensor:
    """rDPO (Chowdhury et al. 2024, eq. 6): unbiased under preference flips with rate eps = label_smoothing."""
    eps = label_smoothing
    clean = -(1 - eps) * F.logsigmoid(beta * delta)
    flipped = -eps * F.logsigmoid(-beta * delta)
    return (clean - flipped) / (1 - 2 * eps)


PREFERENCE_LOSSES = {"sigmoid": _sigmoid, "ipo": _ipo, "robust": _robust}


def dpo_loss(
    logp_policy_chosen: torch.Tensor,
    logp_policy_rejected: torch.Tensor,
    logp_ref_chosen: torch.Tensor,
    logp_ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair loss [B] and metrics. Summed completion log-probs in; token counts needed for 'ipo'.

    Hand-worked (sigmoid, beta 0.1): policy -1.2 / -2.5, reference -1.0 / -1.1.
      chosen log-ratio  = -1.2 - (-1.0) = -0.2;   rejected log-ratio = -2.5 - (-1.1) = -1.4
      implicit rewards  = beta * log-ratio = -0.02 and -0.14; margin = 0.12
      loss = -log sigmoid(0.12) = log(1 + e^-0.12) = log(1.886920) = 0.634946
    """
    chosen_ratio = logp_policy_chosen - logp_ref_chosen
    rejected_ratio = logp_policy_rejected - logp_ref_rejected
    if loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("loss_type 'ipo' needs chosen_tokens and rejected_tokens")
        delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
    else:
        delta = chosen_ratio - rejected_ratio
    loss = PREFERENCE_LOSSES[loss_type](delta, beta=beta, label_smoothing=label_smoothing)
    chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
    metrics = {
        "rewards/chosen": chosen_reward.mean(),
        "rewards/rejected": rejected_reward.mean(),
        "rewards/margins": (chosen_reward - rejected_reward).mean(),
        "rewards/accuracies": (chosen_reward > rejected_reward).float().mean(),
    }
    return loss, metrics


def kto_loss(
    logp_policy: torch.Tensor,
    logp_ref: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | float,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> torch.Tensor:
    """Per-example KTO loss [B] (Ethayarajh et al. 2024, eq. 7), inputs [B]; `desirable` is boolean.

    r = log pi(y|x) - log pi_ref(y|x); z0 = the batch's KL estimate, clamped at 0 and not differentiated.
      desirable:   w_d * (1 - sigmoid(beta * (r - z0)))
      undesirable: w_u * (1 - sigmoid(beta * (z0 - r)))
    'apo_zero_unpaired' (D'Oosterlinck et al. 2024) drops z0 and uses sigmoid(beta * r) for undesirable.
    Hand-worked (beta 0.1, z0 0): policy -1.2 / -2.5, reference -1.0 / -1.1 -> r = -0.2 / -1.4;
      desirable 1 - sigmoid(-0.02) = 0.505000; undesirable 1 - sigmoid(0.14) = 0.465057; mean 0.485028.
    """
    ratio = logp_policy - logp_ref
    z0 = torch.as_tensor(kl, dtype=ratio.dtype).clamp(min=0).detach()
    if loss_type == "kto":
        good, bad = 1 - torch.sigmoid(beta * (ratio - z0)), 1 - torch.sigmoid(beta * (z0 - ratio))
    elif loss_type == "apo_zero_unpaired":
        good, bad = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
    else:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}")
    return torch.where(desirable, desirable_weight * good, undesirable_weight * bad)
