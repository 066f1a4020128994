"""Bradley-Terry ratings on the Elo scale, with bootstrap confidence intervals (pure numpy).

Model (Bradley & Terry 1952; Chatbot Arena, Chiang et al. 2024, sec. 5): P(i beats j) = sigmoid(t_i - t_j).
A tie counts as half a win for each side. We maximise the log-likelihood over aggregated matchup counts
with a weak Gaussian prior, -(l2 / 2) * sum(t^2) (l2 = 0.01, i.e. a N(0, 10^2) prior in natural units):
  * it keeps ratings finite when a policy never wins (or always wins), where the plain MLE diverges;
  * it fixes the translation freedom; ratings are then re-anchored, so only differences carry meaning.
Elo scale: 400 points per factor of 10 in odds, i.e. elo = base + 400 / ln(10) * (t - t_anchor).

Battles are aggregated into a K x K win matrix before fitting, so 100k battles cost the same as 100;
the bootstrap resamples battles as one multinomial draw over the observed (pair, outcome) cells and
fits all rounds at once with a batched Newton method.
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


def rate(a: np.ndarray, b: np.ndarray, score_a: np.ndarray, names: list[str], anchor: str,
         rounds: int = 1000, seed: int = 0, l2: float = 0.01) -> Ratings:
    """Elo ratings with 95% bootstrap intervals from battles (a[i] vs b[i], score_a[i] in {1, .5, 0})."""
    k, anchor_i = len(names), names.index(anchor)
    w = win_matrix(a, b, score_a, k)
    elo = to_elo(fit_strengths(w, l2), anchor_i)
    # Bootstrap: the battles fall into cells (a, b, outcome); resampling N battles with replacement is
    # one multinomial draw over the cells with the observed frequencies.
    cells, counts = np.unique(np.stack([a, b, score_a * 2]), axis=1, return_counts=True)
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(len(a), counts / counts.sum(), size=rounds)  # [R, C]
    ca, cb, cs = cells[0].astype(int), cells[1].astype(int), cells[2] / 2
    wb = np.zeros((rounds, k, k))
    for c in range(cells.shape[1]):
        wb[:, ca[c], cb[c]] += draws[:, c] * cs[c]
        wb[:, cb[c], ca[c]] += draws[:, c] * (1 - cs[c])
    boot = to_elo(fit_strengths(wb, l2), anchor_i)
    n = w + w.T
    with np.errstate(invalid="ignore", divide="ignore"):
        win_rate = np.where(n > 0, w / n, np.nan)
    return Ratings(names, elo, np.percentile(boot, 2.5, axis=0), np.percentile(boot, 97.5, axis=0), n, win_rate)


def paired_accuracy_diff(correct_a: np.ndarray, correct_b: np.ndarray, rounds: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """Mean accuracy difference (a - b) on the same prompts and its 95% paired-bootstrap interval.
    correct_a, correct_b: [P] 0/1 per prompt, aligned by prompt."""
    d = np.asarray(correct_a, float) - np.asarray(correct_b, float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(d), size=(rounds, len(d)))
    means = d[idx].mean(axis=1)
    return float(d.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))
