"""Length-controlled Bradley-Terry ratings (pure numpy): the Chatbot Arena style-control method (Li et al.
2024, "Does style matter? Disentangling style and substance in Chatbot Arena"), with the battle's
response-length difference as the one style covariate.

Model: P(a beats b) = sigmoid(t_a - t_b + gamma * z_ab), z_ab = (len_a - len_b) / (len_a + len_b), the
normalised length difference in [-1, 1] (Arena's normalisation; 0 when both are empty). gamma is the
judge's length preference in log-odds; the strengths t are what is left once length is accounted for.
A judge that prefers longer answers shows up as gamma > 0, and a policy that only wins by being longer
loses its lead in t. Fitted as bradley_terry.py fits the raw ratings: ties as half a win each, the same
weak Gaussian prior on t and on gamma (weak enough that length explains what it can, and without it a
judge whose verdicts length alone separates, or a bootstrap draw where it does, has no finite gamma and
Newton runs off), Newton's method on the concave log-posterior, and a bootstrap over prompts (all battles
on one prompt drawn together, each draw's Newton started from the full data's fit) for 95% intervals of
both the ratings and gamma.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlhf.maths.bradley_terry import check_battles, to_elo


def length_feature(len_a: np.ndarray, len_b: np.ndarray) -> np.ndarray:
    """z = (len_a - len_b) / (len_a + len_b), 0 where both are 0. Hand-worked: 30 vs 10 tokens -> 0.5."""
    len_a, len_b = np.asarray(len_a, float), np.asarray(len_b, float)
    total = len_a + len_b
    return np.divide(len_a - len_b, total, out=np.zeros_like(total), where=total > 0)


def fit(a: np.ndarray, b: np.ndarray, score_a: np.ndarray, z: np.ndarray, k: int, weights: np.ndarray | None = None,
        l2: float = 0.01, tol: float = 1e-10, max_iter: int = 100,
        start: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """MAP (t [R, K], gamma [R]) for R weightings of the same N battles (weights [R, N], default one round of
    ones), each Newton started from `start` ([K + 1], default zeros). Newton on
    sum_n w_n [s_n log p_n + (1 - s_n) log(1 - p_n)] - l2/2 |theta|^2, with p_n = sigmoid(x_n . theta),
    x_n = e_a - e_b with z_n appended, theta = (t, gamma):
      grad = X^T (w (s - p)) - l2 theta,   H = -X^T diag(w p (1 - p)) X - l2 I.
    A weighting stops once its own step is below tol, so one slow draw does not keep the others iterating."""
    n = len(a)
    x = np.zeros((n, k + 1))
    x[np.arange(n), a] += 1.0
    x[np.arange(n), b] -= 1.0
    x[:, k] = z
    outer = (x[:, :, None] * x[:, None, :]).reshape(n, -1)  # [N, (K+1)^2]: H is one matrix product per step
    w = np.ones((1, n)) if weights is None else np.asarray(weights, float)
    theta = np.zeros((w.shape[0], k + 1)) if start is None else np.tile(np.asarray(start, float), (w.shape[0], 1))
    live = np.arange(w.shape[0])
    for _ in range(max_iter):
        th, wl = theta[live], w[live]
        p = 1.0 / (1.0 + np.exp(-(th @ x.T)))  # [R, N]
        grad = (wl * (score_a - p)) @ x - l2 * th
        hess = -((wl * p * (1.0 - p)) @ outer).reshape(-1, k + 1, k + 1) - l2 * np.eye(k + 1)
        step = np.linalg.solve(hess, grad[:, :, None])[:, :, 0]
        theta[live] = th - step
        live = live[np.abs(step).max(axis=1) >= tol]
        if len(live) == 0:
            break
    return theta[:, :k], theta[:, k]


@dataclass
class StyleRatings:
    names: list[str]
    elo: np.ndarray  # [K] length-controlled
    ci_low: np.ndarray  # [K]
    ci_high: np.ndarray  # [K]
    gamma: float  # the judge's length coefficient (log-odds per unit of z)
    gamma_ci: tuple[float, float]


def rate_length_controlled(a: np.ndarray, b: np.ndarray, score_a: np.ndarray, len_a: np.ndarray, len_b: np.ndarray,
                           names: list[str], anchor: str, rounds: int = 1000, seed: int = 0, l2: float = 0.01,
                           clusters: np.ndarray | None = None) -> StyleRatings:
    """Length-controlled Elo with 95% prompt-bootstrap intervals, and the length coefficient with its own."""
    a, b, score_a = np.asarray(a, dtype=int), np.asarray(b, dtype=int), np.asarray(score_a, dtype=float)
    check_battles(a, b, score_a, names, anchor)
    k, anchor_i = len(names), names.index(anchor)
    z = length_feature(len_a, len_b)
    t, gamma = fit(a, b, score_a, z, k, l2=l2)
    _, cluster = np.unique(np.arange(len(a)) if clusters is None else np.asarray(clusters), return_inverse=True)
    n_clusters = int(cluster.max()) + 1
    draws = np.random.default_rng(seed).multinomial(n_clusters, np.full(n_clusters, 1.0 / n_clusters), size=rounds)
    boot_t, boot_gamma = fit(a, b, score_a, z, k, weights=draws[:, cluster], l2=l2,  # [R, C] -> [R, N] weights
                             start=np.append(t[0], gamma[0]))
    boot = to_elo(boot_t, anchor_i)
    return StyleRatings(names, to_elo(t[0], anchor_i), np.percentile(boot, 2.5, axis=0), np.percentile(boot, 97.5, axis=0),
                        float(gamma[0]), (float(np.percentile(boot_gamma, 2.5)), float(np.percentile(boot_gamma, 97.5))))
