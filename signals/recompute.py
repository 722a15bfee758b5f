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
from signals.columns import ENGINE, in_chunks, score_frame, signal_names, signals_column
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
    ).rechunk()  # parsed in small chunks: made one, as a gather of text from many takes twice the CPU time or more


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


def _firsts(values: pl.Series) -> pl.Series:
    """True on the first row of each value of `values`, in order (`is_first_distinct`).

    Found from the values' 64-bit hashes, not with a hash set of the values: a row whose hash no other row has is a
    first; only the rows that share a hash (the copies, and any collision) are compared by value, in order. The
    shared hashes are read off the hashes sorted (`np.sort`: at 10M events a tenth of the CPU time of polars'
    `arg_sort`, a twentieth of `is_first_distinct` on the ids' text)."""
    hashes = values.hash()
    ranked = np.sort(hashes.to_numpy())
    shared_hashes = np.unique(ranked[1:][ranked[1:] == ranked[:-1]])
    firsts = pl.Series("first", np.ones(len(values), dtype=bool))
    if len(shared_hashes):
        shared = hashes.is_in(pl.Series(shared_hashes, dtype=pl.UInt64).implode()).arg_true()
        firsts.scatter(shared, values.gather(shared).is_first_distinct())
    return firsts


def _rows_of(values: pl.Series, keys: pl.Series) -> pl.Series:
    """Per row of `values`: the row of `keys` (distinct values) holding its value, else null (and null for null).

    Looked up by the values' 64-bit hashes (a join of integers: at 10M feedback events to 2.5M generation ids,
    about half the CPU time of a join on the ids' text), each match then checked by value, so a value whose hash
    only collides with a key's finds none. Where two keys share a hash, joined on the values themselves."""
    rows = pl.int_range(len(keys), dtype=pl.UInt32, eager=True).alias("row")
    hashes = keys.hash()
    if hashes.n_unique() < len(keys):
        table = pl.DataFrame({"key": keys, "row": rows})
        return values.alias("key").to_frame().join(table, on="key", how="left", maintain_order="left")["row"]
    table = pl.DataFrame({"hash": hashes, "row": rows})
    found = values.hash().alias("hash").to_frame().join(table, on="hash", how="left", maintain_order="left")["row"]
    same = values == keys.gather(found)  # null where none was found or `values` is null
    return found.to_frame().select(pl.when(same).then(pl.col("row"))).to_series()


def _first_copies(events: pl.DataFrame) -> pl.Series:
    """True on the first row of each event (`EVENTS.key`), in frame order (`_firsts`)."""
    key = list(EVENTS.key)
    return _firsts(events.get_column(key[0]) if len(key) == 1 else events.select(pl.struct(key)).to_series())


