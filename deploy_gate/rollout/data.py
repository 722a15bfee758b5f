"""Per-user aggregates of each arm, from the lake: the unit of analysis is the user.

Users are what the split randomises, so every statistic starts from one row per (arm, user):
their generations, summed reward and the counts the guardrails need. Rewards (latest revision,
one reward definition) give reward, explicit thumbs, shown and undo; generation events give
latency, empty outputs, truncation and length. A row is kept only when its model version is the
one the split names for its arm, so data of an earlier experiment never leaks in.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import polars as pl

from flywheel.lake.tables import EVENTS, REWARDS

USER_COLUMNS = {
    "arm": pl.String(),
    "user_id": pl.String(),
    "first_seen": pl.Datetime("us", "UTC"),
    "generations": pl.Int64(),
    "reward_n": pl.Int64(),
    "reward_sum": pl.Float64(),
    "explicit_n": pl.Int64(),
    "thumbs_up": pl.Int64(),
    "thumbs_down": pl.Int64(),
    "shown": pl.Int64(),
    "undone": pl.Int64(),
    "empty": pl.Int64(),
    "errors": pl.Int64(),
    "length_sum": pl.Float64(),
}


@dataclass(frozen=True)
class Aggregates:
    users: pl.DataFrame  # USER_COLUMNS, one row per (arm, user)
    latency_p95_ms: dict[str, float | None]
    latency_n: dict[str, int]
    reward_version: str | None


def _arm_filter(arm_col: pl.Expr, version_col: pl.Expr, arms: dict[str, str]) -> pl.Expr:
    conds = [(arm_col == arm) & (version_col == version) for arm, version in arms.items()]
    out = conds[0]
    for c in conds[1:]:
        out = out | c
    return out


def reward_rows(
    lake_dir: Path, arms: dict[str, str], *, since: datetime | None, reward_version: str | None
) -> tuple[pl.DataFrame | None, str | None]:
    """The current reward of each generation served by `arms` ({arm: version}) since `since`."""
    lf = REWARDS.scan(REWARDS.at(lake_dir))
    if lf is None or not arms:
        return None, reward_version
    lf = lf.filter(_arm_filter(pl.col("arm"), pl.col("model_version"), arms))
    if since is not None:
        lf = lf.filter(pl.col("window_start") >= since)
    if reward_version is None:
        newest = lf.select(pl.col("reward_version").get(pl.col("emitted_at").arg_max())).collect()
        if newest.is_empty() or newest.item() is None:
            return None, None
        reward_version = str(newest.item())
    cols = ["generation_id", "reward_version", "revision", "emitted_at", "window_start", "arm", "user_id",
            "reward", "label_source", "signals"]
    df = REWARDS.latest(lf.filter(pl.col("reward_version") == reward_version).select(cols).collect())
    return df, reward_version


def load(
    lake_dir: Path, arms: dict[str, str], *, since: datetime | None = None, reward_version: str | None = None
) -> Aggregates:
    rewards, version = reward_rows(lake_dir, arms, since=since, reward_version=reward_version)
    per_user: list[pl.DataFrame] = []
    if rewards is not None and not rewards.is_empty():
        sig = pl.col("signals")
        thumbs = sig.str.json_path_match("$.thumbs").cast(pl.Float64, strict=False)
        per_user.append(
            rewards.group_by("arm", "user_id").agg(
                pl.col("window_start").min().alias("first_seen_r"),
                pl.len().cast(pl.Int64).alias("reward_n"),
                pl.col("reward").sum().alias("reward_sum"),
                (pl.col("label_source") == "explicit").sum().cast(pl.Int64).alias("explicit_n"),
                (thumbs > 0).sum().cast(pl.Int64).alias("thumbs_up"),
                (thumbs < 0).sum().cast(pl.Int64).alias("thumbs_down"),
                (sig.str.json_path_match("$.shown").cast(pl.Float64, strict=False) > 0)
                .sum().cast(pl.Int64).alias("shown"),
                (sig.str.json_path_match("$.undone").cast(pl.Float64, strict=False) > 0)
                .sum().cast(pl.Int64).alias("undone"),
            )
        )
    gens = generation_rows(lake_dir, arms, since=since)
    latency_p95: dict[str, float | None] = dict.fromkeys(arms)
    latency_n: dict[str, int] = dict.fromkeys(arms, 0)
    if gens is not None and not gens.is_empty():
        per_user.append(
            gens.group_by("arm", "user_id").agg(
                pl.col("ts").min().alias("first_seen_g"),
                pl.len().cast(pl.Int64).alias("generations"),
                pl.col("empty").sum().cast(pl.Int64).alias("empty"),
                pl.col("truncated").sum().cast(pl.Int64).alias("errors"),
                pl.col("length").sum().cast(pl.Float64).alias("length_sum"),
            )
        )
        lat = gens.group_by("arm").agg(
            pl.col("latency_ms").quantile(0.95, "linear").alias("p95"), pl.len().alias("n")
        )
        for row in lat.iter_rows(named=True):
            latency_p95[row["arm"]] = row["p95"]
            latency_n[row["arm"]] = int(row["n"])
    return Aggregates(_merge(per_user), latency_p95, latency_n, version)


def generation_rows(lake_dir: Path, arms: dict[str, str], *, since: datetime | None) -> pl.DataFrame | None:
    """One row per generation event served by `arms`: arm, user, ts, latency, empty, truncated, length."""
    lf = EVENTS.scan(EVENTS.at(lake_dir))
    if lf is None or not arms:
        return None
    lf = lf.filter(pl.col("type") == "generation")
    if since is not None:
        lf = lf.filter(pl.col("ts") >= since)
    p = pl.col("properties")
    completion = p.str.json_path_match("$.completion").fill_null("")
    finish = p.str.json_path_match("$.finish_reason").fill_null("stop")
    lf = lf.select(
        "event_id",
        "user_id",
        "ts",
        p.str.json_path_match("$.arm").alias("arm"),
        p.str.json_path_match("$.model_version").alias("model_version"),
        p.str.json_path_match("$.latency_ms").cast(pl.Float64, strict=False).alias("latency_ms"),
        ((finish == "declined") | (completion.str.len_chars() == 0)).alias("empty"),
        (finish == "length").alias("truncated"),
        completion.str.len_chars().alias("length"),
    ).filter(_arm_filter(pl.col("arm"), pl.col("model_version"), arms))
    return lf.unique("event_id", keep="first").collect()


def _merge(parts: list[pl.DataFrame]) -> pl.DataFrame:
    if not parts:
        return pl.DataFrame(schema=USER_COLUMNS)
    df = parts[0]
    for other in parts[1:]:
        df = df.join(other, on=["arm", "user_id"], how="full", coalesce=True)
    firsts = [c for c in ("first_seen_r", "first_seen_g") if c in df.columns]
    df = df.with_columns(pl.min_horizontal(*firsts).alias("first_seen"))
    missing = {c: t for c, t in USER_COLUMNS.items() if c not in df.columns}
    df = df.with_columns([pl.lit(None, t).alias(c) for c, t in missing.items()])
    df = df.select([pl.col(c).cast(t) for c, t in USER_COLUMNS.items()])
    counts = [c for c, t in USER_COLUMNS.items() if c not in ("arm", "user_id", "first_seen")]
    df = df.with_columns([pl.col(c).fill_null(0) for c in counts])
    # A generation whose event is not in the lake yet still counts once its reward is.
    return df.with_columns(pl.max_horizontal("generations", "reward_n").alias("generations"))
