"""The language-model gate: is the candidate's next-token log-loss within a margin of the champion's?

A paired comparison on the same tokens. Each held-out text window w (up to `text_window_tokens` tokens,
cut by the champion's tokenizer) gets, per policy, its mean token log-loss (negative log-likelihood, nats
per token); the statistic is the per-window difference d_w = loss_candidate(w) - loss_champion(w). Scoring
both policies on the same windows cancels what makes one window harder than another, so a few hundred
windows pin the mean difference down to a few thousandths of a nat.

Interval: the paired t-interval of the mean difference, mean(d) +- t_{n-1, (1+c)/2} * sd(d) / sqrt(n)
(Student's t on paired differences; e.g. Wasserman, "All of Statistics", 2004, section 10.1). Windows are
many and their differences close to normal in the bulk; a window is the unit, not a token, because tokens
within a window are correlated.

Non-inferiority, with a margin m in nats per token: a margin of m is a perplexity rise of exp(m) - 1
(0.05 nats/token is 5.1%, 0.10 is 10.5%). The verdict:
- passed: the interval's upper end < m (the candidate is no worse than m, with confidence c);
- failed: its lower end > m (significantly worse than the margin);
- undecided: the interval straddles m, or fewer than `min_windows` windows were scored. Recorded and
  shown, never blocking: a candidate too close to call is not refused on a point value, and the A/B
  test that follows measures what users see. The gate scores enough text that this is rare (a few
  hundred windows within its CPU budget); the drift bound below still refuses a slow slide.

Drift across promotions is bounded the same way against a reference (the lineage's first champion, the
base model), with its own, cumulative margin: each step may pass its own margin while the sum grows.

The windows are scored in a seeded random order until the CPU budget is spent, so what was scored is a
uniform sample of what was available, and the reason says how many windows decided it.

What must hold: the same windows, policies and seed give the same interval; a candidate equal to the
champion has every difference 0, an interval of (0, 0) and passes any margin > 0.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from flywheel.lm import Policy

Verdict = Literal["passed", "failed", "undecided"]
_MIN_WINDOW_TOKENS = 8


class Budget:
    """A CPU-seconds budget: `exhausted()` once `seconds` of `clock` (process CPU time) have passed since it was made.

    >>> ticks = iter(range(10))
    >>> b = Budget(2.0, clock=lambda: float(next(ticks)))  # the clock reads 0 at the start
    >>> [b.exhausted() for _ in range(3)], b.spent() >= 2.0
    ([False, True, True], True)
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.process_time) -> None:
        self.seconds = seconds
        self._clock = clock
        self._start = clock()

    def spent(self) -> float:
        return self._clock() - self._start

    def exhausted(self) -> bool:
        return self.spent() >= self.seconds


@dataclass(frozen=True)
class Window:
    ids: list[int]
    source: str  # "product" (held-out logged traffic) or "general" (held-out text)


def windows(policy: Policy, texts: Sequence[str], source: str, window_tokens: int) -> list[Window]:
    """The last `window_tokens` tokens of each text (the end holds a logged completion), skipping short ones."""
    limit = min(window_tokens, policy.context)
    out = []
    for text in texts:
        # Only the end is kept: cut by characters first (a token is rarely 6), so a long text is not tokenized whole.
        ids = list(policy.tokenizer(text[-limit * 6 :])["input_ids"])[-limit:]
        if len(ids) >= _MIN_WINDOW_TOKENS:
            out.append(Window(ids, source))
    return out


@torch.inference_mode()
def mean_loss(policy: Policy, ids: list[int]) -> float:
    """Mean next-token negative log-likelihood, in nats, over the window's tokens after the first."""
    inputs = torch.tensor([ids], device=policy.device)
    logits = policy.model(input_ids=inputs, use_cache=False).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, inputs[0, 1:, None])[:, 0]
    return float(-lp.mean())