def _closing_rows(
    df: pl.DataFrame, starts: list[int], gens: pl.DataFrame, lanes: tuple[str, ...]
) -> pl.Series:
    """Per row of `gens` (`kafka_partition`, `lane`, `window_end`): the first row of its partition in `df` (which
    holds each partition's rows as one slice, `starts`, with its position `pos`) at which the watermark of its
    lane (`df`'s column `lanes[lane]`, never going down along a partition) reaches `window_end`; else null.

    A binary search of each partition's watermarks (`np.searchsorted`), not an as-of join of the watermark's steps:
    no frame of the steps, no grouping by partition and lane."""
    out = np.full(gens.height, -1, dtype=np.int64)
    part = df.get_column("kafka_partition")
    slices = {part[a]: (a, b) for a, b in zip(starts, starts[1:], strict=False) if part[a] is not None}
    if not slices:
        return pl.Series("close", [None] * gens.height, dtype=pl.Int64)
    gen_part, gen_lane = gens.get_column("kafka_partition"), gens.get_column("lane")
    window_end = gens.get_column("window_end")
    known = (gen_part.is_not_null() & gen_lane.is_not_null() & window_end.is_not_null()).to_numpy()
    ends = window_end.fill_null(0).to_numpy()
    # the gens of each (partition, lane), grouped once by a sort of their partition's slice and lane
    slice_of = gen_part.replace_strict(list(slices), list(range(len(slices))), default=None, return_dtype=pl.Int64)
    code = np.where(known, (slice_of * len(lanes) + gen_lane.cast(pl.Int64)).fill_null(-1).to_numpy(), -1)
    order = np.argsort(code, kind="stable")
    bounds = np.searchsorted(code[order], np.arange(len(slices) * len(lanes) + 1) - 0.5)
    for i, (a, b) in enumerate(slices.values()):
        for lane, column in enumerate(lanes):
            rows = order[bounds[i * len(lanes) + lane] : bounds[i * len(lanes) + lane + 1]]
            if not len(rows):
                continue
            wm = df.get_column(column).slice(a, b - a)
            valid = np.flatnonzero(wm.is_not_null().to_numpy())  # positions in the partition with a watermark
            at = np.searchsorted(wm.drop_nulls().to_numpy(), ends[rows], side="left")
            found = at < len(valid)
            out[rows[found]] = valid[at[found]]
    rows_at = pl.Series("close", out)
    return rows_at.to_frame().select(pl.when(rows_at >= 0).then(rows_at)).to_series()


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
    sorts, joins and groups several times faster than the id's text. The feedback's on-time rows come first.

    The rows are planned on their numbers in `events` (`_ev`) and integer columns; the text of the rows kept
    (ids, properties) is gathered once at the end: a gather of 10M properties takes most of a second."""
    window_us = int(round(window_s * 1e6))
    lateness_us = int(round(lateness_s * 1e6))
    backfill_after_us = int(round(backfill_after_s * 1e6))
    lane_order = ["kafka_partition", "kafka_offset"]
    if not _is_sorted(events, *lane_order):  # the lake's rows mostly come in that order already
        events = events.sort(*lane_order)
    size = pl.col("properties").str.len_bytes().fill_null(2)  # of the text, "{}" where null
    df = (
        events.lazy()
        .select(
            pl.int_range(pl.len(), dtype=pl.UInt32).alias("_ev"),
            "type",
            "generation_id",
            "kafka_partition",
            pl.col("ts").dt.epoch("us").alias("ts_us"),
            pl.col("received_at").dt.epoch("us").alias("received_us"),
            *([] if max_feedback_bytes is None else [(size <= max_feedback_bytes).alias("_fits")]),
        )
        .filter(_first_copies(events))  # the first copy of each event counts
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
    df = df.hstack(pl.concat(pl.collect_all(running, engine=ENGINE), rechunk=True))
    idle_wm = to_us(now) - lateness_us - int(round(idle_grace_s * 1e6))
    is_generation = df.get_column("type") == "generation"
    first = df.filter(is_generation).select("_ev", "generation_id", "ts_us", "kafka_partition", "pos", "lane")
    first = first.filter(_firsts(first.get_column("generation_id")))
    first = first.with_columns((pl.col("ts_us") + window_us).alias("window_end"))
    fields = generation_fields(events.get_column("properties").gather(first.get_column("_ev")))
    mine = first.hstack(fields).filter(pl.col("surface") == surface)
    mine = mine.gather(mine.get_column("window_end").arg_sort())  # the order of the records
    mine = mine.with_columns(_closing_rows(df, starts, mine, ("wm0", "wm1")).alias("close_pos"))
    close_pos = (
        pl.when(pl.col("close_pos").is_null())
        .then(pl.when(pl.col("window_end") <= idle_wm).then(pl.lit(_NEVER)).otherwise(None))
        .otherwise(pl.max_horizontal("close_pos", "pos"))
        .alias("close_pos")
    )
    mine = mine.with_columns(close_pos).filter(pl.col("close_pos").is_not_null())
    gens = mine.select(
        "generation_id",
        events.get_column("user_id").gather(mine.get_column("_ev")),
        "ts_us",
        "kafka_partition",
        pl.col("pos").alias("gen_pos"),
        "window_end",
        *fields.columns,
        "close_pos",
    ).with_row_index("gen_idx")
    candidates = df.filter(~is_generation)
    if max_feedback_bytes is not None:
        candidates = candidates.filter("_fits")
    # each candidate's generation, by its id alone (keeping the candidates' order, which is arrival order per
    # partition): the cap counts a generation's events in every partition
    gen_idx = _rows_of(candidates.get_column("generation_id"), gens.get_column("generation_id"))
    feedback = candidates.select("_ev", "kafka_partition", "ts_us", "pos", gen_idx.alias("gen_idx"))
    feedback = feedback.filter(pl.col("gen_idx").is_not_null())
    of_gen = gens.select(pl.col("kafka_partition").alias("_gen_partition"), "window_end", "close_pos")
    feedback = feedback.hstack(of_gen.gather(feedback.get_column("gen_idx")))
    keep = pl.col("kafka_partition") == pl.col("_gen_partition")
    if max_feedback is not None:  # the worker's cap: the first ones of each generation, in arrival order
        idx = feedback.get_column("gen_idx").to_numpy()
        counts = np.bincount(idx, minlength=gens.height)
        flooded = counts[idx] > max_feedback  # numbering a generation's rows costs more than counting them
        if flooded.any():
            rank = np.zeros(len(idx), dtype=np.int64)
            rows = np.flatnonzero(flooded)
            rank[rows] = pl.DataFrame({"g": idx[rows]}).select(pl.int_range(pl.len()).over("g")).to_series()
            keep = keep & pl.Series(rank < max_feedback)
    feedback = feedback.filter(keep & (pl.col("ts_us") <= pl.col("window_end")))
    # only the (few) late events need numbering, in arrival order (the rows'); the rest are rank 0, and come first
    is_late = (feedback.get_column("pos") >= feedback.get_column("close_pos")).to_numpy()
    late = np.flatnonzero(is_late)
    feedback = feedback.select("_ev", "gen_idx", "ts_us")[np.concatenate([np.flatnonzero(~is_late), late])]
    rank = np.zeros(feedback.height, dtype=np.int64)
    if len(late):
        by = feedback.select(pl.col("gen_idx").alias("g")).tail(len(late))
        rank[-len(late) :] = by.select(pl.int_range(1, pl.len() + 1).over("g")).to_series()
    text = events.select("event_id", "type", "properties").gather(feedback.get_column("_ev"))  # columns in parallel
    feedback = pl.concat([feedback, text, pl.DataFrame({"late_rank": rank})], how="horizontal").select(
        "gen_idx", "event_id", "type", "ts_us", "properties", "late_rank"
    )
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
        window_s=window_s(settings, definition),
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
        on_time = int((feedback.get_column("late_rank") == 0).sum())
        head = feedback.head(on_time)  # `plan_windows` puts them first: a slice, no copy of their text
        if head.get_column("late_rank").max() != 0:
            head = feedback.filter(pl.col("late_rank") == 0)
        rows = pl.concat([
            head.with_columns(pl.lit(0, pl.Int64).alias("revision")),
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
    ordered = scored.sort("window_end", "generation_id", "revision")
    signals = signals_column(ordered, signal_names(definition))  # as the streaming worker reads them
    return [
        RewardRecord(
            generation_id=row["generation_id"],
            reward_version=definition.version,
            revision=row["revision"],
            reward=row["reward"],
            confidence=row["confidence"],
            label_source=row["label_source"],
            signals=row_signals,
            user_id=row["user_id"],
            model_version=row["model_version"],
            arm=row["arm"],
            experiment=row["experiment"],
            window_start=from_us(row["ts_us"]),
            window_end=from_us(row["window_end"]),
            late_events=row["late_events"],
            emitted_at=now,
        )
        for row, row_signals in zip(ordered.iter_rows(named=True), signals, strict=True)
    ]


def stored_definition(settings: Settings, version: str) -> RewardDefinition:
    """The definition of `version`: a built-in one, or the deployment's stored one (`DefinitionStore`)."""
    return DefinitionStore(settings, redis_client(settings)).get(version)


