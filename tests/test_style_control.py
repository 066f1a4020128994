"""Length-controlled Bradley-Terry (rlhf/maths/style_control.py): by hand, against the raw fit, a judge that
only likes length, and interval coverage by simulation."""

from __future__ import annotations

import numpy as np
import pytest

from rlhf.maths.bradley_terry import ELO_PER_NAT, fit_strengths, rate, win_matrix
from rlhf.maths.style_control import fit, length_feature, rate_length_controlled


def test_length_feature_by_hand():
    # (30 - 10) / (30 + 10) = 0.5; equal lengths 0; both empty 0 (not 0/0); the sign follows a
    assert length_feature(np.array([30, 5, 0, 10]), np.array([10, 5, 0, 30])).tolist() == [0.5, 0.0, 0.0, -0.5]


def test_without_length_differences_it_is_the_raw_fit():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 3, 400)
    b = (a + rng.integers(1, 3, 400)) % 3
    s = rng.choice([0.0, 0.5, 1.0], 400)
    t, gamma = fit(a, b, s, np.zeros(400), 3)
    assert np.allclose(t[0], fit_strengths(win_matrix(a, b, s, 3)), atol=1e-8) and abs(gamma[0]) < 1e-6


def length_judge_battles(n_prompts: int, seed: int):
    """Policy 'long' answers with 20-60 tokens, 'short' with 5-45; the judge picks the longer answer (a coin
    where they tie) and never looks at anything else."""
    rng = np.random.default_rng(seed)
    len_long, len_short = rng.integers(20, 61, n_prompts), rng.integers(5, 46, n_prompts)
    score = np.where(len_long == len_short, 0.5, (len_long > len_short).astype(float))
    return np.zeros(n_prompts, int), np.ones(n_prompts, int), score, len_long, len_short


def test_a_judge_that_only_likes_length_gives_a_raw_gap_and_no_controlled_gap():
    a, b, s, la, lb = length_judge_battles(600, seed=1)
    raw = rate(a, b, s, ["long", "short"], "short", rounds=200)
    lc = rate_length_controlled(a, b, s, la, lb, ["long", "short"], "short", rounds=200)
    assert raw.elo[0] - 1000 > 150 and raw.ci_low[0] > 1000  # the raw rating rewards length
    assert abs(lc.elo[0] - 1000) < 40 and lc.ci_low[0] < 1000 < lc.ci_high[0]  # controlled: no real difference
    assert lc.gamma > 5 and lc.gamma_ci[0] > 0  # the judge's length preference, visible and significant


def test_a_judge_that_length_separates_has_a_finite_converged_gamma():
    # the longer answer always wins: without a prior on gamma the likelihood rises forever as gamma grows;
    # with the weak prior the MAP exists, and at the returned point the log-posterior's gradient is zero
    a, b, s, la, lb = length_judge_battles(300, seed=2)
    decided = s != 0.5
    a, b, s, z = a[decided], b[decided], s[decided], length_feature(la[decided], lb[decided])
    t, gamma = fit(a, b, s, z, 2)
    p = 1 / (1 + np.exp(-(t[0][a] - t[0][b] + gamma[0] * z)))
    assert 5 < gamma[0] < 1e3
    assert abs(np.sum((s - p) * z) - 0.01 * gamma[0]) < 1e-6  # d/dgamma of the log-posterior


def test_bootstrap_rounds_started_from_the_fit_reach_the_same_optimum():
    a, b, s, la, lb, prompt = simulate(200, 7, np.array([0.0, 0.4, -0.3]), 2.0)
    z = length_feature(la, lb)
    w = np.random.default_rng(0).poisson(1.0, (20, len(a))).astype(float)
    t0, g0 = fit(a, b, s, z, 3)
    cold, warm = fit(a, b, s, z, 3, weights=w), fit(a, b, s, z, 3, weights=w, start=np.append(t0[0], g0[0]))
    assert np.allclose(cold[0], warm[0], atol=1e-9) and np.allclose(cold[1], warm[1], atol=1e-9)


def simulate(n_prompts: int, seed: int, true_t: np.ndarray, gamma: float):
    """Every pair of 3 policies answers each prompt; lengths vary by policy and prompt; outcomes drawn from the
    style-controlled model, ties when a uniform draw lands within 0.05 of the decision."""
    rng = np.random.default_rng(seed)
    pairs = [(0, 1), (0, 2), (1, 2)]
    mean_len = np.array([40.0, 25.0, 30.0])
    lengths = rng.poisson(mean_len[None, :], (n_prompts, 3)) + 1
    a = np.array([p for _ in range(n_prompts) for p, _ in pairs])
    b = np.array([q for _ in range(n_prompts) for _, q in pairs])
    prompt = np.repeat(np.arange(n_prompts), len(pairs))
    la, lb = lengths[prompt, a], lengths[prompt, b]
    p = 1 / (1 + np.exp(-(true_t[a] - true_t[b] + gamma * length_feature(la, lb))))
    u = rng.random(len(a))
    s = np.where(np.abs(u - p) < 0.05, 0.5, (u < p).astype(float))
    return a, b, s, la, lb, prompt


@pytest.mark.slow  # 60 simulated evaluations with 300 bootstrap rounds each
def test_controlled_intervals_cover_the_truth():
    true_t, gamma = np.array([0.0, 0.4, -0.3]), 2.0
    true_elo = 1000 + ELO_PER_NAT * (true_t - true_t[0])
    hits, gamma_hits, reps = 0, 0, 60
    for rep in range(reps):
        a, b, s, la, lb, prompt = simulate(400, 500 + rep, true_t, gamma)
        r = rate_length_controlled(a, b, s, la, lb, ["x", "y", "z"], "x", rounds=300, seed=rep, clusters=prompt)
        hits += sum(r.ci_low[i] <= true_elo[i] <= r.ci_high[i] for i in (1, 2))  # the anchor's is a point
        gamma_hits += r.gamma_ci[0] <= gamma <= r.gamma_ci[1]
    assert hits / (2 * reps) >= 0.93, hits / (2 * reps)
    assert gamma_hits / reps >= 0.9, gamma_hits / reps
