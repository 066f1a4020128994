"""Bradley-Terry ratings on the Elo scale, with bootstrap confidence intervals (pure numpy).

Model (Bradley & Terry 1952; Chatbot Arena, Chiang et al. 2024, sec. 5): P(i beats j) = sigmoid(t_i - t_j).
A tie counts as half a win for each side. We maximise the log-likelihood over aggregated matchup counts
with a weak Gaussian prior, -(l2 / 2) * sum(t^2) (l2 = 0.01, i.e. a N(0, 10^2) prior in natural units):
  * it keeps ratings finite when a policy never wins (or always wins), where the plain MLE diverges;
  * it fixes the translation freedom; ratings are then re-anchored, so only differences carry meaning.
Elo scale: 400 points per factor of 10 in odds, i.e. elo = base + 400 / ln(10) * (t - t_anchor).

Battles are aggregated into a K x K win matrix before fitting, so 100k battles cost the same as 100,
and all bootstrap rounds are fitted at once with a batched Newton method.

The bootstrap resamples prompts, not battles. All K(K-1)/2 battles on one prompt share it (a hard
prompt makes every policy wrong at once), so they are not independent draws; resampling battles as if
they were gave nominal 95% intervals that covered the true ratings only 0.69-0.84 of the time in
simulation, resampling whole prompts (the cluster bootstrap, Davison & Hinkley 1997, sec. 3.8) 0.94-0.96
(tests/test_bradley_terry.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ELO_PER_NAT = 400.0 / math.log(10.0)


def win_matrix(a: np.ndarray, b: np.ndarray, score_a: np.ndarray, k: int) -> np.ndarray:
    """W[i, j] = wins of i over j, ties as 0.5 each. a, b: [N] policy indices; score_a: [N] in {1, 0.5, 0}."""
    w = np.zeros((k, k))
    np.add.at(w, (a, b), score_a)
    np.add.at(w, (b, a), 1.0 - score_a)
    return w


def fit_strengths(w: np.ndarray, l2: float = 0.01, tol: float = 1e-10, max_iter: int = 100) -> np.ndarray:
    """MAP strengths t for one or many win matrices. w: [K, K] or [R, K, K] -> t: [K] or [R, K].

    Newton's method on the concave objective sum_ij W_ij log sigmoid(t_i - t_j) - l2/2 |t|^2:
      grad_i = sum_j (W_ij - n_ij p_ij) - l2 t_i,     n_ij = W_ij + W_ji,  p_ij = sigmoid(t_i - t_j)
      H_ij   = n_ij p_ij (1 - p_ij)  (i != j),       H_ii = -sum_j n_ij p_ij (1 - p_ij) - l2
    """
    single = w.ndim == 2
    w = w[None] if single else w
    r, k, _ = w.shape
    n = w + np.swapaxes(w, 1, 2)
    t = np.zeros((r, k))
    eye = np.eye(k)
    for _ in range(max_iter):
        p = 1.0 / (1.0 + np.exp(-(t[:, :, None] - t[:, None, :])))
        grad = (w - n * p).sum(axis=2) - l2 * t
        c = n * p * (1.0 - p)
        hess = c - eye * (c.sum(axis=2)[:, :, None] + l2)
        step = np.linalg.solve(hess, grad[:, :, None])[:, :, 0]
        t = t - step
        if np.abs(step).max() < tol:
            break
    return t[0] if single else t


def to_elo(t: np.ndarray, anchor: int, base: float = 1000.0) -> np.ndarray:
    return base + ELO_PER_NAT * (t - t[..., anchor : anchor + 1])


@dataclass
class Ratings:
    names: list[str]
    elo: np.ndarray  # [K]
    ci_low: np.ndarray  # [K] 2.5th percentile of the bootstrap
    ci_high: np.ndarray  # [K] 97.5th percentile
    battles: np.ndarray  # [K, K] battle counts
    win_rate: np.ndarray  # [K, K] share of points i scored against j (NaN where they never met)


def check_battles(a: np.ndarray, b: np.ndarray, score_a: np.ndarray, names: list[str], anchor: str) -> None:
    """ValueError naming the first thing wrong with a set of battles (what `rate` would otherwise fit
    silently, or divide by zero on)."""
    if anchor not in names:
        raise ValueError(f"anchor {anchor!r} is not one of the rated policies {names}")
    if not len(a) == len(b) == len(score_a):
        raise ValueError(f"battles: a, b and score_a have lengths {len(a)}, {len(b)} and {len(score_a)}")
    if len(a) == 0:
        raise ValueError("no battles to rate")
    k = len(names)
    if ((a < 0) | (a >= k) | (b < 0) | (b >= k)).any():
        raise ValueError(f"battles name a policy index outside 0 .. {k - 1}")
    if (same := np.flatnonzero(a == b)).size:
        raise ValueError(f"battle {same[0]}: policy {names[a[same[0]]]!r} against itself")
    if (bad := np.flatnonzero(~np.isfinite(score_a) | (score_a < 0) | (score_a > 1))).size:
        raise ValueError(f"battle {bad[0]}: score {float(score_a[bad[0]])!r} is outside [0, 1] (1 win, 0.5 tie, 0 loss)")


def rate(a: np.ndarray, b: np.ndarray, score_a: np.ndarray, names: list[str], anchor: str,
         rounds: int = 1000, seed: int = 0, l2: float = 0.01, clusters: np.ndarray | None = None) -> Ratings:
    """Elo ratings with 95% bootstrap intervals from battles (a[i] vs b[i], score_a[i] in {1, .5, 0}).

    clusters: [N] the prompt of each battle; a bootstrap round draws prompts with replacement and takes
    all their battles. None makes every battle its own cluster (only right for independent battles).
    """
    a, b, score_a = np.asarray(a, dtype=int), np.asarray(b, dtype=int), np.asarray(score_a, dtype=float)
    check_battles(a, b, score_a, names, anchor)
    k, anchor_i = len(names), names.index(anchor)
    w = win_matrix(a, b, score_a, k)
    elo = to_elo(fit_strengths(w, l2), anchor_i)
    _, cluster = np.unique(np.arange(len(a)) if clusters is None else np.asarray(clusters), return_inverse=True)
    n_clusters = int(cluster.max()) + 1 if len(cluster) else 0
    per_cluster = np.zeros((n_clusters, k, k))  # [C, K, K] each prompt's own win matrix
    np.add.at(per_cluster, (cluster, a, b), score_a)
    np.add.at(per_cluster, (cluster, b, a), 1.0 - score_a)
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(n_clusters, np.full(n_clusters, 1.0 / n_clusters), size=rounds)  # [R, C] times drawn
    boot = to_elo(fit_strengths(np.einsum("rc,ckl->rkl", draws, per_cluster), l2), anchor_i)
    n = w + w.T
    with np.errstate(invalid="ignore", divide="ignore"):
        win_rate = np.where(n > 0, w / n, np.nan)
    return Ratings(names, elo, np.percentile(boot, 2.5, axis=0), np.percentile(boot, 97.5, axis=0), n, win_rate)


def paired_accuracy_diff(correct_a: np.ndarray, correct_b: np.ndarray, rounds: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """Mean accuracy difference (a - b) on the same prompts and its 95% paired-bootstrap interval.
    correct_a, correct_b: [P] 0/1 per prompt, aligned by prompt."""
    correct_a, correct_b = np.asarray(correct_a, float), np.asarray(correct_b, float)
    if correct_a.shape != correct_b.shape or correct_a.size == 0:
        raise ValueError(f"paired accuracies need the same non-empty prompts, got {correct_a.size} and {correct_b.size}")
    d = correct_a - correct_b
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(d), size=(rounds, len(d)))
    means = d[idx].mean(axis=1)
    return float(d.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a success rate (Wilson 1927): unlike p +- z*se it stays inside [0, 1]
    and is not empty at 0 or n successes."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= n and n > 0, got {successes} of {n}")
    p, zz = successes / n, z * z
    centre = (p + zz / (2 * n)) / (1 + zz / n)
    half = z * math.sqrt(p * (1 - p) / n + zz / (4 * n * n)) / (1 + zz / n)
    return max(0.0, centre - half), min(1.0, centre + half)
