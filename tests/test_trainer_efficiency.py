"""bench/trainer_efficiency.py's pure parts: the signals' reward of a simulated reaction, and the measures."""

import numpy as np
import pytest

from simulator.populations import Reaction
from tests.helpers import bench_module


def _bench():  # type: ignore[no-untyped-def]
    return bench_module("trainer_efficiency")


@pytest.mark.parametrize(
    ("reaction", "text", "finish", "reward"),
    [
        (Reaction(shown=True, accepted=True, kept=True), "x = 1", "stop", 0.75),
        (Reaction(shown=True, accepted=True, kept=True, retained=True), "x = 1", "stop", 0.75),
        (Reaction(shown=True, accepted=True, kept=False), "x = 1", "stop", -0.10),
        (Reaction(shown=True), "x = 1", "stop", -0.25),
        (Reaction(shown=True, thumbs="up"), "x = 1", "stop", 1.0),
        (Reaction(shown=False), "", "declined", 0.0),
    ],
)
def test_a_reaction_gets_the_default_reward_definitions_reward(reaction, text, finish, reward) -> None:  # type: ignore[no-untyped-def]
    assert _bench().signals_reward(reaction, text, finish) == pytest.approx(reward)


def test_the_frontier_at_no_kl_is_the_base_and_a_candidate_equal_to_the_base_gains_nothing() -> None:
    b = _bench()
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, (20, 4))
    base = b.Judged(p, np.ones_like(p), rng.integers(1, 17, p.shape).astype(float))
    assert b.frontier_accept(base, 0.0) == base.accept()
    assert b.frontier_accept(base, 0.05) > base.accept()
    assert b.relative_gain_interval(base, base) == (0.0, 0.0, 0.0)
    assert b.share(0.05, 0.1) == pytest.approx(0.5) and b.share(0.05, 0.0) is None
