"""A chat message as hashed n-grams, and a regularised logistic model on them: P(approved | text).

What must hold, and why:

- **The same text gives the same features on every machine and every run.** Words and n-grams are hashed
  with CRC-32 (`zlib.crc32`: specified, not salted like Python's `hash`), into `2**bits` buckets with a
  sign from a second bit of the hash (Weinberger et al. 2009, "Feature Hashing for Large Scale Multitask
  Learning": the signed hash keeps inner products unbiased under collisions). A model stores its hashing
  settings beside its weights, so a stored model scores exactly as it was fitted.
- **Scoring is pure Python and cheap**: a follow-up of twenty words is about forty dictionary look-ups, so
  the stream and the batch recompute score it with the same function and agree to the bit
  (bench/chat_reward_auc.py measures it against VADER, the chat rules' sentiment).
- **Few labels shrink toward a prior, not toward noise.** The fit minimises the log-loss plus
  `l2 / 2 * ||w - w_prior||^2`; `w_prior` is zero (a new product with only the base rate) or another
  surface's fitted weights (`prior=`), so a surface with a handful of reactions starts from what the
  general model knows and moves only as far as its own reactions say.

The fitted model is a frozen value that serialises to JSON (only non-zero weights), so it can sit inside a
versioned reward definition.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[?!]")
_KEEP_WEIGHT = 1e-6  # weights smaller than this are dropped when stored: they change no score we report
# At most this many weights are kept (the largest in magnitude): a model sits in every worker and in Redis, so
# its size is bounded whatever the number of reactions (about 2 MB of JSON).
MAX_WEIGHTS = 1 << 16


@dataclass(frozen=True)
class Hashing:
    """How a text becomes features: word n-grams up to `word_ngrams`, optionally character n-grams of
    lengths `char_ngrams` (inside word boundaries), hashed into `2**bits` signed buckets.

    >>> h = Hashing(bits=10)
    >>> h.features("Thanks, that works!") == h.features("thanks that works !")
    True
    >>> len(h.features(""))
    0
    """

    bits: int = 18
    word_ngrams: int = 2
    char_ngrams: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if not 8 <= self.bits <= 24:
            raise ValueError(f"bits must be in [8, 24]; got {self.bits}")
        if self.word_ngrams < 1:
            raise ValueError(f"word_ngrams must be at least 1; got {self.word_ngrams}")
        lo, hi = self.char_ngrams
        if (lo, hi) != (0, 0) and not 1 <= lo <= hi:
            raise ValueError(f"char_ngrams must be (0, 0) or (lo, hi) with 1 <= lo <= hi; got {self.char_ngrams}")

    def grams(self, text: str) -> list[str]:
        tokens = _TOKEN.findall(text.lower())
        out = list(tokens)
        for n in range(2, self.word_ngrams + 1):
            out.extend(" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
        lo, hi = self.char_ngrams
        if lo:
            for tok in tokens:
                padded = f"<{tok}>"
                for n in range(lo, hi + 1):
                    out.extend("#" + padded[i : i + n] for i in range(len(padded) - n + 1))
        return out

    def features(self, text: str) -> dict[int, float]:
        """Bucket -> value: signed counts, log-damped (1 + log c) and scaled to unit length."""
        mask = (1 << self.bits) - 1
        counts: dict[int, float] = {}
        for g in self.grams(text):
            h = zlib.crc32(g.encode())
            sign = 1.0 if h & (1 << 31) else -1.0
            counts[h & mask] = counts.get(h & mask, 0.0) + sign
        out = {k: math.copysign(1.0 + math.log(abs(v)), v) for k, v in counts.items() if v}
        norm = math.sqrt(sum(v * v for v in out.values()))
        return {k: v / norm for k, v in out.items()} if norm else {}

    def matrix(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`texts` as a sparse (rows, cols, values) triple, rows in order."""
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for i, t in enumerate(texts):
            for k, v in self.features(t).items():
                rows.append(i)
                cols.append(k)
                vals.append(v)
        return np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64), np.asarray(vals)

    def to_json(self) -> dict[str, Any]:
        return {"bits": self.bits, "word_ngrams": self.word_ngrams, "char_ngrams": list(self.char_ngrams)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Hashing:
        lo, hi = raw.get("char_ngrams", (0, 0))
        return cls(int(raw["bits"]), int(raw["word_ngrams"]), (int(lo), int(hi)))


def _sigmoid(z: float) -> float:
    z = min(35.0, max(-35.0, z))
    return 1.0 / (1.0 + math.exp(-z))


@dataclass(frozen=True)
class TextModel:
    """P(approved | text) = sigmoid(intercept + sum_k w_k x_k(text)), x from `hashing`.

    >>> texts = ["thanks, perfect", "great, that works", "no, that is wrong", "wrong again, useless"] * 5
    >>> m = TextModel.fit(texts, [1, 1, 0, 0] * 5, Hashing(bits=10), l2=0.1)
    >>> m.predict_one("perfect, thanks") > 0.5 > m.predict_one("that is wrong")
    True
    >>> TextModel.from_json(m.to_json()) == m
    True
    >>> len(TextModel.fit(texts, [1, 1, 0, 0] * 5, Hashing(bits=10), max_weights=3).weights)
    3
    """

    hashing: Hashing
    intercept: float
    weights: Mapping[int, float] = field(default_factory=dict)
    n_train: int = 0

    def __hash__(self) -> int:  # `weights` is a dict; a definition holding this model stays hashable
        return hash((self.hashing, self.intercept, self.n_train, len(self.weights)))

    def logit(self, text: str) -> float:
        w = self.weights
        return self.intercept + sum(w.get(k, 0.0) * v for k, v in self.hashing.features(text).items())

    def predict_one(self, text: str) -> float:
        return _sigmoid(self.logit(text))

    def predict(self, texts: Sequence[str]) -> np.ndarray:
        return np.array([self.predict_one(t) for t in texts])

    def sentiment(self, text: str) -> float:
        """On the follow-up sentiment's scale, [-1, 1]: 2 P(approved) - 1."""
        return 2.0 * self.predict_one(text) - 1.0

    @classmethod
    def fit(
        cls,
        texts: Sequence[str],
        labels: Sequence[int] | np.ndarray,
        hashing: Hashing | None = None,
        *,
        l2: float = 1.0,
        prior: TextModel | None = None,
        max_iter: int = 500,
        max_weights: int = MAX_WEIGHTS,
    ) -> TextModel:
        """Minimise sum of log-losses + l2 / 2 * ||w - w_prior||^2 (the intercept is not penalised) by
        L-BFGS over the buckets the texts use. `prior` (same hashing) gives `w_prior` and the starting point."""
        from scipy.optimize import minimize
        from scipy.sparse import csr_matrix

        hashing = prior.hashing if prior is not None and hashing is None else hashing or Hashing()
        if prior is not None and prior.hashing != hashing:
            raise ValueError("a prior must hash texts the same way as the model fitted over it")
        y = np.asarray(labels, dtype=np.float64)
        if len(texts) != len(y) or len(y) == 0:
            raise ValueError(f"need as many labels as texts, at least one; got {len(texts)} and {len(y)}")
        if not l2 > 0:
            raise ValueError(f"l2 must be positive; got {l2}")
        rows, cols, vals = hashing.matrix(texts)
        prior_w = dict(prior.weights) if prior is not None else {}
        used = np.unique(np.concatenate([cols, np.fromiter(prior_w, dtype=np.int64, count=len(prior_w))]))
        x = csr_matrix((vals, (rows, np.searchsorted(used, cols))), shape=(len(y), len(used)))
        w0 = np.array([prior_w.get(int(k), 0.0) for k in used])
        rate = (y.sum() + 0.5) / (len(y) + 1.0)  # the base rate, kept off 0 and 1
        b0 = prior.intercept if prior is not None else math.log(rate / (1.0 - rate))

        def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
            b, w = theta[0], theta[1:]
            z = b + x @ w  # (n,)
            # log(1 + e^z) - y z, computed stably
            nll = float(np.sum(np.logaddexp(0.0, z) - y * z))
            p = 1.0 / (1.0 + np.exp(-np.clip(z, -35.0, 35.0)))
            d = w - w0
            grad = np.concatenate([[np.sum(p - y)], x.T @ (p - y) + l2 * d])
            return nll + 0.5 * l2 * float(d @ d), grad

        res = minimize(loss, np.concatenate([[b0], w0]), jac=True, method="L-BFGS-B",
                       options={"maxiter": max_iter, "gtol": 1e-6})  # fmt: skip
        b, w = float(res.x[0]), res.x[1:]
        weights = {int(k): float(v) for k, v in zip(used, w, strict=True) if abs(v) >= _KEEP_WEIGHT}
        if len(weights) > max_weights:
            kept = sorted(weights, key=lambda k: (-abs(weights[k]), k))[:max_weights]
            weights = {k: weights[k] for k in sorted(kept)}
        return cls(hashing, b, weights, len(y))

    def to_json(self) -> dict[str, Any]:
        return {
            "hashing": self.hashing.to_json(),
            "intercept": self.intercept,
            "weights": {str(k): v for k, v in sorted(self.weights.items())},
            "n_train": self.n_train,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> TextModel:
        return cls(
            Hashing.from_json(raw["hashing"]),
            float(raw["intercept"]),
            {int(k): float(v) for k, v in raw["weights"].items()},
            int(raw.get("n_train", 0)),
        )
