"""Off-policy estimates of a target policy's mean reward from another policy's logged traffic.

Logged sample i: a context x_i, the action a_i the behaviour policy mu chose, its reward r_i,
and the log importance weight log w_i = log pi(a_i|x_i) - log mu(a_i|x_i) (for a completion: the
sum over its tokens of the candidate's minus the logged behaviour log-probs).

- Self-normalised importance sampling (SNIPS; Swaminathan & Joachims 2015):
      V_SNIPS = sum_i w_i r_i / sum_i w_i
- Doubly robust (Dudik, Langford & Li 2011), self-normalised correction term:
      V_DR = mean_i qhat(x_i, pi) + sum_i w_i (r_i - qhat(x_i, a_i)) / sum_i w_i
  where qhat is a reward model and qhat(x, pi) its expectation under pi. It is unbiased when
  either the weights or qhat are right, and has less variance than SNIPS when qhat is good.
- Effective sample size (Kish): ESS = (sum w)^2 / sum w^2, in [1, n]; a few huge weights mean
  the logged traffic says little about pi.
- Intervals: a seeded percentile bootstrap over logged samples (and, for DR, independently over
  the samples behind the direct-method term, or on the same draws when that term is paired: the
  target's completion of each logged context). The difference DR - (the behaviour's logged mean)
  is bootstrapped on the same resamples, so the noise both share cancels: a target close to the
  behaviour gets a tight interval around 0.

What must hold: weights are handled in log space (shifted by their maximum) so sequence-level
ratios of long completions never overflow; the same seed gives the same interval.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

Floats = NDArray[np.float64]


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its bootstrap interval."""

    value: float
    ci: tuple[float, float]


@dataclass(frozen=True)
class OffPolicyEstimate:
    n: int
    ess: float
    snips: Estimate
    dr: Estimate
    behaviour_mean: float  # the logged rewards' plain mean: the behaviour policy's own value
    dr_minus_behaviour: Estimate  # DR - behaviour mean, bootstrapped on the same resamples (paired)


def _weights(log_w: ArrayLike) -> Floats:
    lw = np.asarray(log_w, dtype=np.float64)
    if lw.ndim != 1 or lw.size == 0:
        raise ValueError("log_w must be a non-empty 1-d array")
    if not np.all(np.isfinite(lw)):
        raise ValueError("log_w holds NaN or infinite values")
    return np.exp(lw - lw.max())  # SNIPS, DR's correction and ESS are invariant to the scale


def effective_sample_size(log_w: ArrayLike) -> float:
    w = _weights(log_w)
    return float(w.sum() ** 2 / np.square(w).sum())


def snips(rewards: ArrayLike, log_w: ArrayLike) -> float:
    w = _weights(log_w)
    r = np.asarray(rewards, dtype=np.float64)
    return float(np.dot(w, r) / w.sum())


def doubly_robust(rewards: ArrayLike, log_w: ArrayLike, q_logged: ArrayLike, q_target: ArrayLike) -> float:
    """`q_logged[i]` = qhat(x_i, a_i); `q_target` = samples of qhat(x, pi) (their mean is the DM term)."""
    w = _weights(log_w)
    r = np.asarray(rewards, dtype=np.float64)
    q = np.asarray(q_logged, dtype=np.float64)
    dm = float(np.mean(np.asarray(q_target, dtype=np.float64)))
    return dm + float(np.dot(w, r - q) / w.sum())


def estimate(
    rewards: ArrayLike,
    log_w: ArrayLike,
    q_logged: ArrayLike,
    q_target: ArrayLike,
    *,
    bootstrap_samples: int = 500,
    confidence: float = 0.95,
    seed: int = 0,
    paired: bool = False,
) -> OffPolicyEstimate:
    """SNIPS and DR with seeded percentile-bootstrap intervals, and the ESS.

    `paired`: `q_target[i]` is qhat of the target's completion of logged context i, so each resample
    draws the same contexts for both terms and the contexts' own spread cancels in DR - the logged mean.
    """
    r = np.asarray(rewards, dtype=np.float64)
    lw = np.asarray(log_w, dtype=np.float64)
    q = np.asarray(q_logged, dtype=np.float64)
    qt = np.asarray(q_target, dtype=np.float64)
    if not (r.shape == lw.shape == q.shape) or r.ndim != 1:
        raise ValueError("rewards, log_w and q_logged must be 1-d arrays of the same length")
    if qt.ndim != 1 or qt.size == 0:
        raise ValueError("q_target must be a non-empty 1-d array")
    if paired and qt.shape != r.shape:
        raise ValueError("paired: q_target needs one value per logged sample")
    rng = np.random.default_rng(seed)
    n, m = r.size, qt.size
    boot_snips = np.empty(bootstrap_samples)
    boot_dr = np.empty(bootstrap_samples)
    boot_diff = np.empty(bootstrap_samples)
    for b in range(bootstrap_samples):
        idx = rng.integers(0, n, n)
        jdx = idx if paired else rng.integers(0, m, m)
        boot_snips[b] = snips(r[idx], lw[idx])
        boot_dr[b] = doubly_robust(r[idx], lw[idx], q[idx], qt[jdx])
        boot_diff[b] = boot_dr[b] - r[idx].mean()
    tail = (1.0 - confidence) / 2 * 100

    def interval(samples: Floats) -> tuple[float, float]:
        low, high = np.percentile(samples, [tail, 100 - tail])
        return float(low), float(high)

    dr = doubly_robust(r, lw, q, qt)
    return OffPolicyEstimate(
        n=n,
        ess=effective_sample_size(lw),
        snips=Estimate(snips(r, lw), interval(boot_snips)),
        dr=Estimate(dr, interval(boot_dr)),
        behaviour_mean=float(r.mean()),
        dr_minus_behaviour=Estimate(dr - float(r.mean()), interval(boot_diff)),
    )


def fit_reward_model(features: ArrayLike, rewards: ArrayLike, ridge: float = 1e-3) -> Floats:
    """Ridge regression coefficients of rewards on `features` (one row per sample, a bias column added).

    Predict with `predict_reward(coef, features)`.
    """
    x = _with_bias(features)
    y = np.asarray(rewards, dtype=np.float64)
    gram = x.T @ x + ridge * np.eye(x.shape[1])
    return np.asarray(np.linalg.solve(gram, x.T @ y), dtype=np.float64)


def predict_reward(coef: Floats, features: ArrayLike) -> Floats:
    return np.asarray(_with_bias(features) @ coef, dtype=np.float64)


def _with_bias(features: ArrayLike) -> Floats:
    x = np.asarray(features, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    return np.hstack([np.ones((x.shape[0], 1)), x])
