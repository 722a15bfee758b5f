"""Writes tests/golden/gbstats_values.json: fixed inputs and GrowthBook gbstats 0.8.0's own outputs.

Needs gbstats 0.8.0 (and numpy), which the project does not depend on; not run in CI. Regenerate with

    python3 -m venv /tmp/gbvenv && /tmp/gbvenv/bin/pip install gbstats==0.8.0
    /tmp/gbvenv/bin/python tests/golden/gbstats_values.py

The inputs are stored as per-arm sufficient statistics (users, sums, sums of squares and of products), so
the tests rebuild them without this script or numpy's generator. `tests/test_rollout_gbstats.py` compares
the rollout's statistics with the stored outputs. Cases:

- `ratio`: a ratio metric Σy/Σx over users (reward per generation, clustered users: a few heavy users with
  about 200 generations, the rest about 5): each arm's `RatioStatistic` mean and per-user variance, the
  fixed-sample `TwoSidedTTest` (Welch's t) and the `SequentialTwoSidedTTest` (confidence sequence and
  sequential p-value) at the α and N* pairs the rollout uses.
- `cuped`: a mean metric with each user's pre-experiment value (`RegressionAdjustedStatistic`): the same
  tests, once with gbstats' own slope θ (`compute_theta`, a regression over both arms pooled) and once with
  the rollout's (the within-arm pooled slope), put in place of gbstats' after the test is built.
- `welch`: a mean metric without a covariate (`SampleMeanStatistic`), and `srm`: gbstats' chi-square SRM.
- `degenerate`: users with identical values: gbstats answers "no decision" (p = 1).

Every case also holds the Bayesian engine's `risk` (`EffectBayesianABTest`, absolute difference, its
default flat prior): the expected loss of keeping the control and of shipping the treatment.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import numpy as np
from gbstats.bayesian.tests import EffectBayesianABTest, EffectBayesianConfig
from gbstats.frequentist.tests import (
    FrequentistConfig,
    SequentialConfig,
    SequentialTwoSidedTTest,
    TwoSidedTTest,
)
from gbstats.models.statistics import (
    RatioStatistic,
    RegressionAdjustedStatistic,
    SampleMeanStatistic,
)
from gbstats.utils import check_srm

OUT = Path(__file__).with_name("gbstats_values.json")
# (α, N*): the primary metric's two-sided α (0.05 / 2), the defaults, the demo's N*, one guardrail's α.
SEQUENTIAL = [(0.05, 5000.0), (0.025, 5000.0), (0.025, 100.0), (0.003125, 5000.0)]


def _ratio_moments(rng: np.random.Generator, n: int, p: float) -> dict[str, float]:
    heavy = rng.random(n) < 0.03
    x = np.where(heavy, rng.poisson(200, n), 1 + rng.poisson(4, n)).astype(float)
    acc = rng.binomial(x.astype(int), rng.beta(p * 10, (1 - p) * 10, n))
    y = 0.75 * acc - 0.25 * (x - acc)
    return {"n": n, "sx": x.sum(), "sy": y.sum(), "sxx": (x * x).sum(), "syy": (y * y).sum(), "sxy": (x * y).sum()}


def _ratio_stat(m: dict[str, float]) -> RatioStatistic:
    return RatioStatistic(
        n=int(m["n"]),
        m_statistic=SampleMeanStatistic(n=int(m["n"]), sum=m["sy"], sum_squares=m["syy"]),
        d_statistic=SampleMeanStatistic(n=int(m["n"]), sum=m["sx"], sum_squares=m["sxx"]),
        m_d_sum_of_products=m["sxy"],
    )


def _tests(make_a, make_b, theta: float | None = None) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Fixed and sequential results; `theta`: put in place of gbstats' own slope after the test is built."""

    def built(test):  # type: ignore[no-untyped-def]
        if theta is not None:
            test.stat_a.theta = theta
            test.stat_b.theta = theta
        return test

    fixed = built(TwoSidedTTest(make_a(), make_b(), FrequentistConfig(difference_type="absolute", alpha=0.05)))
    out: dict[str, object] = {
        "estimate": float(fixed.point_estimate), "variance": float(fixed.variance), "dof": float(fixed.dof),
        "fixed_ci": [float(v) for v in fixed.confidence_interval], "fixed_p": float(fixed.p_value),
        "theta": float(fixed.stat_a.theta) if hasattr(fixed.stat_a, "theta") else None,
        "arm_mean": [float(fixed.stat_a.mean), float(fixed.stat_b.mean)],
        "arm_variance": [float(fixed.stat_a.variance), float(fixed.stat_b.variance)],
        "sequential": [],
    }  # fmt: skip
    for alpha, tuning in SEQUENTIAL:
        cfg = SequentialConfig(difference_type="absolute", alpha=alpha, sequential_tuning_parameter=tuning)
        seq = built(SequentialTwoSidedTTest(make_a(), make_b(), cfg))
        out["sequential"].append(  # type: ignore[attr-defined]
            {
                "alpha": alpha,
                "tuning": tuning,
                "ci": [float(v) for v in seq.confidence_interval],
                "p": float(seq.p_value),
            }  # fmt: skip
        )
    # The Bayesian engine's risk with its default flat (improper) prior: [keep the control, ship the treatment].
    bayes = built(EffectBayesianABTest(make_a(), make_b(), EffectBayesianConfig(difference_type="absolute")))
    res = bayes.compute_result()
    out["risk"] = [float(v) for v in res.risk]
    out["bayes_mean"], out["bayes_sd"] = float(bayes.mean_diff), float(bayes.std_diff)
    return out