def recompute_rewards(settings: Settings, version: str, **kwargs: object) -> pl.DataFrame:
    """`recompute_records` for a stored version, as a lake-shaped frame."""
    return rewards_frame(recompute_records(settings, stored_definition(settings, version), **kwargs))  # type: ignore[arg-type]


def backfill(settings: Settings, version: str) -> tuple[int, int]:
    """Write the version's final record of every generation that has none in the lake yet (one record
    per generation, never a default followed by revisions); returns (written, already present).
    Activating the version is a separate step (`flywheel signals activate`): until then the trainer
    and the gate do not read it."""
    DefinitionStore(settings, redis_client(settings)).ensure_pointer()
    records = recompute_records(settings, stored_definition(settings, version), final_only=True)
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
    Revisions count: a replay that gave a default and then revisions differs from one final record.

    `window_differs`: the lake's final records whose window is not the one these `settings` give the version (the
    stream ran with others, as `flywheel up` runs with 60-s windows): the recompute then closes other windows, or
    none yet, and the rest of the comparison says little (`window_s` gives these settings' window)."""
    definition = stored_definition(settings, version)
    recomputed = rewards_frame(recompute_records(settings, definition))
    lake = read_rewards(REWARDS.at(settings.lake_root)).filter(pl.col("reward_version") == version)

    def finals(df: pl.DataFrame) -> pl.DataFrame:
        window_us = (pl.col("window_end") - pl.col("window_start")).dt.total_microseconds()
        return df.sort("revision").group_by("generation_id").agg(pl.col("revision", "reward").last(),
                                                                 window_us.last().alias("window_us"))  # fmt: skip

    stream = finals(lake)
    both = stream.join(finals(recomputed), on="generation_id", how="full", suffix="_recompute")
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
        "window_differs": int((stream["window_us"] != int(round(window_s(settings, definition) * 1e6))).sum()),
    }


def window_s(settings: Settings, definition: RewardDefinition) -> float:
    """The window `settings` give `definition`'s generations (the worker's and the recompute's)."""
    return definition.window(settings.window_for(definition.surface))
