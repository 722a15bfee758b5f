"""Gaming watch: how the reward's ingredients move per arm and model version over time.

A policy optimised against a reward learns its gaps: it may stop suggesting to
avoid rejections (share shown falls, share declined rises), or win implicit
signals while people like it less (mean reward rises while thumbs-up falls).
`signal_trends` gives the dashboard the series; `gaming_alerts` names the shifts.
"""

from __future__ import annotations

import polars as pl

from flywheel.lake.tables import REWARDS
from flywheel.reward_versions import versions_to_read
from flywheel.settings import Settings
from signals.sink import read_rewards

TREND_SCHEMA: dict[str, pl.DataType] = {
    "bucket": pl.Datetime("us", "UTC"),
    "arm": pl.String(),
    "model_version": pl.String(),
    "reward_version": pl.String(),
    "generations": pl.UInt32(),
    "share_declined": pl.Float64(),
    "share_shown": pl.Float64(),
    "accept_rate": pl.Float64(),
    "thumbs_votes": pl.UInt32(),
    "thumbs_up_rate": pl.Float64(),
    "mean_reward": pl.Float64(),
    "share_explicit": pl.Float64(),
    "share_default": pl.Float64(),
}


def _signal(name: str) -> pl.Expr:
    return pl.col("signals").str.json_path_match(f"$.{name}").cast(pl.Float64)


def trends_of(rewards: pl.DataFrame, *, every: str = "1h") -> pl.DataFrame:
    """`signal_trends` over a given rewards frame (lake schema, latest revision per generation)."""
    if rewards.is_empty():
        return pl.DataFrame(schema=TREND_SCHEMA)
    df = rewards.with_columns(
        pl.col("window_start").dt.truncate(every).alias("bucket"),
        _signal("declined").fill_null(0.0).alias("declined"),
        _signal("shown").fill_null(0.0).alias("shown"),
        _signal("accepted").fill_null(0.0).alias("accepted"),
        _signal("thumbs").alias("thumbs"),
    )
    shown = pl.col("shown").sum()
    votes = pl.col("thumbs").is_not_null().sum()
    return (
        df.group_by("bucket", "arm", "model_version", "reward_version")
        .agg(
            pl.len().alias("generations"),
            pl.col("declined").mean().alias("share_declined"),
            pl.col("shown").mean().alias("share_shown"),
            pl.when(shown > 0)
            .then((pl.col("accepted") * pl.col("shown")).sum() / shown)
            .alias("accept_rate"),
            votes.cast(pl.UInt32).alias("thumbs_votes"),
            pl.when(votes > 0).then((pl.col("thumbs") > 0).sum() / votes).alias("thumbs_up_rate"),
            pl.col("reward").mean().alias("mean_reward"),
            (pl.col("label_source") == "explicit").mean().alias("share_explicit"),
            (pl.col("label_source") == "default").mean().alias("share_default"),
        )
        .with_columns(pl.col("generations").cast(pl.UInt32))
        .sort("bucket", "arm", "model_version")
        .select(list(TREND_SCHEMA))
    )


def signal_trends(settings: Settings, *, every: str = "1h", version: str | None = None) -> pl.DataFrame:
    """Per time bucket (of generation time), arm and model version: shares and rates of the signals
    and the mean reward, for one reward version (default: the active one of each surface, read as every
    consumer reads it: `flywheel.reward_versions.versions_to_read`)."""
    rewards = read_rewards(REWARDS.at(settings.lake_root), latest_only=True)
    if rewards.is_empty():
        return pl.DataFrame(schema=TREND_SCHEMA)
    versions = [version] if version is not None else versions_to_read(settings.lake_root, rewards.lazy())
    return trends_of(rewards.filter(pl.col("reward_version").is_in(versions)), every=every)


def gaming_alerts(
    trends: pl.DataFrame, *, min_generations: int = 20, relative_drop: float = 0.2, min_votes: int = 10
) -> pl.DataFrame:
    """Shifts between each arm/version's first and last bucket that look like reward gaming.

    - `suggesting_less`: share shown fell by more than `relative_drop` (relative);
    - `reward_up_thumbs_down`: mean reward rose while the thumbs-up rate fell.
    Buckets with fewer than `min_generations` (or `min_votes` for thumbs) are not compared.
    """
    schema = {
        "arm": pl.String,
        "model_version": pl.String,
        "alert": pl.String,
        "first": pl.Float64,
        "last": pl.Float64,
    }
    rows = []
    usable = trends.filter(pl.col("generations") >= min_generations)
    for (arm, version), part in usable.group_by("arm", "model_version", maintain_order=True):
        part = part.sort("bucket")
        if part.height < 2:
            continue
        first, last = part.row(0, named=True), part.row(-1, named=True)
        if first["share_shown"] > 0 and last["share_shown"] < first["share_shown"] * (1 - relative_drop):
            rows.append((arm, version, "suggesting_less", first["share_shown"], last["share_shown"]))
        voted = first["thumbs_votes"] >= min_votes and last["thumbs_votes"] >= min_votes
        if (
            voted
            and last["mean_reward"] > first["mean_reward"]
            and last["thumbs_up_rate"] < first["thumbs_up_rate"]
        ):
            rows.append(
                (arm, version, "reward_up_thumbs_down", first["thumbs_up_rate"], last["thumbs_up_rate"])
            )
    return pl.DataFrame(rows, schema=schema, orient="row")
