"""Reward per arm and model version, overall and per time bucket, from the lake's rewards table.

Signals may revise a reward (a late event arrives): only the highest `revision` of each
(generation_id, reward_version) counts. Only one reward definition per surface is compared at a
time, by default the active one of each surface (`flywheel.reward_versions`; the one most recently
emitted on a lake signals never pointed), since rewards from two definitions do not mix; the
response's `reward_version` says which were read.
Rewards are bucketed by `window_start`, the time of the generation they judge, so a bucket
shows how that hour's users fared, whenever their feedback arrived.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import polars as pl
from pydantic import BaseModel, ConfigDict

from deploy_gate.stats import RewardStats
from flywheel.contract import utcnow
from flywheel.lake.tables import REWARDS
from flywheel.reward_versions import describe, versions_to_read
from flywheel.settings import Settings

CONFIDENCE = 0.95
ARM_ORDER = {"champion": 0, "challenger": 1}


class Interval(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int
    mean: float | None
    ci_low: float | None
    ci_high: float | None

    @classmethod
    def of(cls, s: RewardStats, level: float = CONFIDENCE) -> Interval:
        ci = s.confidence_interval(level)
        return cls(n=s.n, mean=s.mean, ci_low=ci[0] if ci else None, ci_high=ci[1] if ci else None)


class Bucket(Interval):
    start: datetime


class ArmSummary(Interval):
    arm: str
    model_version: str
    label_sources: dict[str, int]
    buckets: list[Bucket]


class ArmMetrics(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward_version: str | None
    bucket: str
    confidence: float = CONFIDENCE
    computed_at: datetime
    arms: list[ArmSummary]


def latest_rewards(
    lake_dir: Path,
    *,
    reward_version: str | None = None,
    since: datetime | None = None,
    lake_uri: str | None = None,
) -> tuple[pl.DataFrame | None, str | None]:
    """The rewards that count (latest revision each) in the lake at `lake_uri` (default `lake_dir`), for one
    reward definition, or else the versions signals made active in that lake
    (`flywheel.reward_versions.versions_to_read`); (frame, version(s) read)."""
    lf = REWARDS.scan(REWARDS.at(lake_uri or lake_dir))
    if lf is None:
        return None, reward_version
    versions = [reward_version] if reward_version else versions_to_read(lake_uri or lake_dir, lf)
    if not versions:
        return None, None
    lf = lf.filter(pl.col("reward_version").is_in(versions))
    if since is not None:
        lf = lf.filter(pl.col("window_start") >= since)
    columns = [
        "generation_id",
        "revision",
        "emitted_at",
        "window_start",
        "arm",
        "model_version",
        "reward",
        "label_source",
    ]
    # Eager: collected first, then deduplicated, was 2-4x faster here than any lazy form (bench/gate_metrics.py).
    df = REWARDS.latest(lf.select([*columns, "reward_version"]).collect()).drop("reward_version")
    return df, describe(versions)


def arm_metrics(
    settings: Settings,
    *,
    bucket: str = "1h",
    reward_version: str | None = None,
    since: datetime | None = None,
) -> ArmMetrics:
    """n, mean and 95% interval per arm and model version, overall and per `bucket` (a polars duration)."""
    df, version = latest_rewards(
        settings.lake_dir, reward_version=reward_version, since=since, lake_uri=settings.lake_root
    )
    arms: list[ArmSummary] = []
    if df is not None and not df.is_empty():
        df = df.with_columns(
            pl.col("arm").fill_null("").replace("", "unknown"),
            pl.col("model_version").fill_null(""),
            pl.col("reward").cast(pl.Float64),
            pl.col("window_start").dt.truncate(bucket).alias("_bucket"),
        )
        sums = [
            pl.len().alias("n"),
            pl.col("reward").sum().alias("total"),
            (pl.col("reward") ** 2).sum().alias("total_sq"),
        ]
        per_bucket = df.group_by("arm", "model_version", "_bucket").agg(sums).sort("_bucket")
        sources = df.group_by("arm", "model_version", "label_source").agg(pl.len().alias("n"))
        for (arm, mv), part in per_bucket.group_by("arm", "model_version", maintain_order=True):
            buckets = []
            overall = RewardStats()
            for row in part.iter_rows(named=True):
                s = RewardStats(row["n"], row["total"], row["total_sq"])
                overall = overall + s
                buckets.append(Bucket(start=row["_bucket"], **Interval.of(s).model_dump()))
            mix = sources.filter((pl.col("arm") == arm) & (pl.col("model_version") == mv))
            arms.append(
                ArmSummary(
                    arm=str(arm),
                    model_version=str(mv),
                    label_sources={str(r["label_source"]): int(r["n"]) for r in mix.iter_rows(named=True)},
                    buckets=buckets,
                    **Interval.of(overall).model_dump(),
                )
            )
    arms.sort(key=lambda a: (ARM_ORDER.get(a.arm, 2), a.arm, _version_key(a.model_version)))
    return ArmMetrics(reward_version=version, bucket=bucket, computed_at=utcnow(), arms=arms)


def _version_key(v: str) -> tuple[int, str]:
    return (int(v), "") if v.isdigit() else (1 << 62, v)
