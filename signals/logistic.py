"""Logistic regression and the two quality figures we report for it (numpy only).

Small on purpose: a handful of implicit signals predicting a thumbs-up. Fitted by
Newton's method (IRLS) with an L2 penalty, on standardised features; the fitted
model is a frozen value that serialises to JSON, so it can live inside a
versioned reward definition.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -35.0, 35.0)))


@dataclass(frozen=True)
class LogisticModel:
    """P(satisfied | signals) = sigmoid(intercept + sum_i coef_i * (x_i - mean_i) / scale_i)."""

    features: tuple[str, ...]
    coef: tuple[float, ...]
    intercept: float
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    fill: tuple[float, ...]  # value used for a signal that was not observed (its training mean when observed)

    def __post_init__(self) -> None:
        n = len(self.features)
        if not (len(self.coef) == len(self.mean) == len(self.scale) == len(self.fill) == n):
            raise ValueError("features, coef, mean, scale and fill must have the same length")

    @classmethod
    def fit(
        cls, x: np.ndarray, y: np.ndarray, features: Sequence[str], l2: float = 1e-2, max_iter: int = 50
    ) -> LogisticModel:
        """Fit on `x` (n, d), NaN where a signal was not observed, and labels `y` (n,) in {0, 1}."""
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] != y.shape[0] or x.shape[1] != len(features):
            raise ValueError(f"x must be (n, {len(features)}) and y (n,); got {x.shape} and {y.shape}")
        if x.shape[0] == 0:
            raise ValueError("cannot fit on zero rows")
        observed = ~np.isnan(x)
        # a column given with NaNs is "sometimes unmeasured": fill with its observed mean; any other
        # column treats a missing signal as 0 (an indicator that did not fire)
        observed_mean = np.nansum(x, axis=0) / np.maximum(observed.sum(axis=0), 1)
        fill = np.where((~observed).any(axis=0), observed_mean, 0.0)
        x = np.where(observed, x, fill)
        mean = x.mean(axis=0)
        scale = x.std(axis=0)
        scale[scale < 1e-9] = 1.0  # a constant feature contributes nothing; avoid dividing by 0
        z = np.hstack([np.ones((x.shape[0], 1)), (x - mean) / scale])  # (n, d+1)
        w = np.zeros(z.shape[1])
        penalty = np.full(z.shape[1], l2 * x.shape[0])
        penalty[0] = 0.0  # the intercept is not shrunk
        for _ in range(max_iter):
            p = _sigmoid(z @ w)
            grad = z.T @ (p - y) + penalty * w
            hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(penalty) + 1e-9 * np.eye(z.shape[1])
            step = np.linalg.solve(hess, grad)
            w -= step
            if np.max(np.abs(step)) < 1e-8:
                break
        return cls(
            tuple(features),
            tuple(float(v) for v in w[1:]),
            float(w[0]),
            tuple(float(v) for v in mean),
            tuple(float(v) for v in scale),
            tuple(float(v) for v in fill),
        )

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        x = np.where(np.isnan(x), np.array(self.fill), x)
        return _sigmoid(
            self.intercept + ((x - np.array(self.mean)) / np.array(self.scale)) @ np.array(self.coef)
        )

    def predict_one(self, signals: Mapping[str, float]) -> float:
        """P(satisfied) for one record's signals. Pure Python, so stream and batch agree to the bit."""
        z = self.intercept
        for name, c, m, s, f in zip(self.features, self.coef, self.mean, self.scale, self.fill, strict=True):
            z += c * (float(signals.get(name, f)) - m) / s
        z = min(35.0, max(-35.0, z))
        return 1.0 / (1.0 + math.exp(-z))

    def to_json(self) -> dict[str, Any]:
        return {
            "features": list(self.features),
            "coef": list(self.coef),
            "intercept": self.intercept,
            "mean": list(self.mean),
            "scale": list(self.scale),
            "fill": list(self.fill),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> LogisticModel:
        return cls(
            tuple(raw["features"]),
            tuple(raw["coef"]),
            float(raw["intercept"]),
            tuple(raw["mean"]),
            tuple(raw["scale"]),
            tuple(raw["fill"]),
        )


def roc_auc(y: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); NaN with one class."""
    y = np.asarray(y).astype(bool)
    score = np.asarray(score, dtype=np.float64)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    sorted_scores = score[order]
    # average ranks over ties (1-based)
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def expected_calibration_error(y: np.ndarray, prob: np.ndarray, bins: int = 10) -> float:
    """ECE with equal-width bins: sum_b (n_b / n) * |mean(y_b) - mean(p_b)| (Naeini et al., 2015)."""
    y = np.asarray(y, dtype=np.float64)
    prob = np.asarray(prob, dtype=np.float64)
    if len(y) == 0:
        return float("nan")
    idx = np.minimum((prob * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        mask = idx == b
        if mask.any():
            total += mask.sum() / len(y) * abs(y[mask].mean() - prob[mask].mean())
    return float(total)
