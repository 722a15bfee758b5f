"""Reward definitions as polars column expressions: many generations scored at once.

Both drivers score through `score_frame`: the batch recompute over the lake's rows, the streaming
worker over each micro-batch of closed windows. So a version turns the same events into the same
record on both paths by construction, and a batch costs a few vectorised passes instead of Python
code per generation.

Inputs (`FEEDBACK_SCHEMA`, `GENERATION_SCHEMA`): one row per in-window feedback event and one per
record to score, both keyed by (`generation_id`, `revision`); a record's events are the feedback rows of
its key. Properties stay the JSON text the lake holds (the stream serialises its dicts the same way)
and are read with one parser (`_prop`), so a property means the same thing on both paths.

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

import numpy as np
import polars as pl

from signals.features import RETENTION_CHECKPOINTS_S
from signals.reward import RewardDefinition
from signals.sentiment import Sentiment

KEY = ("generation_id", "revision")

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


def _prop(key: str, *types: str) -> pl.Expr:
    """Property `key` of each event of `types` as text (a JSON string's content, else the JSON of the value);
    null when absent, JSON null, or another type's (only what a signal reads is parsed: parsing is the cost)."""
    return pl.when(pl.col("type").is_in(list(types))).then(pl.col("properties")).str.json_path_match(f"$.{key}")


def _num(raw: pl.Expr) -> pl.Expr:
    """A finite float from a property's text, or null (`features._num`'s reading: bad input is "not given")."""
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
    return pl.col("type").is_in(list(types))


def _first(col: str, cond: pl.Expr) -> pl.Expr:
    return pl.col(col).filter(cond).first()


def _last(col: str, cond: pl.Expr) -> pl.Expr:
    return pl.col(col).filter(cond).last()


def _flag(cond: pl.Expr) -> pl.Expr:
    """1.0 when any event of the record meets `cond`, else null (not observed)."""
    return pl.when(cond.any()).then(pl.lit(1.0))


def _accepted_by_then() -> list[pl.Expr]:
    """`_accepted_by_us`: on each row of a frame sorted by (record, time, id), the time of the record's latest
    `accepted` event at or before the row's time (ties in time after the row included), else null.

    Fills along the whole sorted frame, kept to the row's own record by the record's number (`_record`), so it
    is a few linear passes: the same as a filter by each record's own time inside the group-by, which costs
    several times more."""
    accepted = pl.col("type") == "accepted"
    ts = pl.when(accepted).then(pl.col("ts_us"))
    record = pl.when(accepted).then(pl.col("_record"))
    before = pl.when(record.forward_fill() == pl.col("_record")).then(ts.forward_fill())
    at_same_time = (record.backward_fill() == pl.col("_record")) & (ts.backward_fill() == pl.col("ts_us"))
    return [pl.when(at_same_time).then(pl.col("ts_us")).otherwise(before).alias("_accepted_by_us")]


def typed_feedback(feedback: pl.LazyFrame) -> pl.LazyFrame:
    """The feedback rows with every property a signal reads parsed once, in (time, id) order per record."""
    new_record = pl.any_horizontal([pl.col(k).ne_missing(pl.col(k).shift(1)) for k in KEY])
    return feedback.sort(*KEY, "ts_us", "event_id", maintain_order=True).with_columns(
        pl.col("properties").fill_null("{}"),
        new_record.cum_sum().alias("_record"),
    ).with_columns(
        *_accepted_by_then(),
        _prop("value", "thumbs").str.to_lowercase().alias("_value"),
        _prop("comment", "thumbs").alias("_comment"),
        _prop("total_chars", "accepted").alias("_total_chars"),
        _prop("accepted_chars", "accepted").alias("_accepted_chars"),
        _prop("seconds_after_accept", "undone", "retained").alias("_seconds_raw"),
        _prop("fraction_present", "retained").alias("_fraction"),
        _prop("edit_distance", "edited").alias("_edit"),
        _prop("text", "followup").alias("_text"),
    ).with_columns(_num(pl.col(c)).alias(c) for c in ("_total_chars", "_accepted_chars", "_fraction", "_edit"))


# ---------------------------------------------------------------------- signals


@dataclass(frozen=True)
class Signal:
    """One named signal: what it means and where it comes from (`doc`), the expressions that aggregate a
    record's feedback events into its raw columns (`aggregate`), and those that turn the raw columns into
    its values once joined to its generation (`finish`). A value left null is "not observed". (Retention's
    checks are aggregated from a frame of their own, `retention_checks`, sorted once by time after accept.)"""

    name: str
    doc: str
    aggregate: Callable[[RewardDefinition], list[pl.Expr]]
    finish: Callable[[RewardDefinition], list[pl.Expr]]
    produces: tuple[str, ...]


def _sentiment_of(fn: Sentiment) -> Callable[[pl.Series], pl.Series]:
    """`fn` over a column of texts, each distinct text scored once (a text model is called in bulk)."""

    def run(texts: pl.Series) -> pl.Series:
        distinct = texts.drop_nulls().unique()
        scores = {t: float(fn(t)) for t in distinct.to_list()}
        return texts.replace_strict(scores, default=None, return_dtype=pl.Float64)

    return run


def _thumbs_agg(d: RewardDefinition) -> list[pl.Expr]:
    vote = _is("thumbs") & pl.col("_value").is_in(["up", "down"])
    return [
        pl.when(_last("_value", vote) == "up").then(1.0).when(vote.any()).then(-1.0).alias("thumbs"),
        _last("_comment", vote).alias("_thumbs_comment"),
    ]


def _thumbs_finish(d: RewardDefinition) -> list[pl.Expr]:
    comment = pl.col("_thumbs_comment").fill_null("")
    has_text = pl.col("thumbs").is_not_null() & (comment.str.strip_chars() != "")
    # `str(comment or "")`: a JSON false or 0 is no comment
    text = pl.when(has_text & ~comment.is_in(["false", "0", "0.0"])).then(comment)
    return [text.map_batches(_sentiment_of(d.sentiment), return_dtype=pl.Float64).alias("thumbs_comment_sentiment")]


def _decision_agg(d: RewardDefinition) -> list[pl.Expr]:
    accepted = _is("accepted")
    total = _last("_total_chars", accepted).fill_null(0.0)
    chars = pl.coalesce(_last("_accepted_chars", accepted), total)
    took = accepted.any()
    return [
        _flag(_is("shown", *_DECIDED)).alias("shown"),
        _flag(accepted).alias("accepted"),
        pl.when(took)
        .then(pl.when(total > 0).then((chars / total).clip(0.0, 1.0)).otherwise(1.0))
        .alias("accepted_fraction"),
        pl.when(took).then(pl.max_horizontal(pl.lit(0.0), chars)).alias("accepted_chars"),
        pl.when(~took).then(_flag(_is("rejected"))).alias("rejected"),
        pl.when(~took & ~_is("rejected").any()).then(_flag(_is("ignored"))).alias("ignored"),
    ]


def _undo_agg(d: RewardDefinition) -> list[pl.Expr]:
    undone = _is("undone")
    first_ts = _first("ts_us", undone)
    given = _first("_seconds_raw", undone)
    accept_ts = _first("_accepted_by_us", undone)  # the latest accept at or before the first undo
    return [
        undone.any().alias("_undone"),
        _num(given).fill_null(0.0).alias("_undo_given_s"),
        given.is_not_null().alias("_undo_given"),
        (first_ts - accept_ts).fill_null(0).alias("_undo_gap_us"),
    ]


def _undo_finish(d: RewardDefinition) -> list[pl.Expr]:
    measured = pl.when(pl.col("_undo_given")).then(pl.col("_undo_given_s")).otherwise(_seconds(pl.col("_undo_gap_us")))
    secs = pl.when(pl.col("_undone")).then(pl.max_horizontal(pl.lit(0.0), measured))
    return [
        pl.when(secs <= d.undo_window_s).then(1.0).when(secs.is_not_null()).then(0.5).alias("undone"),
        secs.alias("undo_s"),
    ]


def _edits_agg(d: RewardDefinition) -> list[pl.Expr]:
    edited = _is("edited")
    distance = pl.col("_edit").fill_null(0.0).clip(lower_bound=0.0).filter(edited).sum()
    return [pl.when(edited.any()).then(distance).alias("edit_distance")]


def _edits_finish(d: RewardDefinition) -> list[pl.Expr]:
    length = pl.max_horizontal(pl.lit(1), pl.col("completion_chars")).cast(pl.Float64)
    ratio = pl.col("edit_distance") / length
    return [pl.when(ratio.is_not_null()).then(pl.min_horizontal(pl.lit(1.0), ratio)).alias("edit_ratio")]


def retention_checks(typed: pl.LazyFrame) -> pl.LazyFrame:
    """One row per record with `retained` checks: `retention` and `retained_<c>s` (`features.retention`).

    The checks are put in order of their time after the accept once, for all records (ties keep event-time
    order), so each value is a first or last within its record rather than a sort per record."""
    secs = _num(pl.col("_seconds_raw")).fill_null(0.0).clip(lower_bound=0.0)
    frac = pl.col("_fraction").fill_null(1.0).clip(0.0, 1.0)
    checks = (
        typed.filter(_is("retained"))
        .select(*KEY, secs.alias("_secs"), frac.alias("_frac"))
        .sort(*KEY, "_secs", maintain_order=True)
    )
    return checks.group_by(*KEY, maintain_order=True).agg(
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
    follow = _is("followup")
    return [_flag(follow).alias("followup"), _first("_text", follow).alias("_followup_text")]


def _followup_finish(d: RewardDefinition) -> list[pl.Expr]:
    raw = pl.col("_followup_text").fill_null("")
    text = pl.when(pl.col("followup").is_not_null()).then(
        pl.when(raw.is_in(["false", "0", "0.0"])).then(pl.lit("")).otherwise(raw)
    )
    return [text.map_batches(_sentiment_of(d.sentiment), return_dtype=pl.Float64).alias("followup_sentiment")]


def _dwell_agg(d: RewardDefinition) -> list[pl.Expr]:
    shown = _first("ts_us", _is("shown"))
    decided = _first("ts_us", _is(*_DECIDED))
    return [(decided - shown).alias("_dwell_us")]


def _dwell_finish(d: RewardDefinition) -> list[pl.Expr]:
    gap = _seconds(pl.col("_dwell_us"))
    return [pl.when(gap.is_not_null()).then(pl.max_horizontal(pl.lit(0.0), gap)).alias("dwell_s")]


def _none(d: RewardDefinition) -> list[pl.Expr]:
    return []


SIGNALS: tuple[Signal, ...] = (
    Signal("thumbs", "Explicit vote; the latest `thumbs` {value: up|down} wins, its `comment` scored by the "
           "definition's sentiment (`features.thumbs`).", _thumbs_agg, _thumbs_finish,
           ("thumbs", "thumbs_comment_sentiment")),
    Signal("decision", "Shown / accepted (with partial accepts) / rejected / ignored; an accept outranks a reject "
           "(Cursor Tab's accept/reject reward, `features.decision`).", _decision_agg, _none,
           ("shown", "accepted", "accepted_fraction", "accepted_chars", "rejected", "ignored")),
    Signal("undo", "An undo after accepting, full weight within the definition's undo window (`features.undo`).",
           _undo_agg, _undo_finish, ("undone", "undo_s")),
    Signal("edits", "Edit distance after accepting, summed, and its ratio to the completion (`features.edits`).",
           _edits_agg, _edits_finish, ("edit_distance", "edit_ratio")),
    Signal("retention", "Accepted text still present at GitHub Copilot's checkpoints (`features.retention`).",
           _none, _retention_finish,
           ("retention", "retained_chars", *(f"retained_{c}s" for c in RETENTION_CHECKPOINTS_S))),
    Signal("copy_regenerate", "Copied or regenerated (`features.copy_regenerate`).", _copy_agg, _none,
           ("copied", "regenerated")),
    Signal("followup", "The first follow-up message and its sentiment, scored in bulk (`features.followup`).",
           _followup_agg, _followup_finish, ("followup", "followup_sentiment")),
    Signal("dwell", "Seconds from shown to the first decision (`features.dwell`).", _dwell_agg, _dwell_finish,
           ("dwell_s",)),
)
"""Every signal a definition reads, in the order the reference extracts them."""

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
        pl.when(c("undone").is_not_null()).then(after_undo)
        .when(c("retention").is_not_null()).then(after_keep)
        .otherwise(base)
    )
    reward = (
        pl.when(accepted).then(kept + w.edit * c("edit_ratio").fill_null(0.0))
        .when(c("rejected").is_not_null()).then(pl.lit(w.reject))
        .when(c("shown").is_not_null()).then(pl.lit(w.ignored))
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


def score_frame(
    definition: RewardDefinition, generations: pl.DataFrame, feedback: pl.DataFrame
) -> pl.DataFrame:
    """`generations` (one row per record to score, `GENERATION_SCHEMA` and any other columns) with every
    signal column, `reward`, `confidence` and `label_source` added; `feedback` holds each record's
    in-window feedback events (`FEEDBACK_SCHEMA`)."""
    d = definition
    aggs = [pl.len().alias("feedback_events")] + [e for s in SIGNALS for e in s.aggregate(d)]
    # collected once: both the group-by and the retention checks read it (a lazy plan may compute it twice)
    typed = typed_feedback(feedback.lazy().filter(pl.col("type") != "generation")).collect().lazy()
    per_record = typed.group_by(*KEY).agg(aggs)
    frame = (
        generations.lazy()
        .join(per_record, on=list(KEY), how="left")
        .join(retention_checks(typed), on=list(KEY), how="left")
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
    return frame.drop(pl.selectors.starts_with("_")).collect()


def signal_names(definition: RewardDefinition) -> tuple[str, ...]:
    """The columns of `score_frame`'s result that go into a record's `signals`."""
    return (*SIGNAL_COLUMNS, "p_satisfied") if definition.satisfaction is not None else SIGNAL_COLUMNS


def signals_of(row: dict[str, object], names: Sequence[str]) -> dict[str, float]:
    """A record's `signals`: the observed (non-null) ones of `row`."""
    return {n: float(row[n]) for n in names if row[n] is not None}  # type: ignore[arg-type]
