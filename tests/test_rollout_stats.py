"""The rollout's statistics: published golden values, the unit of analysis, guardrails and flags on fixed data."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from deploy_gate.rollout.models import GuardrailView
from deploy_gate.stats import (
    RatioStats,
    RewardStats,
    check_srm,
    ratio_difference,
    sequential_interval,
    welch_difference,
)


def test_growthbook_golden_values() -> None:
    assert check_srm([1000, 1200], [0.5, 0.5]) == pytest.approx(2.0079e-05, rel=1e-4)
    d = welch_difference(RewardStats(3407, 1396.87, 52377.9767), RewardStats(3461, 2422.7, 134698.29))
    assert d is not None
    assert d.estimate == pytest.approx(0.29, abs=1e-9)
    assert d.ci == pytest.approx((0.04538, 0.53462), abs=5e-6)
    assert d.p_value == pytest.approx(0.02016, abs=5e-6)


def test_stats_merge_like_one_pass() -> None:
    rng = np.random.default_rng(3)
    units = [(float(k), float(rng.binomial(k, 0.4))) for k in 1 + rng.poisson(2, 300)]
    whole = RatioStats.of(units)
    parts = RatioStats.of(units[:100]) + RatioStats.of(units[100:250]) + RatioStats.of(units[250:])
    assert parts.ratio == pytest.approx(whole.ratio)
    assert parts.ratio_variance() == pytest.approx(whole.ratio_variance())


def test_per_user_interval_is_wider_than_per_generation_when_users_differ() -> None:
    """Correlated rewards within a user: the per-generation interval understates the uncertainty."""
    rng = np.random.default_rng(5)
    k = 1 + rng.poisson(8, 400)
    p = rng.beta(1, 1, 400)
    y = rng.binomial(k, p)
    per_user = RatioStats.of(zip(k.astype(float), y.astype(float), strict=True))
    rewards = np.concatenate([np.r_[np.ones(int(yi)), np.zeros(int(ki - yi))] for ki, yi in zip(k, y, strict=True)])
    per_gen = RewardStats.of(rewards.tolist())
    assert per_user.ratio == pytest.approx(per_gen.mean)
    var_gen = (per_gen.variance or 0) / per_gen.n
    assert (per_user.ratio_variance() or 0) > 2 * var_gen


def test_delta_method_matches_welch_with_one_generation_per_user() -> None:
    a = RatioStats.of([(1.0, float(v)) for v in [0, 1, 1, 0, 1, 0, 0, 1, 1, 1]])
    b = RatioStats.of([(1.0, float(v)) for v in [1, 1, 1, 0, 1, 1, 0, 1, 1, 1]])
    d = ratio_difference(a, b)
    assert d is not None
    assert d.estimate == pytest.approx(0.2)
    assert d.std_error == pytest.approx(math.sqrt(a.ratio_variance() + b.ratio_variance()))  # type: ignore[operator]


def test_sequential_interval_contains_the_fixed_one_and_narrows() -> None:
    d = ratio_difference(RatioStats.of([(1.0, 0.0), (1.0, 1.0)] * 200), RatioStats.of([(1.0, 0.0), (2.0, 2.0)] * 200))
    assert d is not None
    lo, hi = sequential_interval(d, 800)
    assert lo < d.ci[0] and hi > d.ci[1]
    widths = []
    for n in (100, 1000, 10000):
        se = 1 / math.sqrt(n)
        dd = type(d)(0.0, (-2 * se, 2 * se), 1.0, se)
        lo, hi = sequential_interval(dd, n)
        widths.append(hi - lo)
    assert widths == sorted(widths, reverse=True)


def test_a_reward_rise_with_falling_explicit_satisfaction_is_flagged() -> None:
    import polars as pl

    from deploy_gate.rollout import RolloutConfig
    from deploy_gate.rollout.analysis import StepContext, analyse
    from deploy_gate.rollout.data import USER_COLUMNS, Aggregates

    t0 = datetime(2026, 11, 25, tzinfo=UTC)
    rows = []
    for i in range(400):
        arm = "challenger" if i % 2 else "champion"
        # The challenger's implicit reward is higher, but its explicit votes are worse.
        reward, up = (0.7 * 4, 1) if arm == "challenger" else (0.5 * 4, 2)
        up -= i % 4 == 3  # users differ (identical users would have no variance: no evidence)
        rows.append({"arm": arm, "user_id": f"u{i}", "first_seen": t0, "generations": 4, "reward_n": 4,
                     "reward_sum": reward + (i % 7) * 0.05, "explicit_n": 2, "thumbs_up": up, "thumbs_down": 2 - up,
                     "shown": 4, "accepted": 2, "undone": 0, "declined": 0, "suggested": 4, "empty": 0, "truncated": 0,
                     "length_sum": 40.0})  # fmt: skip
    agg = Aggregates(pl.DataFrame(rows, schema=USER_COLUMNS), {"champion": 50.0, "challenger": 50.0},
                     {"champion": 800, "challenger": 800}, "rules-v1")  # fmt: skip
    step = StepContext(index=0, share=0.5, min_users=10, min_seconds=0, entered_at=t0, last=True)
    view = analyse(agg, step, RolloutConfig(), started_at=t0, now=t0 + timedelta(hours=1))
    assert view is not None and view.difference is not None and view.difference.estimate > 0
    assert [f.split(":")[0] for f in view.flags] == ["reward_up_explicit_down"]
    # ... and the explicit thumbs-up guardrail (a reward-hacking one) stops the promotion.
    assert {g.name for g in view.guardrails if not g.ok} == {"explicit_up_rate", "thumbs_down_rate"}
    assert view.decision.action == "rollback"


def _analyse_declines(challenger: dict[str, float]) -> list[GuardrailView]:
    """Guardrails of 400 users a side, each with 10 generations; the champion suggests all 10, accepts 3."""
    import polars as pl

    from deploy_gate.rollout import RolloutConfig
    from deploy_gate.rollout.analysis import StepContext, analyse
    from deploy_gate.rollout.data import USER_COLUMNS, Aggregates

    t0 = datetime(2026, 11, 25, tzinfo=UTC)
    champion: dict[str, float] = {
        "shown": 10, "accepted": 3, "declined": 0, "suggested": 10, "empty": 0, "length_sum": 100.0
    }  # fmt: skip
    rows = []
    for i in range(800):
        arm, counts = ("challenger", challenger) if i % 2 else ("champion", champion)
        # Users differ by one accept, one empty output and a few characters either way around the arm's
        # figures (identical users would have no variance, and no variance is no evidence).
        jitter = [0, 1, -1][(i // 2) % 3]
        varied = {**counts, "accepted": counts["accepted"] + jitter,
                  "empty": counts["empty"] + jitter if counts["empty"] else 0,
                  "length_sum": counts["length_sum"] + 2 * jitter}  # fmt: skip
        rows.append({"arm": arm, "user_id": f"u{i}", "first_seen": t0, "generations": 10, "reward_n": 10,
                     "reward_sum": 0.5 + (i % 5) * 0.1, "explicit_n": 0, "thumbs_up": 0, "thumbs_down": 0,
                     "undone": 0, "truncated": 0, **varied})  # fmt: skip
    agg = Aggregates(pl.DataFrame(rows, schema=USER_COLUMNS), {"champion": 50.0, "challenger": 50.0},
                     {"champion": 4000, "challenger": 4000}, "rules-v1")  # fmt: skip
    step = StepContext(index=0, share=0.5, min_users=10, min_seconds=0, entered_at=t0, last=True)
    view = analyse(agg, step, RolloutConfig(), started_at=t0, now=t0 + timedelta(hours=1))
    assert view is not None
    return view.guardrails


def test_declining_most_suggestions_trips_nothing_while_the_accepts_hold() -> None:
    # The challenger declines 6 of 10 and keeps its 3 accepts: no guardrail trips, the mean length of
    # what it suggests is the champion's, and its shown and decline rates are reported for information.
    rails = {g.name: g for g in _analyse_declines(
        {"shown": 4, "accepted": 3, "declined": 6, "suggested": 4, "empty": 0, "length_sum": 40.0})}  # fmt: skip
    assert [n for n, g in rails.items() if not g.ok] == []
    assert rails["mean_length_chars"].challenger == rails["mean_length_chars"].champion == 10.0
    assert (rails["declined_rate"].kind, rails["declined_rate"].champion, rails["declined_rate"].challenger) == (
        "info", 0.0, 0.6
    )
    assert (rails["shown_rate"].kind, rails["shown_rate"].challenger) == ("info", 0.4)


def test_completions_cut_at_max_tokens_are_shown_but_decide_nothing() -> None:
    # The challenger's lines are longer (1.3x, within the length drift bound) and 4 of its 10 are cut at
    # max_tokens where the champion's never are: reported, and nothing trips (it was the `error_rate`
    # guardrail, which rolled back every candidate on users nobody tuned for while no request failed).
    rails = {g.name: g for g in _analyse_declines(
        {"shown": 10, "accepted": 3, "declined": 0, "suggested": 10, "empty": 0, "length_sum": 130.0,
         "truncated": 4})}  # fmt: skip
    assert [n for n, g in rails.items() if not g.ok] == []
    assert (rails["truncated_rate"].kind, rails["truncated_rate"].champion, rails["truncated_rate"].challenger) == (
        "info", 0.0, 0.4
    )
    assert "error_rate" not in rails


def test_declining_that_costs_accepts_or_blank_outputs_trip_their_guardrails() -> None:
    fewer_accepts = _analyse_declines(
        {"shown": 4, "accepted": 2, "declined": 6, "suggested": 4, "empty": 0, "length_sum": 40.0}
    )
    assert [g.name for g in fewer_accepts if not g.ok] == ["accepted_rate"]
    # Nothing visible where it should have declined: empty outputs, which count as suggestions of length 0.
    blank = _analyse_declines({"shown": 4, "accepted": 3, "declined": 0, "suggested": 10, "empty": 6,
                               "length_sum": 40.0})  # fmt: skip
    assert [g.name for g in blank if not g.ok] == ["empty_rate", "mean_length_chars"]


def test_the_rollout_counts_declines_apart_from_empty_outputs_and_reads_accepts_from_the_reward(
    tmp_path: Path,
) -> None:
    from deploy_gate.rollout.data import load
    from flywheel.contract import Event, EventType, GenerationRecord
    from flywheel.lake.tables import EVENTS, REWARDS, events_frame, rewards_frame
    from flywheel.lm.policy import FinishReason
    from signals.events import FeedbackEvent, GenerationInfo, to_us
    from signals.reward import DEFAULT_DEFINITION

    t0 = datetime(2026, 11, 25, tzinfo=UTC)
    cases: list[tuple[str, FinishReason, list[str]]] = [  # (completion, finish_reason, feedback event types)
        ("", "declined", []),
        ("", "stop", []),  # a stop sequence cut everything: blank, not declined
        (" \n", "stop", ["shown"]),  # whitespace only: nothing visible
        (" x = 1\n", "stop", ["shown", "accepted"]),
        (" y = 2\n", "stop", ["shown", "rejected"]),
    ]
    events, rewards = [], []
    for i, (completion, finish, feedback) in enumerate(cases):
        rec = GenerationRecord(prompt="def f(", completion=completion, model_version="2", arm="challenger",
                               finish_reason=finish)  # fmt: skip
        event = Event(type=EventType.GENERATION, generation_id=f"g{i}", user_id="u1", ts=t0, source="serving",
                      properties=rec.model_dump())  # fmt: skip
        events.append((event, "t", 0, i))
        gen = GenerationInfo.from_event(event)
        seen = [FeedbackEvent(f"g{i}-{k}", kind, to_us(t0) + k + 1) for k, kind in enumerate(feedback)]
        rewards.append(DEFAULT_DEFINITION.record(gen, seen, window_end_us=to_us(t0) + 10**6, emitted_at=t0))
    EVENTS.write(EVENTS.at(tmp_path), events_frame(events), "gen")
    REWARDS.write(REWARDS.at(tmp_path), rewards_frame(rewards), "rew")
    user = load(tmp_path, {"challenger": "2"}).users.row(0, named=True)
    assert (user["generations"], user["declined"], user["empty"], user["suggested"]) == (5, 1, 2, 4)
    assert (user["shown"], user["accepted"]) == (3, 1)


def test_the_rollout_reads_the_current_revision_and_each_generation_once(tmp_path: Path) -> None:
    import json

    import polars as pl

    from deploy_gate.rollout.data import FileCache, load
    from flywheel.lake.tables import REWARDS

    t0 = datetime(2026, 11, 25, tzinfo=UTC)

    def rows(gids: list[str], revision: int, reward: float) -> pl.DataFrame:
        return pl.DataFrame([{
            "generation_id": g, "reward_version": "r1", "revision": revision, "reward": reward, "confidence": 1.0,
            "label_source": "implicit", "signals": json.dumps({"shown": 1.0}), "user_id": "u1", "model_version": "2",
            "arm": "challenger", "experiment": "default", "window_start": t0, "window_end": t0, "late_events": 0,
            "emitted_at": t0 + timedelta(seconds=revision),
        } for g in gids], schema=REWARDS.schema)  # fmt: skip

    where = REWARDS.at(tmp_path)
    REWARDS.write(where, rows(["a", "b"], 0, 1.0), "first")
    REWARDS.write(where, rows(["a", "b"], 0, 1.0), "replayed")  # the same rows again
    cache = FileCache()
    agg = load(tmp_path, {"challenger": "2"}, cache=cache)
    assert agg.users.select("reward_n", "reward_sum").row(0) == (2, 2.0)
    REWARDS.write(where, rows(["a"], 1, -1.0), "revised")  # a late event revises a's reward
    agg = load(tmp_path, {"challenger": "2"}, cache=cache)
    assert agg.users.select("reward_n", "reward_sum", "shown").row(0) == (2, 0.0, 2)


def test_a_step_that_never_reaches_its_minimum_users_rolls_back_at_the_maximum_duration() -> None:
    from deploy_gate.rollout import rules
    from deploy_gate.rollout.config import RolloutConfig
    from deploy_gate.rollout.evidence import MOMENTS

    config = RolloutConfig(max_duration_s=600)
    cells = {m.name: np.zeros((2, 1, 2, MOMENTS)) for m in rules.METRICS}
    clock = rules.Clock(
        step_users=np.array([1, 1]), step_min_users=np.array([2, 2]), in_step_s=np.array([300.0, 900.0]),
        step_min_seconds=np.array([60.0, 60.0]), last=np.array([False, False]), running_s=np.array([599.0, 600.0]),
    )  # fmt: skip
    rewarded = rules.Clock(**{**clock.__dict__, "rewarded": np.ones((2, 1, 2))})
    codes = rules.judge(cells, np.array([False, False]), rewarded, config).code
    assert codes.tolist() == [rules.CONTINUE_STEP_USERS, rules.ROLLBACK_STEP_USERS]
    # Without a single rewarded challenger user it is no data, not too few users: its path is broken.
    codes = rules.judge(cells, np.array([False, False]), clock, config).code
    assert codes.tolist() == [rules.CONTINUE_STEP_USERS, rules.ROLLBACK_NO_DATA]
