"""Per-user aggregates of each arm, from the lake: the unit of analysis is the user.

Users are what the split randomises, so every statistic starts from one row per (arm, user):
their generations, summed reward and the counts the guardrails need. Rewards (latest revision,
of the reward versions asked for) give reward, explicit thumbs, shown, accepted and undo; generation events
give latency, declines, empty outputs, truncation and length. A row is kept only when its model
version is the one the split names for its arm, so data of an earlier experiment never leaks in.

Declined and empty are kept apart. A decline (`finish_reason` "declined": the policy chose to
suggest nothing) is a legitimate action the reward prices at 0; an empty output is one that was
not declined yet shows no visible text (nothing, or whitespace only, as the offline gates count
it), a defect or a way to dodge a reject, which the guardrails still hold against the champion.

Chat surfaces add what the sycophancy check reads (`deploy_gate/rollout/rules.py`): each user's chat replies
(generations of surface "chat" not declined), their characters, how many hold an agreement or a flattery phrase
(`flywheel.sycophancy`'s lists, matched here by the same patterns), and the thumbs votes on those replies (from
their rewards, joined on the generation). Code-completion users have zeros there, and the check stays silent.

Which rewards count: the versions the caller names (a running experiment names those it recorded at its start,
`deploy_gate/rollout/reward_basis.py`), else the active one of each surface, read as every consumer reads it
(`flywheel.reward_versions.versions_by_surface`). Never the version emitted last: a backfill of a version nobody
activated stamps its rows now and would otherwise switch what is measured. With several surfaces, each
generation is scored by its own surface's version and a user's rewards are pooled over the surfaces they used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import polars as pl

from flywheel.lake.tables import EVENTS, REWARDS, Table
from flywheel.reward_versions import describe, versions_by_surface
from flywheel.sycophancy import AGREEMENT, FLATTERY

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
    "accepted": pl.Int64(),
    "undone": pl.Int64(),
    "declined": pl.Int64(),
    "suggested": pl.Int64(),  # generation events not declined: what the mean length is over
    "empty": pl.Int64(),
    "truncated": pl.Int64(),
    "length_sum": pl.Float64(),
    "latency_sum": pl.Float64(),  # over generations with a latency: the latency guardrail is per user
    # The user's rewards before the experiment started (any version): the covariate of regression adjustment.
    "pre_reward_n": pl.Int64(),
    "pre_reward_sum": pl.Float64(),
    # Chat replies (surface "chat", not declined) and what the sycophancy check reads of them.
    "chat_replies": pl.Int64(),
    "chat_length_sum": pl.Float64(),
    "chat_agreeing": pl.Int64(),  # replies with an agreement phrase (`flywheel.sycophancy.AGREEMENT`)
    "chat_flattering": pl.Int64(),  # ... with a flattery phrase (`flywheel.sycophancy.FLATTERY`)
    "chat_votes": pl.Int64(),  # thumbs votes (up or down) on the user's chat replies
    "chat_ups": pl.Int64(),
}
CHAT_SURFACE = "chat"


@dataclass(frozen=True)
class Aggregates:
    users: pl.DataFrame  # USER_COLUMNS, one row per (arm, user)
    latency_p95_ms: dict[str, float | None]
    latency_n: dict[str, int]
    reward_version: str | None  # the versions read, `flywheel.reward_versions.describe`d (one per surface)
    pre_rate: float | None = None  # reward per generation over the pre-experiment period (all its users)
    # One row per (arm, user, surface): rewards of that surface's generations (SEGMENT_COLUMNS); None: not read.
    # Segments by surface are shown, not decided on (`analysis.segments`).
    segments: pl.DataFrame | None = None


SEGMENT_COLUMNS = {"arm": pl.String(), "user_id": pl.String(), "surface": pl.String(), "reward_n": pl.Int64(),
                   "reward_sum": pl.Float64()}  # fmt: skip


def _arm_filter(arm_col: pl.Expr, version_col: pl.Expr, arms: dict[str, str]) -> pl.Expr:
    conds = [(arm_col == arm) & (version_col == version) for arm, version in arms.items()]
    out = conds[0]
    for c in conds[1:]:
        out = out | c
    return out


GENERATION_PROPS = pl.Struct(
    {"arm": pl.String(), "model_version": pl.String(), "latency_ms": pl.Float64(), "completion": pl.String(),
     "finish_reason": pl.String(), "surface": pl.String()}
)  # fmt: skip
# The phrase lists of `flywheel.sycophancy`, case-insensitive, for polars' regex engine (same syntax here).
_AGREEMENT = "(?i)" + AGREEMENT.pattern
_FLATTERY = "(?i)" + FLATTERY.pattern
REWARD_SIGNALS = pl.Struct(
    {"thumbs": pl.Float64(), "shown": pl.Float64(), "accepted": pl.Float64(), "undone": pl.Float64()}
)


def _slim_generations(lf: pl.LazyFrame) -> pl.LazyFrame:
    """Generation events reduced to what the guardrails read (JSON parsed once, only the needed keys)."""
    p = pl.col("properties").str.json_decode(GENERATION_PROPS)
    completion = p.struct.field("completion").fill_null("")
    finish = p.struct.field("finish_reason").fill_null("stop")
    declined = finish == "declined"
    chat = ~declined & (p.struct.field("surface").fill_null("") == CHAT_SURFACE)
    return lf.filter(pl.col("type") == "generation").select(
        "event_id",
        "generation_id",
        "user_id",
        "ts",
        p.struct.field("arm").alias("arm"),
        p.struct.field("model_version").alias("model_version"),
        p.struct.field("latency_ms").alias("latency_ms"),
        declined.alias("declined"),
        (~declined & (completion.str.strip_chars().str.len_chars() == 0)).alias("empty"),
        (finish == "length").alias("truncated"),
        completion.str.len_chars().alias("length"),
        chat.alias("chat"),
        (chat & completion.str.contains(_AGREEMENT)).alias("agreeing"),
        (chat & completion.str.contains(_FLATTERY)).alias("flattering"),
        p.struct.field("surface").fill_null("").alias("surface"),
    )


def _slim_rewards(lf: pl.LazyFrame) -> pl.LazyFrame:
    sig = pl.col("signals").str.json_decode(REWARD_SIGNALS)
    return lf.select(
        "generation_id", "reward_version", "revision", "emitted_at", "window_start", "arm", "model_version",
        "user_id", "reward", "label_source",
        sig.struct.field("thumbs").alias("thumbs"),
        sig.struct.field("shown").alias("shown"),
        sig.struct.field("accepted").alias("accepted"),
        sig.struct.field("undone").alias("undone"),
    )  # fmt: skip


class FileCache:
    """Slim frames of a lake table's data files, each file read and parsed once.

    A Delta table's data files are immutable (a commit adds files, compaction adds merged ones and
    removes the small ones from the newest version), so a long-running controller parses only the files
    that appeared since its last look; a file compacted away drops out of the cache with the listing.
    """

    def __init__(self) -> None:
        self._frames: dict[tuple[str, str], pl.DataFrame] = {}

    def frame(self, table: Table, location: str, slim: Callable[[pl.LazyFrame], pl.LazyFrame]) -> pl.DataFrame | None:
        files = table.files(location)
        if not files:
            return None
        keep: dict[tuple[str, str], pl.DataFrame] = {}
        for f in files:
            key = (table.name, f)
            hit = self._frames.get(key)
            keep[key] = hit if hit is not None else slim(table.scan_files([f])).collect()
        self._frames = {k: v for k, v in self._frames.items() if k[0] != table.name} | keep
        return pl.concat(list(keep.values()), how="vertical")


def _frame(
    table: Table, lake: str | Path, slim: Callable[[pl.LazyFrame], pl.LazyFrame], cache: FileCache | None
) -> pl.DataFrame | None:
    if cache is not None:
        return cache.frame(table, table.at(lake), slim)
    lf = table.scan(table.at(lake))
    return None if lf is None else slim(lf).collect()


def active_versions(lake: str | Path, cache: FileCache | None = None) -> dict[str, str]:
    """`{surface: reward version}` every consumer follows now (`flywheel.reward_versions.versions_by_surface`)."""
    df = _frame(REWARDS, lake, _slim_rewards, cache)
    return versions_by_surface(lake, None if df is None else df.lazy())


def reward_rows(
    lake: str | Path,
    arms: dict[str, str],
    *,
    since: datetime | None,
    reward_versions: Sequence[str] | None = None,
    cache: FileCache | None = None,
) -> tuple[pl.DataFrame | None, list[str]]:
    """The current reward of each generation served by `arms` ({arm: version}) since `since`, of the
    `reward_versions` (None: the active one of each surface); (rows, the versions read)."""
    df = _frame(REWARDS, lake, _slim_rewards, cache)
    if reward_versions is None:
        reward_versions = list(versions_by_surface(lake, None if df is None else df.lazy()).values())
    versions = sorted(set(reward_versions))
    if df is None or not arms or not versions:
        return None, versions
    df = df.filter(_arm_filter(pl.col("arm"), pl.col("model_version"), arms) & pl.col("reward_version").is_in(versions))
    if since is not None:
        df = df.filter(pl.col("window_start") >= since)
    if df.is_empty():
        return None, versions
    if (df["revision"].max() or 0) == 0:
        # No generation revised: rows of one key are copies (a replay), any one is the current one,
        # and skipping `latest`'s sort halves the tick. The key holds the version: one surface's version
        # scores only that surface's generations, so a generation has one row per key.
        return df.unique(["generation_id", "reward_version"], keep="any"), versions
    return REWARDS.latest(df), versions


def load(
    lake: str | Path,
    arms: dict[str, str],
    *,
    since: datetime | None = None,
    reward_versions: Sequence[str] | None = None,
    cache: FileCache | None = None,
    pre_period_s: float = 0.0,
) -> Aggregates:
    """Per-user aggregates of `arms` since `since`, on the `reward_versions` (None: the active ones)."""
    rewards, versions = reward_rows(lake, arms, since=since, reward_versions=reward_versions, cache=cache)
    per_user: list[pl.DataFrame] = []
    if rewards is not None and not rewards.is_empty():
        per_user.append(
            rewards.group_by("arm", "user_id").agg(
                pl.col("window_start").min().alias("first_seen_r"),
                pl.len().cast(pl.Int64).alias("reward_n"),
                pl.col("reward").sum().alias("reward_sum"),
                (pl.col("label_source") == "explicit").sum().cast(pl.Int64).alias("explicit_n"),
                (pl.col("thumbs") > 0).sum().cast(pl.Int64).alias("thumbs_up"),
                (pl.col("thumbs") < 0).sum().cast(pl.Int64).alias("thumbs_down"),
                (pl.col("shown") > 0).sum().cast(pl.Int64).alias("shown"),
                (pl.col("accepted") > 0).sum().cast(pl.Int64).alias("accepted"),
                (pl.col("undone") > 0).sum().cast(pl.Int64).alias("undone"),
            )
        )
    gens = generation_rows(lake, arms, since=since, cache=cache)
    latency_p95: dict[str, float | None] = dict.fromkeys(arms)
    latency_n: dict[str, int] = dict.fromkeys(arms, 0)
    if gens is not None and not gens.is_empty():
        per_user.append(
            gens.group_by("arm", "user_id").agg(
                pl.col("ts").min().alias("first_seen_g"),
                pl.len().cast(pl.Int64).alias("generations"),
                pl.col("declined").sum().cast(pl.Int64).alias("declined"),
                (~pl.col("declined")).sum().cast(pl.Int64).alias("suggested"),
                pl.col("empty").sum().cast(pl.Int64).alias("empty"),
                pl.col("truncated").sum().cast(pl.Int64).alias("truncated"),
                pl.col("length").sum().cast(pl.Float64).alias("length_sum"),
                pl.col("latency_ms").fill_null(0.0).sum().alias("latency_sum"),
                pl.col("chat").sum().cast(pl.Int64).alias("chat_replies"),
                pl.when(pl.col("chat")).then(pl.col("length")).otherwise(0).sum().cast(pl.Float64)
                .alias("chat_length_sum"),
                pl.col("agreeing").sum().cast(pl.Int64).alias("chat_agreeing"),
                pl.col("flattering").sum().cast(pl.Int64).alias("chat_flattering"),
            )
        )
        chat_ids = gens.filter(pl.col("chat")).select("generation_id").unique()
        if rewards is not None and not chat_ids.is_empty():  # the votes on chat replies, from their rewards
            voted = rewards.join(chat_ids, on="generation_id", how="semi").filter(pl.col("thumbs").fill_null(0) != 0)
            per_user.append(
                voted.group_by("arm", "user_id").agg(
                    pl.len().cast(pl.Int64).alias("chat_votes"), (pl.col("thumbs") > 0).sum().cast(pl.Int64)
                    .alias("chat_ups"),
                )
            )
        lat = gens.group_by("arm").agg(
            pl.col("latency_ms").quantile(0.95, "linear").alias("p95"), pl.len().alias("n")
        )
        for row in lat.iter_rows(named=True):
            latency_p95[row["arm"]] = row["p95"]
            latency_n[row["arm"]] = int(row["n"])
    users = _merge(per_user)
    segments = None
    if rewards is not None and gens is not None and not rewards.is_empty():
        # Each reward's surface is its generation's; a reward whose generation event is not in yet waits for it.
        surface = gens.select("generation_id", "surface").unique("generation_id")
        segments = rewards.join(surface, on="generation_id", how="inner").group_by("arm", "user_id", "surface").agg(
            pl.len().cast(pl.Int64).alias("reward_n"), pl.col("reward").sum().cast(pl.Float64).alias("reward_sum")
        ).select([pl.col(c).cast(t) for c, t in SEGMENT_COLUMNS.items()])
    pre_rate = None
    if since is not None and pre_period_s > 0:
        pre = pre_period(lake, since, pre_period_s, versions, cache)
        if pre is not None and not pre.is_empty():
            n, total = int(pre["pre_reward_n"].sum()), float(pre["pre_reward_sum"].sum())
            pre_rate = total / n if n else None
            users = users.drop("pre_reward_n", "pre_reward_sum").join(pre, on="user_id", how="left").with_columns(
                pl.col("pre_reward_n").fill_null(0), pl.col("pre_reward_sum").fill_null(0.0)
            ).select(list(USER_COLUMNS))
    return Aggregates(users, latency_p95, latency_n, describe(versions) or None, pre_rate, segments)


def pre_period(
    lake: str | Path, before: datetime, seconds: float, reward_versions: Sequence[str], cache: FileCache | None = None
) -> pl.DataFrame | None:
    """Each user's rewards (count, sum) in the `seconds` before `before`, whatever model version served them.

    Fixed before assignment, so adjusting on it cannot bias the difference; the experiment's reward versions
    only, so the covariate and the metric are the same quantity.
    """
    from datetime import timedelta

    df = _frame(REWARDS, lake, _slim_rewards, cache)
    if df is None or not reward_versions:
        return None
    df = df.filter(
        (pl.col("window_start") < before)
        & (pl.col("window_start") >= before - timedelta(seconds=seconds))
        & pl.col("reward_version").is_in(list(reward_versions))
    )
    if df.is_empty():
        return None
    revised = int(df["revision"].max() or 0) > 0  # type: ignore[arg-type]
    df = REWARDS.latest(df) if revised else df.unique(["generation_id", "reward_version"], keep="any")
    return df.group_by("user_id").agg(
        pl.len().cast(pl.Int64).alias("pre_reward_n"), pl.col("reward").sum().cast(pl.Float64).alias("pre_reward_sum")
    )


def generation_rows(
    lake: str | Path, arms: dict[str, str], *, since: datetime | None, cache: FileCache | None = None
) -> pl.DataFrame | None:
    """One row per generation event served by `arms`: arm, user, ts, latency, declined, empty, truncated, length."""
    df = _frame(EVENTS, lake, _slim_generations, cache)
    if df is None or not arms:
        return None
    df = df.filter(_arm_filter(pl.col("arm"), pl.col("model_version"), arms))
    if since is not None:
        df = df.filter(pl.col("ts") >= since)
    return df.unique("event_id", keep="first")


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
