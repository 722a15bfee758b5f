"""Batch recompute: the stream's records, from the lake's events table, with polars.

It replays the worker's rules (signals/worker.py) per Kafka partition in offset
order: the first copy of each event id counts; the live watermark is the running
maximum of the arrival clock (`received_at`, at most `now`) minus the allowed lateness, and the historical one the
running maximum of `ts` over events received more than `backfill_after_s` after their
time; a generation's window (its definition's `window_s`) closes, by the watermark of
its generation event's lane, at the first row at or after that event where the
watermark reaches its end; in-window feedback before that row makes revision 0 and each
one from that row on makes one more revision. Windows the events never close are closed
if the wall clock has passed them (as the idle worker does), else left open. A definition
scores only generations of its own surface; a generation keeps the worker's bounds (its first
`max_feedback_per_generation` feedback events of at most `max_feedback_bytes` each). It makes one
revision per late event, numbered by the late events it holds; the worker coalesces the late
events of one micro-batch into the last of those revisions. So for the same events and version
every record the stream emits is one of these, up to `emitted_at`, and so is each generation's
final one.

`backfill` writes one final record per generation instead (every in-window event,
revision 0): history replayed from the lake is never a default followed by revisions.
"""

from __future__ import annotations

from datetime import datetime

import numpy as np
import polars as pl

from flywheel.connections import redis_client
from flywheel.contract import RewardRecord, utcnow
from flywheel.lake.tables import EVENTS, REWARDS, rewards_frame
from flywheel.reward_versions import DEFAULT_SURFACE
from flywheel.settings import Settings
from signals.columns import ENGINE, in_chunks, score_frame, signal_names, signals_of
from signals.config import SignalsConfig
from signals.definitions import DefinitionStore
from signals.events import from_us, to_us
from signals.reward import RewardDefinition
from signals.sink import read_rewards, write_rewards

_NEVER = 2**62
_CAP_BUCKETS = 2**22


_GENERATION_FIELDS = pl.Struct(
    {k: pl.String for k in ("model_version", "arm", "experiment", "finish_reason", "completion", "surface")}
)


def generation_fields(properties: pl.Series) -> pl.DataFrame:
    """What `GenerationInfo.from_properties` reads of each generation's properties (JSON text), column-wise.

    Only that is parsed (prompt and token ids are most of the JSON), in one pass for the six fields: the
    contract holds each to a string (`flywheel.contract.GenerationRecord`). Text where one is not (rows
    written around the contract) is read field by field, each value as its text."""
    frame = in_chunks(pl.DataFrame({"properties": properties}))
    try:
        fields = frame.select(pl.col("properties").fill_null("{}").str.json_decode(_GENERATION_FIELDS)).unnest(
            "properties"
        )
    except pl.exceptions.ComputeError:
        fields = frame.select(
            pl.col("properties").str.json_path_match(f"$.{k}").alias(k) for k in _GENERATION_FIELDS.to_schema()
        )
    return fields.select(
        *[pl.col(k).fill_null("") for k in ("model_version", "arm", "experiment")],
        pl.col("finish_reason").fill_null("stop"),
        pl.col("completion").fill_null("").str.len_chars().alias("completion_chars"),
        pl.col("surface").fill_null("").replace("", DEFAULT_SURFACE),
    )


def load_events(table: str, topic: str) -> pl.DataFrame | None:
    """The rows of the events table at `table` read from Kafka `topic` (or written without a topic)."""
    lf = EVENTS.scan(table)
    if lf is None:
        return None
    return (
        lf.filter(pl.col("kafka_topic").is_null() | (pl.col("kafka_topic") == topic))
        .select(
            "event_id",
            "type",
            "generation_id",
            "user_id",
            "ts",
            "received_at",
            "properties",
            "kafka_partition",
            "kafka_offset",
        )
        .collect()
    )