def ratio_cases() -> list[dict[str, object]]:
    cases = []
    for seed, (na, nb), (pa, pb) in ((1, (1000, 1000), (0.35, 0.35)), (2, (3000, 1000), (0.35, 0.32)),
                                     (3, (1500, 1600), (0.30, 0.40))):  # fmt: skip
        rng = np.random.default_rng(seed)
        a, b = _ratio_moments(rng, na, pa), _ratio_moments(rng, nb, pb)
        cases.append({"arms": [a, b], **_tests(lambda a=a: _ratio_stat(a), lambda b=b: _ratio_stat(b))})
    return cases


def _cuped_moments(rng: np.random.Generator, n: int, lift: float) -> dict[str, float]:
    z = rng.gamma(2.0, 1.0, n)  # the pre-experiment value: skewed, as per-user activity is
    y = 0.5 + lift + 0.7 * z + rng.normal(0, 1.0, n)
    return {"n": n, "sy": y.sum(), "syy": (y * y).sum(), "sz": z.sum(), "szz": (z * z).sum(), "syz": (y * z).sum()}


def _ra_stat(m: dict[str, float]) -> RegressionAdjustedStatistic:
    n = int(m["n"])
    return RegressionAdjustedStatistic(
        n=n, post_statistic=SampleMeanStatistic(n=n, sum=m["sy"], sum_squares=m["syy"]),
        pre_statistic=SampleMeanStatistic(n=n, sum=m["sz"], sum_squares=m["szz"]),
        post_pre_sum_of_products=m["syz"], theta=0,
    )  # fmt: skip


def _within_arm_theta(a: dict[str, float], b: dict[str, float]) -> float:
    """The rollout's slope: within-arm covariances and variances, pooled over the arms."""
    cov = sum(m["syz"] - m["sy"] * m["sz"] / m["n"] for m in (a, b))
    var = sum(m["szz"] - m["sz"] ** 2 / m["n"] for m in (a, b))
    return cov / var


def cuped_cases() -> list[dict[str, object]]:
    cases = []
    for seed, (na, nb), lift in ((4, (1000, 1000), 0.0), (5, (2000, 800), 0.1), (6, (300, 300), 0.3)):
        rng = np.random.default_rng(seed)
        a, b = _cuped_moments(rng, na, 0.0), _cuped_moments(rng, nb, lift)
        own = _tests(lambda a=a: _ra_stat(a), lambda b=b: _ra_stat(b))
        project = _tests(lambda a=a: _ra_stat(a), lambda b=b: _ra_stat(b), theta=_within_arm_theta(a, b))
        unadjusted = _tests(lambda a=a: _mean_stat(a), lambda b=b: _mean_stat(b))
        cases.append({"arms": [a, b], "gbstats_theta": own, "within_arm_theta": project, "unadjusted": unadjusted})
    return cases


def _mean_stat(m: dict[str, float]) -> SampleMeanStatistic:
    return SampleMeanStatistic(n=int(m["n"]), sum=m["sy"], sum_squares=m["syy"])


def degenerate() -> dict[str, object]:
    a = {"n": 2, "sy": 1.0, "syy": 0.5}
    b = {"n": 2, "sy": 2.0, "syy": 2.0}  # two users with reward 1 each, against two with 0.5
    cfg = SequentialConfig(difference_type="absolute", alpha=0.05, sequential_tuning_parameter=5000)
    res = SequentialTwoSidedTTest(_mean_stat(a), _mean_stat(b), cfg).compute_result()
    return {"arms": [a, b], "p": float(res.p_value), "ci": [float(v) for v in res.ci], "error": res.error_message}


def main() -> None:
    splits = (([480, 520], [0.5, 0.5]), ([1800, 2200], [0.5, 0.5]), ([7400, 2600], [0.75, 0.25]))
    srm = [{"users": u, "weights": w, "p": float(check_srm(u, w))} for u, w in splits]
    welch = []
    for seed, n in ((7, 500), (8, 5000)):
        rng = np.random.default_rng(seed)
        a, b = _cuped_moments(rng, n, 0.0), _cuped_moments(rng, n, 0.05)
        welch.append({"arms": [a, b], **_tests(lambda a=a: _mean_stat(a), lambda b=b: _mean_stat(b))})
    data = {
        "gbstats": version("gbstats"), "generator": "tests/golden/gbstats_values.py",
        "ratio": ratio_cases(), "cuped": cuped_cases(), "welch": welch, "srm": srm, "degenerate": degenerate(),
    }  # fmt: skip
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
