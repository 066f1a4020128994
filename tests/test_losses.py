"""Preference losses: hand-worked numbers, a slow per-pair loop against the vectorised version, and
invariances."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.maths.losses import dpo_loss

T = torch.tensor


def test_dpo_sigmoid_hand_worked():
    # policy -1.2 / -2.5, reference -1.0 / -1.1, beta 0.1:
    # log-ratios -0.2 and -1.4 -> implicit rewards -0.02 and -0.14 -> margin 0.12
    # loss = -log sigmoid(0.12) = log(1 + exp(-0.12)) = 0.634946
    loss, m = dpo_loss(T([-1.2]), T([-2.5]), T([-1.0]), T([-1.1]), beta=0.1)
    assert m["rewards/margins"].item() == pytest.approx(0.12, abs=1e-6)
    assert round(loss.item(), 4) == 0.6349
    assert m["rewards/chosen"].item() == pytest.approx(-0.02) and m["rewards/rejected"].item() == pytest.approx(-0.14)
    assert m["rewards/accuracies"].item() == 1.0


def test_ipo_hand_worked():
    # Same numbers, 2 chosen and 4 rejected tokens, tau = beta = 0.1:
    # delta = -0.2/2 - (-1.4/4) = -0.1 + 0.35 = 0.25; loss = (0.25 - 1/(2*0.1))^2 = (0.25 - 5)^2 = 22.5625
    loss, _ = dpo_loss(T([-1.2]), T([-2.5]), T([-1.0]), T([-1.1]), beta=0.1, loss_type="ipo",
                       chosen_tokens=T([2]), rejected_tokens=T([4]))
    assert loss.item() == pytest.approx(22.5625)
    with pytest.raises(ValueError, match="needs chosen_tokens"):
        dpo_loss(T([0.0]), T([0.0]), T([0.0]), T([0.0]), beta=0.1, loss_type="ipo")


def test_robust_hand_worked_and_reduces_to_sigmoid():
    # eps 0.2, beta*delta = 0.12: ((1-0.2)*0.634946 - 0.2*log(1+e^0.12)) / 0.6
    # log(1+e^0.12) = 0.754946 -> (0.507957 - 0.150989) / 0.6 = 0.594946
    loss, _ = dpo_loss(T([-1.2]), T([-2.5]), T([-1.0]), T([-1.1]), beta=0.1, loss_type="robust", label_smoothing=0.2)
    assert loss.item() == pytest.approx(0.594946, abs=1e-5)
    plain, _ = dpo_loss(T([-1.2]), T([-2.5]), T([-1.0]), T([-1.1]), beta=0.1)
    r0, _ = dpo_loss(T([-1.2]), T([-2.5]), T([-1.0]), T([-1.1]), beta=0.1, loss_type="robust")
    assert r0.item() == pytest.approx(plain.item())


def _loop_sigmoid(pc, pr, rc, rr, beta):
    return [math.log1p(math.exp(-beta * ((a - c) - (b - d)))) for a, b, c, d in zip(pc, pr, rc, rr)]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_vectorised_equals_slow_loop(seed, batch):
    g = torch.Generator().manual_seed(seed)
    pc, pr, rc, rr = (-torch.rand(batch, generator=g, dtype=torch.float64) * 20 for _ in range(4))
    beta = 0.05 + seed * 0.1
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=beta)
    assert loss.tolist() == pytest.approx(_loop_sigmoid(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), beta), rel=1e-10)


def test_invariances():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-torch.rand(8, generator=g) * 10 for _ in range(4))
    base, _ = dpo_loss(pc, pr, rc, rr, beta=0.1)
    # Shifting policy and reference of the same completion by one constant changes nothing.
    shifted, _ = dpo_loss(pc + 3.0, pr - 2.0, rc + 3.0, rr - 2.0, beta=0.1)
    assert torch.allclose(base, shifted, atol=1e-5)
    # Policy equal to reference: loss log 2 for every pair, whatever the log-probs.
    same, m = dpo_loss(rc, rr, rc, rr, beta=0.3)
    assert torch.allclose(same, torch.full_like(same, math.log(2))) and m["rewards/margins"].item() == 0
    # Pairs are independent: the batch mean equals the mean of two half-batch means.
    a, _ = dpo_loss(pc[:4], pr[:4], rc[:4], rr[:4], beta=0.1)
    b, _ = dpo_loss(pc[4:], pr[4:], rc[4:], rr[4:], beta=0.1)
    assert base.mean().item() == pytest.approx(((a.mean() + b.mean()) / 2).item())
