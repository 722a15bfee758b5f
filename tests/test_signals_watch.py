"""Gaming watch: trends per arm and version from the lake's rewards, and the alerts they raise."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from flywheel.lake.tables import REWARDS
from flywheel.settings import Settings
from signals.events import FeedbackEvent, GenerationInfo, to_us
from signals.reward import DEFAULT_DEFINITION
from signals.sink import write_rewards
from signals.watch import gaming_alerts, signal_trends

T0 = datetime(2025, 1, 1, 10, tzinfo=UTC)


def _records(
    arm: str, version: str, hour: int, n: int, *, decline: float, thumbs_up: float, seed: int
) -> list:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ts = to_us(T0 + timedelta(hours=hour, seconds=i))
        declined = rng.random() < decline
        gen = GenerationInfo(
            f"{arm}-{hour}-{i}",
            ts,
            model_version=version,
            arm=arm,
            finish_reason="declined" if declined else "stop",
            completion_chars=0 if declined else 9,
        )
        evs = [] if declined else [FeedbackEvent(f"{gen.generation_id}-a", "accepted", ts + 1)]
        if not declined and i % 3 == 0:
            evs.append(
                FeedbackEvent(
                    f"{gen.generation_id}-t",
                    "thumbs",
                    ts + 2,
                    {"value": "up" if rng.random() < thumbs_up else "down"},
                )
            )
        out.append(DEFAULT_DEFINITION.record(gen, evs, window_end_us=ts + 600_000_000))
    return out


def test_trends_show_a_challenger_that_stops_suggesting(settings: Settings) -> None:
    recs = []
    for hour in range(3):
        recs += _records("champion", "1", hour, 60, decline=0.1, thumbs_up=0.7, seed=hour)
        # the challenger declines more each hour; what it still suggests gets fewer thumbs up
        recs += _records(
            "challenger", "2", hour, 60, decline=0.1 + 0.3 * hour, thumbs_up=0.7 - 0.3 * hour, seed=10 + hour
        )
    write_rewards(REWARDS.at(settings.lake_root), recs, "watch-test")

    trends = signal_trends(settings, every="1h")
    assert trends.height == 6
    assert set(trends["arm"]) == {"champion", "challenger"}
    ch = trends.filter(trends["arm"] == "challenger").sort("bucket")
    assert ch["share_shown"].to_list() == sorted(ch["share_shown"].to_list(), reverse=True)
    assert all(abs(a + b - 1.0) < 1e-9 for a, b in zip(ch["share_shown"], ch["share_declined"], strict=True))
    assert ch["accept_rate"].to_list() == [1.0, 1.0, 1.0]

    alerts = gaming_alerts(trends)
    assert set(zip(alerts["arm"], alerts["alert"], strict=True)) >= {("challenger", "suggesting_less")}
    assert "champion" not in set(alerts["arm"]), "a steady arm raises nothing"


def test_trends_on_an_empty_lake_are_an_empty_frame(settings: Settings) -> None:
    trends = signal_trends(settings)
    assert trends.is_empty() and "mean_reward" in trends.columns
    assert gaming_alerts(trends).is_empty()


def test_alert_when_reward_rises_while_thumbs_fall() -> None:
    import polars as pl

    from signals.watch import TREND_SCHEMA

    base = {
        "arm": "challenger",
        "model_version": "2",
        "reward_version": "rules-v1",
        "generations": 100,
        "share_declined": 0.1,
        "share_shown": 0.9,
        "accept_rate": 0.5,
        "thumbs_votes": 30,
        "share_explicit": 0.3,
        "share_default": 0.1,
    }
    trends = pl.DataFrame(
        [
            {**base, "bucket": T0, "thumbs_up_rate": 0.7, "mean_reward": 0.2},
            {**base, "bucket": T0 + timedelta(hours=1), "thumbs_up_rate": 0.5, "mean_reward": 0.4},
        ],
        schema=TREND_SCHEMA,
    )
    alerts = gaming_alerts(trends)
    assert alerts["alert"].to_list() == ["reward_up_thumbs_down"]
    assert gaming_alerts(trends.with_columns(pl.lit(0.7).alias("thumbs_up_rate"))).is_empty()


def test_trends_follow_the_active_reward_not_a_newer_backfill(settings: Settings) -> None:
    from flywheel.reward_versions import write_active

    recs = _records("champion", "1", 0, 40, decline=0.1, thumbs_up=0.7, seed=1)
    write_rewards(REWARDS.at(settings.lake_root), recs, "active")
    later = datetime.now(UTC) + timedelta(days=1)  # a recompute stamps its rows after everything else
    backfill = [r.model_copy(update={"reward_version": "rules-v9", "reward": -1.0, "emitted_at": later}) for r in recs]
    write_rewards(REWARDS.at(settings.lake_root), backfill, "backfill")
    write_active(settings.lake_root, {"code-completion": DEFAULT_DEFINITION.version})
    trends = signal_trends(settings)
    assert set(trends["reward_version"]) == {DEFAULT_DEFINITION.version} and min(trends["mean_reward"]) > -1.0
    write_active(settings.lake_root, {"code-completion": "rules-v9"})  # activated: now it counts
    assert set(signal_trends(settings)["reward_version"]) == {"rules-v9"}