def _is_sorted(frame: pl.DataFrame, *by: str) -> bool:
    """Whether `frame` is in ascending order of the non-null columns `by` (checked in one pass, a sort's tenth)."""
    if any(frame.get_column(c).has_nulls() for c in by):
        return False
    after: pl.Expr = pl.lit(True)  # the row is at or after the one before in the last columns of `by`
    for c in reversed(by):
        before = pl.col(c).shift(1)
        after = (pl.col(c) > before) | ((pl.col(c) == before) & after)
    return bool(frame.select(after.slice(1).all()).item())


def _first_copies(events: pl.DataFrame) -> pl.Series:
    """True on the first row of each event (`EVENTS.key`), in frame order.

    Found by sorting the key's 64-bit hash, not with a hash set of the key (at 10M events a sort of the hashes
    takes about a quarter of the CPU time of `is_first_distinct` on the ids' text): a row whose hash no other row
    has is a first; only the rows that share a hash (the copies, and any collision) are compared by the key
    itself, in frame order."""
    key = list(EVENTS.key)
    values = events.get_column(key[0]) if len(key) == 1 else events.select(pl.struct(key)).to_series()
    hashes = values.hash()
    order = hashes.arg_sort()
    ranked = hashes.gather(order)
    same = ranked == ranked.shift(1)  # shares its hash with the row before it in hash order
    shared = order.filter((same | same.shift(-1)).fill_null(False)).sort()
    firsts = pl.Series("first", np.ones(events.height, dtype=bool))
    if len(shared):
        firsts.scatter(shared, values.gather(shared).is_first_distinct())
    return firsts


