"""Reward definitions as polars column expressions: many generations scored at once.

Both drivers score through `score_frame`: the batch recompute over the lake's rows, the streaming
worker over each micro-batch of closed windows. So a version turns the same events into the same
record on both paths by construction, and a batch costs a few vectorised passes instead of Python
code per generation.

Inputs (`FEEDBACK_SCHEMA`, `GENERATION_SCHEMA`): one row per in-window feedback event and one per
record to score, both keyed by (`generation_id`, `revision`); a record's events are the feedback rows of
its key. Properties stay the JSON text the lake holds (the stream serialises its dicts the same way)
and are read by the same code (`_parsed_properties`: each event's once), so a property means the same
thing on both paths.

What must hold: for every signal in `SIGNALS`, the value is what the per-generation reference
(`signals.features`, through `RewardDefinition.score`) gives, absent (null) where it gives nothing;
`tests/test_signals_columns.py` checks it signal by signal on null, empty, duplicated, out-of-order
and extreme inputs. Events of a record are read in (event time, event id) order, whatever order the
rows come in. Numbers in properties: a JSON number, a numeric string (surrounding blanks allowed) or a
boolean; anything else, or a non-finite value, is "not given".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import polars as pl

from signals.features import RETENTION_CHECKPOINTS_S
from signals.reward import RewardDefinition
from signals.sentiment import Sentiment

KEY = ("generation_id", "revision")
# polars' in-memory engine, not its default streaming one: these plans are sorts, group-bys and joins of frames
# already in memory, which it runs in less CPU time (the typed feedback of 1M events: 0.36 s against 0.60 s)
ENGINE: Final = "in-memory"

FEEDBACK_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {
    "generation_id": pl.String,
    "revision": pl.Int64,
    "event_id": pl.String,
    "type": pl.String,
    "ts_us": pl.Int64,
    "properties": pl.String,
}
GENERATION_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {
    "generation_id": pl.String,
    "revision": pl.Int64,
    "finish_reason": pl.String,
    "completion_chars": pl.Int64,
}

_DECIDED = ("accepted", "rejected", "ignored")
# Signals that make a record "implicit" rather than "default" (`RewardDefinition.score_implicit`).
_IMPLICIT = ("shown", "copied", "regenerated", "followup", "edit_distance", "retention", "undone")


# What the signals read of an event's properties, by event type: `typed_feedback` parses each event's once
PROPERTIES: Final[dict[str, tuple[str, ...]]] = {
    "thumbs": ("value", "comment"),
    "accepted": ("accepted_chars", "total_chars"),
    "undone": ("seconds_after_accept",),
    "edited": ("edit_distance",),
    "retained": ("seconds_after_accept", "fraction_present"),
    "followup": ("text",),
}
# The keys of those that the signals read as numbers (`_num`): parsed to floats, not text
NUMBERS: Final = frozenset(
    {"accepted_chars", "total_chars", "seconds_after_accept", "fraction_present", "edit_distance"}
)


def _parsed_properties(events: pl.DataFrame, type_: str, properties: pl.Series) -> pl.DataFrame:
    """`_row`, `_record`, `ts_us` and, for each key of `PROPERTIES[type_]`, column `_<key>` of the events of `type_`
    among the typed frame's rows `events` (`_in`: each one's row in `properties`, their JSON text): the key's value
    as text (a JSON string's content, else the JSON of the value), null when absent or JSON null; for a key of
    `NUMBERS`, the value as a number instead (`_num` of that text), and `_<key>_given`: whether it is there and not
    JSON null (a value `_num` cannot read is given, yet no number).

    The type's events are parsed in one pass for all their keys (`str.json_decode` to a struct: a third of the CPU
    time of one `json_path_match` per key, and only on the events of the type). Numbers are decoded to floats where
    every value of them is a JSON number or boolean (what `_num` reads of their text, to the bit: the text of a
    JSON number is the exact decimal of the float the parser reads): half the CPU time of decoding them to text
    and reading that back. Else (a numeric string) the type is decoded to text, and where its text is not all
    objects of plain values (a value that is an object or a list, text that is no JSON), its keys are read with
    `json_path_match`, which reads such text too (numbers through its own float parse)."""
    keys = PROPERTIES[type_]
    numbers = [k for k in keys if k in NUMBERS]
    rows = events.select("_row", "_record", "ts_us", "_in").filter(events.get_column("type") == type_)  # 4 columns
    text = in_chunks(properties.gather(rows.get_column("_in")).fill_null("{}").alias("properties").to_frame())
    props = pl.col("properties")
    try:
        typed = pl.Struct({k: pl.Float64 if k in NUMBERS else pl.String for k in keys})
        parsed = text.select(props.str.json_decode(typed)).unnest("properties")
        value: dict[str, pl.Expr] = {k: pl.when(pl.col(k).is_finite()).then(pl.col(k)) for k in numbers}
    except pl.exceptions.ComputeError:
        try:
            parsed = text.select(props.str.json_decode(pl.Struct({k: pl.String for k in keys}))).unnest("properties")
        except pl.exceptions.ComputeError:
            parsed = text.select(props.str.json_path_match(f"$.{k}").alias(k) for k in keys)
        value = {k: _num(pl.col(k)) for k in numbers}
    columns = [value.get(k, pl.col(k)).alias(f"_{k}") for k in keys]
    given = [pl.col(k).is_not_null().alias(f"_{k}_given") for k in numbers]
    return rows.drop("_in").hstack(parsed.select(*columns, *given)).rechunk()


def in_chunks(frame: pl.DataFrame, rows: int = 16_384) -> pl.DataFrame:
    """`frame` held as chunks of `rows` rows, no data copied: polars runs a string expression (a JSON parse) on
    the chunks of a column in parallel, and a JSON decode takes about half the CPU time in small ones."""
    if frame.height <= rows:
        return frame
    return pl.concat([frame.slice(i, rows) for i in range(0, frame.height, rows)], rechunk=False)


def _num(raw: pl.Expr) -> pl.Expr:
    """A finite float from a property's text, or null (`features._num`'s reading: bad input is "not given").
    `raw` is evaluated several times: pass a column, not a parse."""
    text = raw.str.strip_chars()
    value = (
        pl.when(text == "true")
        .then(pl.lit(1.0))
        .when(text == "false")
        .then(pl.lit(0.0))
        .otherwise(text.cast(pl.Float64, strict=False))
    )
    return pl.when(value.is_finite()).then(value)


def _divide(values: pl.Expr, by: float) -> pl.Expr:
    """`values / by`, correctly rounded like Python's: polars divides a column by a scalar as a product
    with its reciprocal (an ulp off at times), so divide element by element."""

    def divide(column: pl.Series) -> pl.Series:
        return column.cast(pl.Float64) / pl.Series(np.full(len(column), by))

    return values.map_batches(divide, return_dtype=pl.Float64)


def _seconds(us: pl.Expr) -> pl.Expr:
    return _divide(us, 1e6)


def _is(*types: str) -> pl.Expr:
    """Whether each event is of one of `types`: equalities, several times cheaper than `is_in` on text."""
    return pl.any_horizontal([pl.col("type") == t for t in types])


def _first_row(cond: pl.Expr) -> pl.Expr:
    """The typed frame's row (`_row`) of a record's first event meeting `cond`, else null.

    A whole-column expression reduced by a plain `min` (and `_last_row`'s `max`): polars aggregates those
    without building each group's filtered values, several times faster than `filter(cond).first()`. The
    value at the row is read after the group-by (`Pick`), for the records only."""
    return pl.when(cond).then(pl.col("_row")).min()


def _last_row(cond: pl.Expr) -> pl.Expr:
    return pl.when(cond).then(pl.col("_row")).max()


def _flag(cond: pl.Expr) -> pl.Expr:
    """1.0 when any event of the record meets `cond`, else null (not observed)."""
    return pl.when(cond.any()).then(pl.lit(1.0))


def _accepted_by(undone: pl.DataFrame, accepted: pl.DataFrame) -> pl.DataFrame:
    """`undone` (parsed events, `_parsed_properties`) with `_accepted_by_us`: the time of the record's latest
    `accepted` event (`accepted`) at or before the event's time (ties in time after it included), else null.

    An as-of join by record of the two types' events, each in time order within a record: not a fill along every
    event of every type."""
    accepts = accepted.select("_record", pl.col("ts_us").alias("_accepted_by_us"))
    return undone.join_asof(
        accepts, left_on="ts_us", right_on="_accepted_by_us", by="_record", strategy="backward", check_sortedness=False
    )  # sorted within each record, which is what an as-of join by record reads; polars cannot check it with `by`


def _time_order(frame: pl.DataFrame) -> pl.DataFrame:
    """`frame` sorted by (`KEY`, `ts_us`), ties in any order.

    Where the three are integers whose spans fit 63 bits together (the recompute's record numbers, revisions and
    times of a day's events), sorted by one integer that packs them: a sort of one column takes half the CPU time
    of a sort by three (with numpy's, a fifth)."""
    gid, revision, ts = (frame.get_column(c) for c in (*KEY, "ts_us"))
    if frame.is_empty() or not gid.dtype.is_integer() or any(c.has_nulls() for c in (gid, revision, ts)):
        return frame.sort(*KEY, "ts_us")
    lows = [int(c.min()) for c in (gid, revision, ts)]  # type: ignore[arg-type]
    bits = [(int(c.max()) - low).bit_length() for c, low in zip((gid, revision, ts), lows, strict=True)]  # type: ignore[arg-type]
    if sum(bits) > 63:
        return frame.sort(*KEY, "ts_us")
    packed = frame.select(
        ((pl.col(KEY[0]).cast(pl.Int64) - lows[0]) * 2 ** (bits[1] + bits[2])
         + (pl.col(KEY[1]) - lows[1]) * 2 ** bits[2] + (pl.col("ts_us") - lows[2])).alias("_order")
    ).to_series()  # fmt: skip
    # numpy's sort (vectorised: a third of polars' `arg_sort`'s CPU time), gathered from one chunk (a frame of many,
    # as a filter leaves it, gathers several times slower)
    return frame.rechunk().gather(pl.Series(np.argsort(packed.to_numpy())))


def typed_feedback(feedback: pl.DataFrame) -> tuple[pl.DataFrame, dict[str, pl.DataFrame]]:
    """The feedback rows in (time, id) order per record, numbered (`_row`) and with their record's number
    (`_record`), without their ids and properties; and per type of `PROPERTIES`, its events' properties parsed
    (`_parsed_properties`; thumbs' `value` lowercased; undos with `_accepted_by_us`, `_accepted_by`). The rows
    carry `_vote`: a thumbs event whose value is up or down (in any case)."""
    new_record = pl.any_horizontal([pl.col(k).ne_missing(pl.col(k).shift(1)) for k in KEY])
    # sorted without the id and the properties (text: a sort moves them at a cost), by the id too only where two
    # events of a record share a time, then by their order in `feedback` (`_in`): the order of a stable sort by
    # (record, time, id), from two sorts that need not be stable (an unstable sort takes a third less CPU time)
    events = (
        feedback.lazy()
        .select(*KEY, "type", "ts_us", pl.int_range(pl.len(), dtype=pl.UInt32).alias("_in"))
        .filter(pl.col("type") != "generation")
        .collect(engine=ENGINE)
    )
    ordered = _time_order(events).with_columns(
        new_record.cum_sum().alias("_record"),
        (~new_record & pl.col("ts_us").eq_missing(pl.col("ts_us").shift(1))).alias("_tie"),
    )
    if ordered.get_column("_tie").any():
        ids = feedback.get_column("event_id").gather(ordered.get_column("_in"))
        ordered = ordered.with_columns(ids).sort("_record", "ts_us", "event_id", "_in").drop("event_id")
    ordered = ordered.drop("_tie").with_columns(pl.int_range(pl.len(), dtype=pl.UInt32).alias("_row"))
    # in one chunk: a gather of strings from a column of several (the recompute's on-time rows and its revisions)
    # takes ten times the CPU time (10M events: 1.6 s against 0.1 s, and 0.2 s to rechunk)
    properties = feedback.get_column("properties").rechunk()
    parsed = {t: _parsed_properties(ordered, t, properties) for t in PROPERTIES}
    parsed["thumbs"] = parsed["thumbs"].with_columns(pl.col("_value").str.to_lowercase())
    parsed["undone"] = _accepted_by(parsed["undone"], parsed["accepted"])
    vote = np.zeros(ordered.height, dtype=bool)
    vote[parsed["thumbs"].filter(pl.col("_value").is_in(["up", "down"])).get_column("_row").to_numpy()] = True
    return in_chunks(ordered.drop("_in").with_columns(pl.Series("_vote", vote))), parsed


@dataclass(frozen=True)
class Pick:
    """Column `name` of a record: the value of `column` of the event of type `of` at the typed frame's row that the
    record's column `row` holds (`_first_row`, `_last_row`), from that type's parsed events (`_parsed_properties`);
    null without one."""

    name: str
    row: str
    of: str
    column: str


def _picked(parsed: dict[str, pl.DataFrame], per_record: pl.DataFrame, picks: Sequence[Pick]) -> pl.DataFrame:
    columns = []
    for of, row in dict.fromkeys((p.of, p.row) for p in picks):
        events, rows = parsed[of], per_record.get_column(row)
        # a type's events are in row order: a record's is found by a binary search of its row
        at = events.get_column("_row").search_sorted(rows, side="left").clip(upper_bound=max(events.height - 1, 0))
        for p in picks:
            if (p.of, p.row) == (of, row):
                values = events.get_column(p.column)
                value = values.gather(at) if len(values) else pl.repeat(None, len(rows), dtype=values.dtype, eager=True)
                columns.append(value.zip_with(rows.is_not_null(), pl.Series([None], dtype=values.dtype)).alias(p.name))
    return per_record.hstack(columns)


# ---------------------------------------------------------------------- signals


@dataclass(frozen=True)
class Signal:
    """One named signal: what it means and where it comes from (`doc`), the expressions that aggregate a
    record's feedback events into its raw columns (`aggregate`: each a whole-column expression reduced by
    `any`, `min`, `max`, `sum` or `len`, the form polars aggregates fastest), the values read at the event
    rows those name (`picks`), and the expressions that turn the raw columns into its values once joined to
    its generation (`finish`). A value left null is "not observed". (Retention's checks are aggregated from
    a frame of their own, `retention_checks`, sorted once by time after accept; edits' distances are summed
    in one, `edit_sums`.)"""

    name: str
    doc: str
    aggregate: Callable[[RewardDefinition], list[pl.Expr]]
    finish: Callable[[RewardDefinition], list[pl.Expr]]
    produces: tuple[str, ...]
    picks: tuple[Pick, ...] = ()


def _sentiment_of(fn: Sentiment) -> Callable[[pl.Series], pl.Series]:
    """`fn` over a column of texts, each distinct text scored once (a text model is called in bulk)."""

    def run(texts: pl.Series) -> pl.Series:
        distinct = texts.drop_nulls().unique()
        scores = {t: float(fn(t)) for t in distinct.to_list()}
        return texts.replace_strict(scores, default=None, return_dtype=pl.Float64)

    return run


def _thumbs_agg(d: RewardDefinition) -> list[pl.Expr]:
    return [_last_row(pl.col("_vote")).alias("_thumbs_row")]  # the latest vote wins


def _thumbs_finish(d: RewardDefinition) -> list[pl.Expr]:
    thumbs = pl.when(pl.col("_thumbs_value") == "up").then(1.0).when(pl.col("_thumbs_row").is_not_null()).then(-1.0)
    comment = pl.col("_thumbs_comment").fill_null("")
    has_text = thumbs.is_not_null() & (comment.str.strip_chars() != "")
    # `str(comment or "")`: a JSON false or 0 is no comment
    text = pl.when(has_text & ~comment.is_in(["false", "0", "0.0"])).then(comment)
    return [
        thumbs.alias("thumbs"),
        text.map_batches(_sentiment_of(d.sentiment), return_dtype=pl.Float64).alias("thumbs_comment_sentiment"),
    ]


def _decision_agg(d: RewardDefinition) -> list[pl.Expr]:
    return [
        _last_row(_is("accepted")).alias("_accept_row"),  # partial accepts: the latest accept's char counts
        *(_is(t).any().alias(f"_any_{t}") for t in ("shown", "rejected", "ignored")),
    ]


def _decision_finish(d: RewardDefinition) -> list[pl.Expr]:
    total = pl.col("_total_chars").fill_null(0.0)
    chars = pl.coalesce(pl.col("_accepted_chars"), total)
    took = pl.col("_accept_row").is_not_null()
    rejected, ignored = pl.col("_any_rejected"), pl.col("_any_ignored")
    return [
        pl.when(pl.col("_any_shown") | took | rejected | ignored).then(1.0).alias("shown"),
        pl.when(took).then(1.0).alias("accepted"),
        pl.when(took)
        .then(pl.when(total > 0).then((chars / total).clip(0.0, 1.0)).otherwise(1.0))
        .alias("accepted_fraction"),
        pl.when(took).then(pl.max_horizontal(pl.lit(0.0), chars)).alias("accepted_chars"),
        pl.when(~took & rejected).then(1.0).alias("rejected"),  # an accept outranks a reject
        pl.when(~took & ~rejected & ignored).then(1.0).alias("ignored"),
    ]


def _undo_agg(d: RewardDefinition) -> list[pl.Expr]:
    return [_first_row(_is("undone")).alias("_undo_row")]


def _undo_finish(d: RewardDefinition) -> list[pl.Expr]:
    # the latest accept at or before the first undo (`_accepted_by`)
    gap_us = (pl.col("_undo_ts_us") - pl.col("_undo_accept_us")).fill_null(0)
    given = pl.col("_undo_given").fill_null(False)  # a given value that is no number counts as 0 s
    measured = pl.when(given).then(pl.col("_undo_secs").fill_null(0.0)).otherwise(_seconds(gap_us))
    secs = pl.when(pl.col("_undo_row").is_not_null()).then(pl.max_horizontal(pl.lit(0.0), measured))
    return [
        pl.when(secs <= d.undo_window_s).then(1.0).when(secs.is_not_null()).then(0.5).alias("undone"),
        secs.alias("undo_s"),
    ]


def edit_sums(edited: pl.DataFrame) -> pl.LazyFrame:
    """One row per record with `edited` events (`edited`: their parsed properties, `typed_feedback`): `_edit_sum`,
    their distances summed in event order.

    Apart from the other aggregations (`score_frame`): a float sum's last bits depend on the order of its
    terms, and polars' streaming engine may add a record's partial sums in another one."""
    distance = pl.col("_edit_distance").fill_null(0.0).clip(lower_bound=0.0).sum()
    return edited.lazy().group_by("_record").agg(distance.alias("_edit_sum"))


def _edits_finish(d: RewardDefinition) -> list[pl.Expr]:
    distance = pl.col("_edit_sum")
    length = pl.max_horizontal(pl.lit(1), pl.col("completion_chars")).cast(pl.Float64)
    ratio = distance / length
    return [
        distance.alias("edit_distance"),
        pl.when(ratio.is_not_null()).then(pl.min_horizontal(pl.lit(1.0), ratio)).alias("edit_ratio"),
    ]


def retention_checks(retained: pl.DataFrame) -> pl.LazyFrame:
    """One row per record (`_record`) with `retained` checks (`retained`: their parsed properties,
    `typed_feedback`): `retention` and `retained_<c>s` (`features.retention`).

    The checks are put in order of their time after the accept once, for all records (ties keep event-time
    order), so each value is a first or last within its record rather than a sort per record."""
    secs = pl.col("_seconds_after_accept").fill_null(0.0).clip(lower_bound=0.0)
    frac = pl.col("_fraction_present").fill_null(1.0).clip(0.0, 1.0)
    checks = (
        retained.lazy()
        .select("_record", secs.alias("_secs"), frac.alias("_frac"))
        .sort("_record", "_secs", maintain_order=True)
    )
    return checks.group_by("_record", maintain_order=True).agg(
        pl.col("_frac").last().alias("retention"),
        *(
            pl.col("_frac").filter(pl.col("_secs") >= c).first().alias(f"retained_{c}s")
            for c in RETENTION_CHECKPOINTS_S
        ),
    )


def _retention_finish(d: RewardDefinition) -> list[pl.Expr]:
    return [(pl.col("accepted_chars").fill_null(0.0) * pl.col("retention")).alias("retained_chars")]


def _copy_agg(d: RewardDefinition) -> list[pl.Expr]:
    return [_flag(_is("copied")).alias("copied"), _flag(_is("regenerated")).alias("regenerated")]


def _followup_agg(d: RewardDefinition) -> list[pl.Expr]:
    return [_first_row(_is("followup")).alias("_followup_row")]


def _followup_finish(d: RewardDefinition) -> list[pl.Expr]:
    followed = pl.col("_followup_row").is_not_null()
    raw = pl.col("_followup_text").fill_null("")
    text = pl.when(followed).then(pl.when(raw.is_in(["false", "0", "0.0"])).then(pl.lit("")).otherwise(raw))
    return [
        pl.when(followed).then(1.0).alias("followup"),
        text.map_batches(_sentiment_of(d.sentiment), return_dtype=pl.Float64).alias("followup_sentiment"),
    ]


def _dwell_agg(d: RewardDefinition) -> list[pl.Expr]:
    # a record's events are in time order: its first event of a kind is the earliest one
    return [
        pl.when(_is("shown")).then(pl.col("ts_us")).min().alias("_shown_us"),
        pl.when(_is(*_DECIDED)).then(pl.col("ts_us")).min().alias("_decided_us"),
    ]


def _dwell_finish(d: RewardDefinition) -> list[pl.Expr]:
    gap = _seconds(pl.col("_decided_us") - pl.col("_shown_us"))
    return [pl.when(gap.is_not_null()).then(pl.max_horizontal(pl.lit(0.0), gap)).alias("dwell_s")]


def _none(d: RewardDefinition) -> list[pl.Expr]:
    return []


SIGNALS: tuple[Signal, ...] = (
    Signal(
        "thumbs",
        "Explicit vote; the latest `thumbs` {value: up|down} wins, its `comment` scored by the "
        "definition's sentiment (`features.thumbs`).",
        _thumbs_agg,
        _thumbs_finish,
        ("thumbs", "thumbs_comment_sentiment"),
        (
            Pick("_thumbs_value", "_thumbs_row", "thumbs", "_value"),
            Pick("_thumbs_comment", "_thumbs_row", "thumbs", "_comment"),
        ),
    ),
    Signal(
        "decision",
        "Shown / accepted (with partial accepts) / rejected / ignored; an accept outranks a reject "
        "(Cursor Tab's accept/reject reward, `features.decision`).",
        _decision_agg,
        _decision_finish,
        ("shown", "accepted", "accepted_fraction", "accepted_chars", "rejected", "ignored"),
        (
            Pick("_total_chars", "_accept_row", "accepted", "_total_chars"),
            Pick("_accepted_chars", "_accept_row", "accepted", "_accepted_chars"),
        ),
    ),
    Signal(
        "undo",
        "An undo after accepting, full weight within the definition's undo window (`features.undo`).",
        _undo_agg,
        _undo_finish,
        ("undone", "undo_s"),
        (
            Pick("_undo_given", "_undo_row", "undone", "_seconds_after_accept_given"),
            Pick("_undo_secs", "_undo_row", "undone", "_seconds_after_accept"),
            Pick("_undo_ts_us", "_undo_row", "undone", "ts_us"),
            Pick("_undo_accept_us", "_undo_row", "undone", "_accepted_by_us"),
        ),
    ),
    Signal(
        "edits",
        "Edit distance after accepting, summed, and its ratio to the completion (`features.edits`).",
        _none,
        _edits_finish,
        ("edit_distance", "edit_ratio"),
    ),
    Signal(
        "retention",
        "Accepted text still present at GitHub Copilot's checkpoints (`features.retention`).",
        _none,
        _retention_finish,
        ("retention", "retained_chars", *(f"retained_{c}s" for c in RETENTION_CHECKPOINTS_S)),
    ),
    Signal(
        "copy_regenerate",
        "Copied or regenerated (`features.copy_regenerate`).",
        _copy_agg,
        _none,
        ("copied", "regenerated"),
    ),
    Signal(
        "followup",
        "The first follow-up message and its sentiment, scored in bulk (`features.followup`).",
        _followup_agg,
        _followup_finish,
        ("followup", "followup_sentiment"),
        (Pick("_followup_text", "_followup_row", "followup", "_text"),),
    ),
    Signal(
        "dwell", "Seconds from shown to the first decision (`features.dwell`).", _dwell_agg, _dwell_finish, ("dwell_s",)
    ),
)
"""Every signal a definition reads, in the order the reference extracts them."""

# `score_frame`'s columns after the generation's, in the order they have always come
_COLUMN_ORDER = (
    "feedback_events", "thumbs", "shown", "accepted", "accepted_fraction", "accepted_chars", "rejected", "ignored",
    "edit_distance", "copied", "regenerated", "followup", "retention",
    *(f"retained_{c}s" for c in RETENTION_CHECKPOINTS_S), "declined", "thumbs_comment_sentiment", "undone", "undo_s",
    "edit_ratio", "retained_chars", "followup_sentiment", "dwell_s", "p_satisfied", "reward", "confidence",
    "label_source",
)  # fmt: skip

SIGNAL_COLUMNS: tuple[str, ...] = (
    "declined",
    "feedback_events",
    *(name for s in SIGNALS for name in s.produces),
)


# ---------------------------------------------------------------------- rewards


def _rules(d: RewardDefinition) -> list[pl.Expr]:
    """`RewardDefinition._rules` over columns, operation for operation (so floats agree to the bit)."""
    w = d.weights
    c = pl.col
    accepted = c("accepted").is_not_null()
    base = w.accept * c("accepted_fraction")
    after_undo = base + c("undone") * (w.undone - base)
    after_keep = base * (w.retention_floor + (1.0 - w.retention_floor) * c("retention"))
    kept = (
        pl.when(c("undone").is_not_null())
        .then(after_undo)
        .when(c("retention").is_not_null())
        .then(after_keep)
        .otherwise(base)
    )
    reward = (
        pl.when(accepted)
        .then(kept + w.edit * c("edit_ratio").fill_null(0.0))
        .when(c("rejected").is_not_null())
        .then(pl.lit(w.reject))
        .when(c("shown").is_not_null())
        .then(pl.lit(w.ignored))
        .otherwise(pl.lit(0.0))
    )
    evidence = (
        accepted.cast(pl.Int64)
        + (accepted & (c("undone").is_not_null() | c("retention").is_not_null())).cast(pl.Int64)
        + (~accepted & c("rejected").is_not_null()).cast(pl.Int64)
    )
    for name, weight in (("copied", w.copied), ("regenerated", w.regenerated)):
        reward = pl.when(c(name).is_not_null()).then(reward + weight).otherwise(reward)
        evidence = evidence + c(name).is_not_null().cast(pl.Int64)
    fs = c("followup_sentiment")
    reward = pl.when(fs.is_not_null()).then(reward + w.followup * fs).otherwise(reward)
    evidence = evidence + fs.is_not_null().cast(pl.Int64)
    confidence = pl.min_horizontal(pl.lit(0.9), 0.3 + 0.2 * evidence.cast(pl.Float64))
    return [reward.clip(-1.0, 1.0).alias("_implicit_reward"), confidence.alias("_implicit_confidence")]


def _satisfaction(d: RewardDefinition) -> list[pl.Expr]:
    """`LogisticModel.predict_one` over columns, summed in the same order (2p - 1, the scale of thumbs)."""
    m = d.satisfaction
    assert m is not None
    z: pl.Expr = pl.lit(m.intercept)
    for name, coef, mean, scale, fill in zip(m.features, m.coef, m.mean, m.scale, m.fill, strict=True):
        x = pl.col(name).fill_null(fill) if name in SIGNAL_COLUMNS else pl.lit(fill)
        z = z + _divide(coef * (x.cast(pl.Float64) - mean), scale)
    p = 1.0 / (1.0 + (-z.clip(-35.0, 35.0)).exp())
    return [
        (2.0 * p - 1.0).alias("_implicit_reward"),
        pl.max_horizontal(p, 1.0 - p).alias("_implicit_confidence"),
        p.alias("p_satisfied"),
    ]


_PACKED_REVISION_BITS = 24


def _found(rows: np.ndarray) -> pl.Series:
    """`rows` as the indices of a gather: null (a row of nulls) where negative (none found)."""
    return pl.Series("row", rows).to_frame().select(pl.when(pl.col("row") >= 0).then(pl.col("row"))).to_series()


def _by_record(per_record: pl.DataFrame, other: pl.DataFrame) -> pl.DataFrame:
    """`per_record` with the columns of `other` (a row for some of its records), matched on `_record`; null for
    the records `other` has no row for.

    Matched through a table indexed by the record numbers (small integers, `typed_feedback`), not a hash join: for
    the retention checks of 10M events a third of the CPU time."""
    mine, theirs = (f.get_column("_record").cast(pl.Int64).to_numpy() for f in (per_record, other))
    slot = np.full(max(mine.max(initial=0), theirs.max(initial=0)) + 1, -1, dtype=np.int64)
    slot[theirs] = np.arange(len(theirs))
    return per_record.hstack(other.drop("_record").gather(_found(slot[mine])))


def _with_records(generations: pl.DataFrame, per_record: pl.DataFrame) -> pl.LazyFrame:
    """`generations` left-joined with their records' columns (`per_record`, by `KEY`), in their order.

    Where every id is an integer that leaves room for the revision (the recompute's row numbers), matched on the
    two packed into one integer: where `per_record` is in the order of those (`score_frame` sorts it), by a binary
    search of them and a gather, which then reads `per_record` mostly in order (at 10M events half the CPU time of
    a join on the packed integer, itself a third less than a join on the two columns); else joined on it."""
    keys = pl.concat([generations.select(KEY), per_record.select(KEY)])
    gid, revision = keys.get_column(KEY[0]), keys.get_column(KEY[1])
    packable = (
        gid.dtype.is_integer()
        and not keys.is_empty()
        and not keys.null_count().sum_horizontal().item()
        and 0 <= gid.min() <= gid.max() < 2 ** (62 - _PACKED_REVISION_BITS)  # type: ignore[operator]
        and 0 <= revision.min() <= revision.max() < 2**_PACKED_REVISION_BITS  # type: ignore[operator]
    )
    if not packable:
        return generations.lazy().join(per_record.lazy(), on=list(KEY), how="left", maintain_order="left")
    packed = (pl.col(KEY[0]).cast(pl.Int64) * 2**_PACKED_REVISION_BITS + pl.col(KEY[1])).alias("_key")
    ordered = per_record.select(packed).to_series().to_numpy()
    if len(ordered) and (ordered[1:] > ordered[:-1]).all():
        wanted = generations.select(packed).to_series().to_numpy()
        at = np.searchsorted(ordered, wanted).clip(max=len(ordered) - 1)
        rows = _found(np.where(ordered[at] == wanted, at, -1))
        return generations.hstack(per_record.drop(KEY).gather(rows)).lazy()
    return (
        generations.lazy()
        .with_columns(packed)
        .join(per_record.lazy().with_columns(packed).drop(KEY), on="_key", how="left", maintain_order="left")
    )


def score_frame(definition: RewardDefinition, generations: pl.DataFrame, feedback: pl.DataFrame) -> pl.DataFrame:
    """`generations` (one row per record to score, `GENERATION_SCHEMA` and any other columns) with every
    signal column, `reward`, `confidence` and `label_source` added; `feedback` holds each record's
    in-window feedback events (`FEEDBACK_SCHEMA`)."""
    d = definition
    aggs = [pl.len().alias("feedback_events"), *(e for s in SIGNALS for e in s.aggregate(d))]
    # collected once: the group-by, the picks and the retention checks read it
    typed, parsed = typed_feedback(feedback)
    # min, max, any and len: the streaming engine aggregates those in about half the CPU time (3M events); its
    # groups come in no order: sorted by record number, which is `KEY`'s order (`typed_feedback`), so that the picks
    # and `_with_records` read the records in order
    per_record = typed.lazy().group_by("_record").agg(*aggs).collect(engine="streaming").sort("_record")
    # each record's key from its first row (`typed` holds each record's rows together, in record order), not
    # aggregated: a fifth of the group-by's CPU time
    record = typed.get_column("_record")
    keys = typed.select(*KEY).filter(record.ne_missing(record.shift(1)))
    per_record = per_record.hstack(keys).select("_record", *KEY, pl.exclude("_record", *KEY))
    per_record = _by_record(per_record, edit_sums(parsed["edited"]).collect(engine=ENGINE))
    per_record = _by_record(per_record, retention_checks(parsed["retained"]).collect(engine=ENGINE))
    per_record = _picked(parsed, per_record, [p for s in SIGNALS for p in s.picks])
    frame = (
        _with_records(generations, per_record)
    ).with_columns(
        pl.col("feedback_events").fill_null(0).cast(pl.Float64),
        pl.when((pl.col("finish_reason") == "declined") | (pl.col("completion_chars") == 0))
        .then(1.0).otherwise(0.0).alias("declined"),
    )  # fmt: skip
    for s in SIGNALS:
        finish = s.finish(d)
        if finish:
            frame = frame.with_columns(finish)
    implicit = pl.any_horizontal([pl.col(n).is_not_null() for n in _IMPLICIT])
    model = _satisfaction(d) if d.satisfaction is not None else _rules(d)
    frame = frame.with_columns(model)
    thumbs = pl.col("thumbs")
    agrees = pl.coalesce(pl.col("thumbs_comment_sentiment"), thumbs) * thumbs >= 0
    declined = pl.col("declined") == 1.0
    frame = frame.with_columns(
        pl.when(thumbs.is_not_null()).then(thumbs)
        .when(implicit).then(pl.col("_implicit_reward"))
        .when(declined).then(pl.lit(d.declined_reward))
        .otherwise(pl.lit(d.default_reward)).alias("reward"),
        pl.when(thumbs.is_not_null()).then(pl.when(agrees).then(1.0).otherwise(0.8))
        .when(implicit).then(pl.col("_implicit_confidence"))
        .when(declined).then(pl.lit(1.0))
        .otherwise(pl.lit(d.default_confidence)).alias("confidence"),
        pl.when(thumbs.is_not_null()).then(pl.lit("explicit"))
        .when(implicit).then(pl.lit("implicit"))
        .otherwise(pl.lit("default")).alias("label_source"),
    )  # fmt: skip
    if d.satisfaction is not None:  # p_satisfied belongs to the signals of a model-scored implicit record only
        model_scored = thumbs.is_null() & implicit
        frame = frame.with_columns(pl.when(model_scored).then(pl.col("p_satisfied")).alias("p_satisfied"))
    out = frame.drop(pl.selectors.starts_with("_")).collect(engine=ENGINE)
    first = [*generations.columns, *(c for c in _COLUMN_ORDER if c in out.columns and c not in generations.columns)]
    return out.select(*first, *(c for c in out.columns if c not in first))


def signal_names(definition: RewardDefinition) -> tuple[str, ...]:
    """The columns of `score_frame`'s result that go into a record's `signals`."""
    return (*SIGNAL_COLUMNS, "p_satisfied") if definition.satisfaction is not None else SIGNAL_COLUMNS


def signals_column(frame: pl.DataFrame, names: Sequence[str]) -> list[dict[str, float]]:
    """Each record's `signals` (a row of `frame`): its observed (non-null) signals of `names`, as floats, in that
    order. Read column by column: a record observes a few of its signals, so only the non-null cells are visited
    (where a row dict per record read every column of it)."""
    out: list[dict[str, float]] = [{} for _ in range(frame.height)]
    for n in names:  # in `names`' order, so each dict's keys are too
        column = frame.get_column(n)
        if not column.null_count():
            values = column.cast(pl.Float64).to_list()
            for d, v in zip(out, values, strict=True):
                d[n] = v
        elif column.null_count() < frame.height:
            seen = column.is_not_null()
            for k, v in zip(seen.arg_true().to_list(), column.filter(seen).cast(pl.Float64).to_list(), strict=True):
                out[k][n] = v
    return out
