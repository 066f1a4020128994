"""RL maths: hand-worked numbers, slow loop references for the vectorised functions, invariances."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.maths.rl_math import (
    adaptive_kl_beta,
    aggregate_loss,
    clipped_surrogate,
    clipped_value_loss,
    entropy_from_logits,
    gae,
    informative_groups,
    group_advantages,
    kl_k1,
    kl_k3,
    kl_penalized_rewards,
    loss_weight,
    masked_mean,
    sampler_correction,
)

T = torch.tensor


def test_gae_hand_worked():
    adv, ret = gae(T([[1.0, 0, 0, 10]]), T([[2.0, 2, 2, 0]]), torch.ones(1, 4), gamma=1.0, lam=0.95)
    assert adv[0].tolist() == pytest.approx([7.76875, 7.125, 7.5, 10.0])
    assert ret[0].tolist() == pytest.approx([9.76875, 9.125, 9.5, 10.0])


def gae_loop(r, v, gamma, lam):
    """Textbook recursion on one unpadded sequence."""
    out, nxt_a, nxt_v = [0.0] * len(r), 0.0, 0.0
    for t in reversed(range(len(r))):
        delta = r[t] + gamma * nxt_v - v[t]
        nxt_a = delta + gamma * lam * nxt_a
        out[t], nxt_v = nxt_a, v[t]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_loop_with_padding(seed):
    g = torch.Generator().manual_seed(seed)
    b, t = 5, 7
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    r, v = torch.randn(b, t, generator=g, dtype=torch.float64), torch.randn(b, t, generator=g, dtype=torch.float64)
    adv, _ = gae(r, v, mask, gamma=0.99, lam=0.9)
    for i in range(b):
        n = int(lengths[i])
        assert adv[i, :n].tolist() == pytest.approx(gae_loop(r[i, :n].tolist(), v[i, :n].tolist(), 0.99, 0.9))
        assert (adv[i, n:] == 0).all()


def test_group_advantages_hand_worked():
    # mean 0.275; deviations -0.075, 0.525, -0.675, 0.225; sample var 0.7875 / 3 = 0.2625; std 0.512348
    adv = group_advantages(T([0.2, 0.8, -0.4, 0.5]), group_size=4, eps=0.0)
    std = math.sqrt(0.2625)
    assert adv.tolist() == pytest.approx([-0.075 / std, 0.525 / std, -0.675 / std, 0.225 / std])
    # Groups are independent, and a group of equal rewards has zero advantage (no NaN).
    two = group_advantages(T([0.2, 0.8, -0.4, 0.5, 1.0, 1.0, 1.0, 1.0]), group_size=4)
    assert two[4:].tolist() == [0.0] * 4 and torch.isfinite(two).all()


def test_group_advantages_scaled_by_batch_or_not_at_all_by_hand():
    # groups [1, 0] and [1, 1] (G = 2): centred [0.5, -0.5, 0, 0]
    r = T([1.0, 0.0, 1.0, 1.0])
    assert group_advantages(r, 2, scale="none").tolist() == [0.5, -0.5, 0.0, 0.0]  # Dr. GRPO
    # batch: mean 0.75, squared deviations 1/16 * 3 + 9/16 = 12/16, sample var 0.25, std 0.5
    assert group_advantages(r, 2, eps=0.0, scale="batch").tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])
    # group: [1, 0] has sample std sqrt(0.5); the uniform group stays 0 (eps keeps it from 0 / 0)
    adv = group_advantages(r, 2).tolist()
    assert adv[:2] == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)], rel=1e-3) and adv[2:] == [0.0, 0.0]
    with pytest.raises(ValueError, match="scale"):
        group_advantages(r, 2, scale="std")


def test_aggregate_loss_by_hand():
    per_token = T([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate_loss(per_token, mask, "dapo", 4).item() == pytest.approx(2.0)  # 6 / 3 tokens
    assert aggregate_loss(per_token, mask, "grpo", 4).item() == pytest.approx(2.25)  # (1.5 + 3) / 2 answers
    assert aggregate_loss(per_token, mask, "dr_grpo", 4).item() == pytest.approx(0.75)  # 6 / (2 x 4)
    with pytest.raises(ValueError, match="loss_type"):
        aggregate_loss(per_token, mask, "sum", 4)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_micro_batches_weighted_by_loss_weight_give_the_whole_loss(loss_type):
    g = torch.Generator().manual_seed(0)
    per_token = torch.randn(6, 5, generator=g)
    mask = (torch.arange(5)[None, :] < T([1, 5, 2, 3, 4, 2])[:, None]).float()
    whole = aggregate_loss(per_token, mask, loss_type, 5)
    total = loss_weight(mask, loss_type)
    parts = sum(loss_weight(mask[i:j], loss_type) / total * aggregate_loss(per_token[i:j], mask[i:j], loss_type, 5)
                for i, j in ((0, 1), (1, 4), (4, 6)))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_per_sequence_mean_pushes_a_long_wrong_answer_down_less():
    """The length bias Dr. GRPO removes: with advantage -1 on a 1-token and a 4-token answer, 'grpo'
    weighs each token of the long answer 1/4 as much as the short one's; 'dapo' and 'dr_grpo' alike."""
    mask = T([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    for loss_type, ratio in (("grpo", 0.25), ("dapo", 1.0), ("dr_grpo", 1.0)):
        x = torch.zeros(2, 4, requires_grad=True)
        aggregate_loss(-(-1.0) * x, mask, loss_type, 4).backward()  # loss = -A * x per token, A = -1
        assert (x.grad[1, 0] / x.grad[0, 0]).item() == pytest.approx(ratio)


def test_sampler_correction_by_hand():
    old, rollout, mask = T([[-1.0, -2.0, 0.0]]), T([[-1.5, -1.0, 0.0]]), T([[1.0, 1.0, 0.0]])
    e = math.exp
    cases = {"token_truncate": [1.5, e(-1.0), 0.0], "token_mask": [0.0, e(-1.0), 0.0],
             "sequence_truncate": [e(-0.5), e(-0.5), 0.0], "sequence_mask": [e(-0.5), e(-0.5), 0.0]}
    for mode, want in cases.items():
        assert sampler_correction(old, rollout, mask, mode, cap=1.5)[0].tolist() == pytest.approx(want), mode
    # a sequence ratio above the cap: truncated to it, or the whole sequence dropped
    assert sampler_correction(rollout, old, mask, "sequence_truncate", 1.5)[0].tolist() == pytest.approx([1.5, 1.5, 0])
    assert sampler_correction(rollout, old, mask, "sequence_mask", 1.5)[0].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="mode"):
        sampler_correction(old, rollout, mask, "token", 1.5)


@pytest.mark.parametrize("seed", range(3))
def test_group_advantages_match_loop(seed):
    r = torch.randn(24, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    adv = group_advantages(r, group_size=6, eps=1e-4)
    for g in range(4):
        xs = r[g * 6 : (g + 1) * 6].tolist()
        mean = sum(xs) / 6
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / 5)
        assert adv[g * 6 : (g + 1) * 6].tolist() == pytest.approx([(x - mean) / (std + 1e-4) for x in xs])


def test_kl_estimators():
    lp = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert torch.all(kl_k3(lp, lp) == 0) and torch.all(kl_k1(lp, lp) == 0)
    other = lp + torch.randn(100, generator=torch.Generator().manual_seed(1))
    assert torch.all(kl_k3(lp, other) >= 0)
    # k3 by hand: log pi = -1, log ref = -2 -> d = -1: e^-1 + 1 - 1 = 0.367879
    assert kl_k3(T([-1.0]), T([-2.0])).item() == pytest.approx(math.exp(-1))


def test_kl_penalised_rewards_by_hand():
    kl = T([[0.5, 0.5, 9.0], [1.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    r = kl_penalized_rewards(T([2.0, -1.0]), kl, mask, beta=0.1)
    assert r[0].tolist() == pytest.approx([-0.05, 2.0 - 0.05, 0.0])
    assert r[1].tolist() == pytest.approx([-1.0 - 0.1, 0.0, 0.0])


def test_clipped_surrogate_and_dual_clip():
    mask = torch.ones(1, 4)
    logp_old = torch.zeros(1, 4)
    logp = torch.log(T([[1.5, 0.5, 3.0, 1.0]]))  # ratios 1.5, 0.5, 3.0, 1.0
    adv = T([[1.0, 1.0, -1.0, -2.0]])
    loss, m = clipped_surrogate(logp, logp_old, adv, mask, clip_eps=0.2)
    # min(r A, clip(r) A): 1.2, 0.5, -3.0, -2.0 -> loss -1.2, -0.5, 3.0, 2.0
    assert loss[0].tolist() == pytest.approx([-1.2, -0.5, 3.0, 2.0])
    assert m["clip_fraction"].item() == pytest.approx(0.25)  # only the first token is clipped down
    dual, _ = clipped_surrogate(logp, logp_old, adv, mask, clip_eps=0.2, dual_clip=2.0)
    # A = -1 with ratio 3: objective -3 floored at c*A = -2 -> loss 2 = -c*A
    assert dual[0].tolist() == pytest.approx([-1.2, -0.5, 2.0, 2.0])
    big = torch.log(T([[50.0]]))
    bounded, _ = clipped_surrogate(big, torch.zeros(1, 1), T([[-0.7]]), torch.ones(1, 1), 0.2, dual_clip=3.0)
    assert bounded.item() == pytest.approx(3.0 * 0.7)  # loss never exceeds -c*A, however large the ratio
    high, _ = clipped_surrogate(logp, logp_old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    assert high[0, 0].item() == pytest.approx(-1.28)


def test_value_loss_and_entropy():
    v, old, ret = T([3.0, 0.0]), T([1.0, 0.0]), T([0.0, 1.0])
    # first: max((3-0)^2, (1.2-0)^2)/2 = 4.5; second: max(1, 1)/2 = 0.5
    assert clipped_value_loss(v, old, ret, clip=0.2).tolist() == pytest.approx([4.5, 0.5])
    uniform = torch.zeros(2, 4)
    assert entropy_from_logits(uniform).tolist() == pytest.approx([math.log(4)] * 2)


def test_adaptive_kl_controller():
    assert adaptive_kl_beta(0.1, kl=12.0, target=6.0, horizon=100, n_steps=10) == pytest.approx(0.1 * 1.02)
    assert adaptive_kl_beta(0.1, kl=3.0, target=6.0, horizon=100, n_steps=10) == pytest.approx(0.1 * (1 - 0.02))
    assert adaptive_kl_beta(0.1, kl=6.0, target=6.0, horizon=100, n_steps=10) == pytest.approx(0.1)


def test_k3_with_extreme_padding_is_finite_with_finite_gradient():
    """The issue's case: a padded position's log-prob of -95 overflowed exp and made the mean NaN."""
    logp = T([[-1.0, -95.0]], requires_grad=True)
    ref, mask = T([[-1.2, 0.0]]), T([[1.0, 0.0]])
    k3 = masked_mean(kl_k3(logp, ref, mask), mask)
    # real token: d = -1.2 - (-1) = -0.2 -> e^-0.2 + 0.2 - 1 = 0.0187308
    assert k3.item() == pytest.approx(math.exp(-0.2) + 0.2 - 1, rel=1e-6)
    k3.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0
    # d/dlogp (e^d - d - 1) with d = ref - logp is 1 - e^d = 1 - e^-0.2
    assert logp.grad[0, 0].item() == pytest.approx(1 - math.exp(-0.2), rel=1e-6)
    unmasked = kl_k3(logp, ref)  # without the mask: inf at the padded position ...
    assert torch.isinf(unmasked[0, 1]) and masked_mean(unmasked, mask).item() == pytest.approx(k3.item())  # ... selected out
    logp.grad = None
    masked_mean(unmasked, mask).backward()
    assert logp.grad[0, 1].isnan()  # but its gradient is 0 * inf: the failure kl_k3's mask guards against


def test_k3_keeps_precision_for_tiny_differences_in_float32():
    """k3 ~ d^2 / 2 for small d: exp(d) - 1 - d in float32 returns 0 (or noise) at d = 1e-4."""
    lp = torch.full((3,), -2.0)
    ref = lp + T([1e-4, -1e-4, 3e-3])
    exact = [math.expm1(d) - d for d in (ref - lp).double().tolist()]  # the float32 d's, in float64
    assert kl_k3(lp, ref).tolist() == pytest.approx(exact, rel=1e-3)
    assert (torch.exp(ref - lp) - (ref - lp) - 1)[:2].tolist() == [0.0, 0.0]  # the old form lost them


def test_adaptive_kl_beta_stays_positive_and_bounded():
    # the case: 0.1 * (1 - 0.2 * 600 / 100) would be -0.02; with n / H capped at 1: 0.1 * 0.8
    assert adaptive_kl_beta(0.1, kl=0.0, target=6.0, horizon=100, n_steps=600) == pytest.approx(0.08)
    assert adaptive_kl_beta(0.1, kl=100.0, target=6.0, horizon=100, n_steps=600) == pytest.approx(0.12)
    beta = 0.1
    for _ in range(200):  # a long run of low KL shrinks beta geometrically, never through zero
        beta = adaptive_kl_beta(beta, kl=0.0, target=6.0, horizon=10, n_steps=1000)
    assert 0 < beta < 1e-15


def test_informative_groups_by_hand():
    keep = informative_groups(T([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), group_size=2)
    assert keep.tolist() == [False, False, True, True, False, False]
    assert informative_groups(T([0.3, 0.3, 0.3, 0.31]), group_size=4).tolist() == [True] * 4


def test_whiten_by_hand():
    """x = [1, 2, 3, (100 masked)]: mean 2, population variance 2/3, so [-1.2247, 0, 1.2247, 0]."""
    x, mask = torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    from rlhf.maths.rl_math import whiten

    w = whiten(x, mask)
    assert torch.allclose(w, torch.tensor([[-1.2247449, 0.0, 1.2247449, 0.0]]), atol=1e-5)


def test_masked_mean_selects_so_a_nan_in_padding_does_not_leak():
    # tokens [2, 4 | pad NaN] and [6 | pad inf, pad NaN]: means 3 and 6, overall (2 + 4 + 6) / 3 = 4
    x = torch.tensor([[2.0, 4.0, float("nan")], [6.0, float("inf"), float("nan")]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert masked_mean(x, mask).item() == 4.0
    assert masked_mean(x, mask, dim=1).tolist() == [3.0, 6.0]
    masked_mean(x, mask).backward()
    assert torch.equal(x.grad, torch.tensor([[1 / 3, 1 / 3, 0.0], [1 / 3, 0.0, 0.0]]))  # no NaN reaches the grad
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0  # nothing kept: 0, not 0/0