def plan_windows(
    events: pl.DataFrame,
    *,
    window_s: float,
    lateness_s: float,
    idle_grace_s: float,
    now: datetime,
    surface: str = DEFAULT_SURFACE,
    backfill_after_s: float = 3600.0,
    max_feedback: int | None = None,
    max_feedback_bytes: int | None = None,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(Generations of `surface` to emit with their window; in-window feedback with late_rank: 0 on
    time, k: k-th late). Both carry `gen_idx`, a generation's row in the first: an integer key, which
    sorts, joins and groups several times faster than the id's text."""
    window_us = int(round(window_s * 1e6))
    lateness_us = int(round(lateness_s * 1e6))
    backfill_after_us = int(round(backfill_after_s * 1e6))
    lane_order = ["kafka_partition", "kafka_offset"]
    if not _is_sorted(events, *lane_order):  # the lake's rows mostly come in that order already
        events = events.sort(*lane_order)
    df = (
        events.lazy()
        .filter(_first_copies(events))  # the first copy of each event counts
        .select(
            "event_id",
            "type",
            "generation_id",
            "user_id",
            "properties",
            "kafka_partition",
            pl.col("ts").dt.epoch("us").alias("ts_us"),
            pl.col("received_at").dt.epoch("us").alias("received_us"),
        )
        .with_columns(
            # the worker's clock: arrival, never past the wall clock (`signals.worker.event_clock_us`)
            pl.min_horizontal("received_us", pl.lit(to_us(now))).alias("clock"),
            ((pl.col("received_us") - pl.col("ts_us")) > backfill_after_us).cast(pl.Int8).alias("lane"),
        )
        .collect(engine=ENGINE)
    )
    # each partition's rows are one slice of the frame (it is in lane order): its running maxima are taken over
    # the slice, not with `over` (which groups the whole frame by partition, a sixth of this plan's CPU time)
    part = df.get_column("kafka_partition")
    starts = [*sorted({0, *part.ne_missing(part.shift(1)).arg_true().to_list()}), df.height]
    running = [
        df.slice(a, b - a)
        .lazy()
        .select(
            (pl.col("clock").cum_max() - lateness_us).alias("wm0"),
            (pl.when(pl.col("lane") == 1).then(pl.col("ts_us")).cum_max().forward_fill() - lateness_us).alias("wm1"),
            pl.int_range(pl.len()).alias("pos"),
        )
        for a, b in zip(starts, starts[1:], strict=False)
    ]
    df = df.hstack(pl.concat(pl.collect_all(running, engine=ENGINE)))

    # per lane, the first row of each partition at which its watermark reaches a value
    # (a watermark never goes down along a partition: the first row of a value is where it changes)
    def changes(wm: pl.Expr, pos: pl.Expr) -> pl.Expr:
        # the frame is in partition order: the row before is of the same partition unless `pos` is 0
        before = pl.when(pos > 0).then(wm.shift(1))
        return wm.is_not_null() & (before.is_null() | (wm != before))

    # each partition's and lane's steps come in watermark order (of a running maximum): all that the as-of join by
    # partition and lane reads, so they are not sorted as a whole
    steps = pl.concat(
        [
            df.lazy()
            .select("kafka_partition", pl.col(f"wm{lane}").alias("wm"), pl.col("pos").alias("first_pos"))
            .filter(changes(pl.col("wm"), pl.col("first_pos")))
            .with_columns(pl.lit(lane, pl.Int8).alias("lane"))
            for lane in (0, 1)
        ]
    ).collect(engine=ENGINE)
    idle_wm = to_us(now) - lateness_us - int(round(idle_grace_s * 1e6))
    first = (
        df.lazy()
        .filter(pl.col("type") == "generation")
        .select("generation_id", "user_id", "ts_us", "kafka_partition", "pos", "lane", "properties")
        .unique("generation_id", keep="first", maintain_order=True)
        .collect(engine=ENGINE)
    )
    gens = (
        first.select(
            "generation_id",
            "user_id",
            "ts_us",
            "kafka_partition",
            pl.col("pos").alias("gen_pos"),
            (pl.col("ts_us") + window_us).alias("window_end"),
            "lane",
        )
        .hstack(generation_fields(first["properties"]))
        .filter(pl.col("surface") == surface)
        .sort("window_end")
        .join_asof(
            steps,
            left_on="window_end",
            right_on="wm",
            by=["kafka_partition", "lane"],
            strategy="forward",
            check_sortedness=False,
        )  # window ends sorted above, steps in order per partition and lane; polars cannot check it with `by`
        .with_columns(
            pl.when(pl.col("first_pos").is_null())
            .then(pl.when(pl.col("window_end") <= idle_wm).then(pl.lit(_NEVER)).otherwise(None))
            .otherwise(pl.max_horizontal("first_pos", "gen_pos"))
            .alias("close_pos")
        )
        .filter(pl.col("close_pos").is_not_null())
        .drop("wm", "first_pos", "lane")
        .with_row_index("gen_idx")
    )
    # one plan from here to the join, so only the rows and columns that reach it are copied
    candidates = (
        df.lazy()
        .filter(pl.col("type") != "generation")
        .select("event_id", "type", "generation_id", "properties", "kafka_partition", "ts_us", "pos")
    )
    if max_feedback_bytes is not None:
        candidates = candidates.filter(pl.col("properties").fill_null("{}").str.len_bytes() <= max_feedback_bytes)
    if max_feedback is not None:  # the worker's cap: the first ones of each generation, in arrival order
        # counted by the id's hash (a third faster than by its text): a generation sharing the hash of a flooded
        # one is numbered too, and keeps its events as it has no more than the cap. Counted per bucket of the hash's
        # low bits first (`np.bincount`, a fraction of a group-by's CPU time), then only the crowded buckets' hashes
        key = pl.col("generation_id").hash()
        hashes = candidates.select(key).collect(engine=ENGINE).to_series().to_numpy()
        bucket = (hashes & (_CAP_BUCKETS - 1)).astype(np.int64)
        crowded = hashes[np.bincount(bucket, minlength=_CAP_BUCKETS)[bucket] > max_feedback]
        distinct, counts = np.unique(crowded, return_counts=True)
        flooded = pl.Series(distinct[counts > max_feedback], dtype=pl.UInt64)
        if len(flooded):  # numbering rows per generation costs more than counting them: only where needed
            within = key.is_in(flooded.implode())
            candidates = pl.concat([
                candidates.filter(~within),
                candidates.filter(within).filter(pl.int_range(pl.len()).over("generation_id") < max_feedback),
            ])  # fmt: skip
    feedback = (
        candidates.join(
            gens.lazy().select("generation_id", "kafka_partition", "window_end", "close_pos", "gen_idx"),
            on=["generation_id", "kafka_partition"],
            how="inner",
        )
        .filter(pl.col("ts_us") <= pl.col("window_end"))
        .drop("generation_id", "window_end")
        .collect(engine=ENGINE)
    )
    columns = ("gen_idx", "event_id", "type", "ts_us", "properties", "late_rank")
    late = pl.col("pos") >= pl.col("close_pos")
    # only the (few) late events need numbering, in arrival order; the rest are rank 0 in any order
    feedback = pl.concat([
        feedback.filter(~late).with_columns(pl.lit(0, pl.Int64).alias("late_rank")).select(columns),
        feedback.filter(late).sort("kafka_partition", "pos")
        .with_columns((pl.int_range(pl.len()).over("gen_idx") + 1).cast(pl.Int64).alias("late_rank"))
        .select(columns),
    ])  # fmt: skip
    return gens, feedback


def recompute_scores(
    settings: Settings,
    definition: RewardDefinition,
    events: pl.DataFrame | None = None,
    *,
    config: SignalsConfig | None = None,
    now: datetime | None = None,
    final_only: bool = False,
) -> pl.DataFrame:
    """One scored row per record the stream would emit for `events` (default: the lake's) under
    `definition` (`signals.columns.score_frame`: the stream's own expressions), with its generation's
    columns, `revision` and `late_events`; `final_only`: one per generation, its final one (every
    in-window event, revision 0)."""
    config = config or SignalsConfig()
    if events is None:
        events = load_events(EVENTS.at(settings.lake_root), settings.events_topic)
    if events is None or events.is_empty():
        return pl.DataFrame()
    gens, feedback = plan_windows(
        events,
        window_s=definition.window(settings.window_for(definition.surface)),
        lateness_s=settings.allowed_lateness_s,
        idle_grace_s=config.idle_grace_s,
        now=now or utcnow(),
        surface=definition.surface,
        backfill_after_s=config.backfill_after_s,
        max_feedback=config.max_feedback_per_generation,
        max_feedback_bytes=config.max_feedback_bytes,
    )
    # scored by `gen_idx` under the key's name (an integer key: `plan_windows`), the id put back after
    gens = gens.with_columns(pl.col("completion_chars").cast(pl.Int64)).rename({"generation_id": "id_"})
    gens = gens.with_columns(pl.col("gen_idx").alias("generation_id"))
    feedback = feedback.rename({"gen_idx": "generation_id"})
    if final_only:  # one record holding every in-window event, as if none had been late
        records = gens.with_columns(pl.lit(0, pl.Int64).alias("revision"), pl.lit(0, pl.Int64).alias("late_events"))
        rows = feedback.with_columns(pl.lit(0, pl.Int64).alias("revision"))
    else:  # revision k holds the on-time events and the first k late ones
        late = (
            feedback.filter(pl.col("late_rank") > 0)
            .group_by("generation_id")
            .agg(pl.col("late_rank").max().cast(pl.Int64).alias("late"))
        )
        revised = (  # revisions 1.. of the (few) generations with late events
            gens.join(late, on="generation_id")
            .with_columns(pl.int_ranges(1, pl.col("late") + 1, dtype=pl.Int64).alias("revision"))
            .explode("revision")
            .drop("late")
        )
        first = gens.with_columns(pl.lit(0, pl.Int64).alias("revision"))
        records = pl.concat([first, revised]).with_columns(pl.col("revision").alias("late_events"))
        rows = pl.concat([
            feedback.filter(pl.col("late_rank") == 0).with_columns(pl.lit(0, pl.Int64).alias("revision")),
            feedback.join(revised.select("generation_id", "revision"), on="generation_id")
            .filter(pl.col("late_rank") <= pl.col("revision")),
        ])  # fmt: skip
    scored = score_frame(definition, records, rows.drop("late_rank"))
    return scored.drop("generation_id", "gen_idx").rename({"id_": "generation_id"})


def recompute_records(
    settings: Settings,
    definition: RewardDefinition,
    events: pl.DataFrame | None = None,
    *,
    config: SignalsConfig | None = None,
    now: datetime | None = None,
    final_only: bool = False,
) -> list[RewardRecord]:
    """`recompute_scores` as the records the stream would emit (`final_only`: one per generation)."""
    now = now or utcnow()
    scored = recompute_scores(settings, definition, events, config=config, now=now, final_only=final_only)
    if scored.is_empty():
        return []
    names = signal_names(definition)
    return [
        RewardRecord(
            generation_id=row["generation_id"],
            reward_version=definition.version,
            revision=row["revision"],
            reward=row["reward"],
            confidence=row["confidence"],
            label_source=row["label_source"],
            signals=signals_of(row, names),
            user_id=row["user_id"],
            model_version=row["model_version"],
            arm=row["arm"],
            experiment=row["experiment"],
            window_start=from_us(row["ts_us"]),
            window_end=from_us(row["window_end"]),
            late_events=row["late_events"],
            emitted_at=now,
        )
        for row in scored.sort("window_end", "generation_id", "revision").iter_rows(named=True)
    ]


def _definition(settings: Settings, version: str) -> RewardDefinition:
    return DefinitionStore(settings, redis_client(settings)).get(version)


def recompute_rewards(settings: Settings, version: str, **kwargs: object) -> pl.DataFrame:
    """`recompute_records` for a stored version, as a lake-shaped frame."""
    return rewards_frame(recompute_records(settings, _definition(settings, version), **kwargs))  # type: ignore[arg-type]


def backfill(settings: Settings, version: str) -> tuple[int, int]:
    """Write the version's final record of every generation that has none in the lake yet (one record
    per generation, never a default followed by revisions); returns (written, already present).
    Activating the version is a separate step (`flywheel signals activate`): until then the trainer
    and the gate do not read it."""
    DefinitionStore(settings, redis_client(settings)).ensure_pointer()
    records = recompute_records(settings, _definition(settings, version), final_only=True)
    table = REWARDS.at(settings.lake_root)
    existing = read_rewards(table).filter(pl.col("reward_version") == version)
    have = set(existing["generation_id"].to_list())
    missing = [r for r in records if r.generation_id not in have]
    if missing:
        write_rewards(table, missing, f"recompute-{version}-{utcnow():%Y%m%dT%H%M%S%f}")
    return len(missing), len(records) - len(missing)


def parity(settings: Settings, version: str) -> dict[str, int]:
    """How the lake's records of `version` (what the stream wrote) compare with the recompute's, per generation's
    final record: same revision and reward (`agree`), another revision (`revision_differs`), same revision but
    another reward (`reward_differs`), a generation only one side has (`only_stream`, `only_recompute`).
    Revisions count: a replay that gave a default and then revisions differs from one final record."""
    recomputed = rewards_frame(recompute_records(settings, _definition(settings, version)))
    lake = read_rewards(REWARDS.at(settings.lake_root)).filter(pl.col("reward_version") == version)

    def finals(df: pl.DataFrame) -> pl.DataFrame:
        return df.sort("revision").group_by("generation_id").agg(pl.col("revision", "reward").last())

    both = finals(lake).join(finals(recomputed), on="generation_id", how="full", suffix="_recompute")
    stream_only = both["generation_id_recompute"].is_null()
    recompute_only = both["generation_id"].is_null()
    matched = both.filter(~stream_only & ~recompute_only)
    same_revision = matched["revision"] == matched["revision_recompute"]
    same_reward = matched["reward"] == matched["reward_recompute"]
    return {
        "generations": both.height,
        "agree": int((same_revision & same_reward).sum()),
        "revision_differs": int((~same_revision).sum()),
        "reward_differs": int((same_revision & ~same_reward).sum()),
        "only_stream": int(stream_only.sum()),
        "only_recompute": int(recompute_only.sum()),
    }