@dataclass(frozen=True)
class Scored:
    """Per-window mean losses of the candidate and each comparison policy, on the windows scored."""

    candidate: np.ndarray  # (n,)
    others: dict[str, np.ndarray]  # name -> (n,)
    sources: list[str]  # (n,) where each scored window came from
    available: int  # windows there were to score

    @property
    def n(self) -> int:
        return int(self.candidate.size)


def score(
    candidate: Policy, others: dict[str, Policy], items: Sequence[Window], budget: Budget, seed: int
) -> Scored:
    """Score windows in a seeded random order with every policy until `budget` is spent (or all are scored):
    the scored ones are a uniform sample of `items`."""
    order = random.Random(seed).sample(range(len(items)), len(items))
    cand: list[float] = []
    rest: dict[str, list[float]] = {name: [] for name in others}
    sources = []
    for i in order:
        if budget.exhausted():
            break
        ids = items[i].ids
        cand.append(mean_loss(candidate, ids))
        for name, policy in others.items():
            rest[name].append(mean_loss(policy, ids))
        sources.append(items[i].source)
    return Scored(np.array(cand), {k: np.array(v) for k, v in rest.items()}, sources, len(items))


@dataclass(frozen=True)
class PairedComparison:
    """The mean per-window difference in log-loss (candidate - other), its interval and the verdict."""

    n: int
    mean: float
    ci: tuple[float, float]
    margin: float
    verdict: Verdict


def paired_interval(diffs: np.ndarray, confidence: float) -> tuple[float, tuple[float, float]]:
    """(mean, (low, high)): the paired t-interval of the mean of `diffs` (n >= 2).

    >>> m, (lo, hi) = paired_interval(np.array([0.01, 0.03, 0.02, 0.02]), 0.95)
    >>> round(m, 4), round(lo, 4), round(hi, 4)
    (0.02, 0.007, 0.033)
    """
    from scipy import stats

    n = diffs.size
    mean = float(diffs.mean())
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * float(diffs.std(ddof=1)) / math.sqrt(n)
    return mean, (mean - half, mean + half)


def non_inferiority(diffs: np.ndarray, margin: float, confidence: float, min_windows: int) -> PairedComparison:
    """The verdict on `diffs` (candidate - other, nats per token) against `margin` (see the module docstring).

    >>> rng = np.random.default_rng(0)
    >>> [non_inferiority(rng.normal(mu, 0.01, 200), 0.02, 0.95, 30).verdict for mu in (0.0, 0.05, 0.02)]
    ['passed', 'failed', 'undecided']
    """
    finite = diffs[np.isfinite(diffs)]
    if finite.size < max(2, min_windows) or finite.size < diffs.size:
        mean = float(finite.mean()) if finite.size and finite.size == diffs.size else math.nan
        return PairedComparison(int(diffs.size), mean, (math.nan, math.nan), margin, "undecided")
    mean, (low, high) = paired_interval(finite, confidence)
    verdict: Verdict = "passed" if high < margin else "failed" if low > margin else "undecided"
    return PairedComparison(int(diffs.size), mean, (low, high), margin, verdict)


def describe(cmp: PairedComparison, scored: Scored, other: str, confidence: float, spent: float) -> str:
    """The reason, in words: how many windows decided it (from where), the interval, and what was covered."""
    product = sum(s == "product" for s in scored.sources)
    rise = f"a perplexity rise of {math.expm1(cmp.mean):+.1%}" if math.isfinite(cmp.mean) else "no estimate"
    interval = (
        f"[{cmp.ci[0]:+.4f}, {cmp.ci[1]:+.4f}]" if math.isfinite(cmp.ci[0]) else "no interval (too few windows)"
    )
    return (
        f"{cmp.verdict}: candidate - {other} mean token log-loss {cmp.mean:+.4f} nats/token ({rise}), "
        f"{confidence:.0%} paired t-interval {interval} against a margin of {cmp.margin} nats/token "
        f"({math.expm1(cmp.margin):.1%} perplexity); decided by {scored.n} text windows ({product} from the "
        f"product's held-out traffic, {scored.n - product} general held-out text), {scored.n} of {scored.available} "
        f"available scored in {spent:.1f} CPU-s (a seeded uniform sample)"
    )
