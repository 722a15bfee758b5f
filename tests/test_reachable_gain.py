"""The tilt, KL and promotion-chain math of bench/reachable_gain.py, on a seeded toy sample."""

import numpy as np
import pytest

from tests.helpers import bench_module


def _bench():  # type: ignore[no-untyped-def]
    return bench_module("reachable_gain")


@pytest.fixture(scope="module")
def toy():  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, (30, 16))
    shown = (rng.uniform(size=p.shape) > 0.1).astype(float)
    return shown * (p - 0.25), p, shown, rng.integers(1, 17, p.shape).astype(float)


def test_the_untilted_policy_is_the_base_and_more_tilt_costs_more_kl_for_more_reward(toy) -> None:  # type: ignore[no-untyped-def]
    b = _bench()
    reward, _, _, lengths = toy
    base = b.log_tilt(reward, 0.0)
    assert b.kl_per_token(base, base, lengths) == 0.0
    lams = [0.0, 0.5, 2.0, 8.0, np.inf]
    kls = [b.kl_per_token(b.log_tilt(reward, lam), base, lengths) for lam in lams]
    rewards = [b.mean_reward(b.log_tilt(reward, lam), reward) for lam in lams]
    assert all(np.diff(kls) > 0) and all(np.diff(rewards) > 0)
    # best-of-N: each context keeps its best sample, at most log N nats a context
    assert rewards[-1] == pytest.approx(reward.max(axis=1).mean())


def test_each_promotion_of_the_chain_stays_within_the_bound_of_the_one_before(toy) -> None:  # type: ignore[no-untyped-def]
    b = _bench()
    reward, p, shown, lengths = toy
    lams = b.promotion_chain(reward, lengths, 0.05, 5)
    assert lams == sorted(lams) and lams[0] > 0
    tilts = [b.log_tilt(reward, lam) for lam in [0.0, *lams]]
    steps = [b.kl_per_token(new, old, lengths) for old, new in zip(tilts, tilts[1:], strict=False)]
    assert all(kl <= 0.05 + 1e-9 for kl in steps) and steps[0] == pytest.approx(0.05, rel=1e-3)
    accepts = [b.accept_rate(w, p, shown) for w in tilts]
    assert accepts == sorted(accepts)
