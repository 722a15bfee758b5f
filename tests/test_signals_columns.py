"""Conformance of the column expressions (signals/columns.py) with the per-generation reference.

For every signal, on seeded random generations built to hit its edge cases (no feedback, null and
missing properties, blank and falsy texts, duplicated events, events given out of order, ties in
time, extreme and malformed numbers), each value the expressions give must be the reference's: the
naive code that scores one generation at a time, one event at a time (`RewardDefinition.extract` and
`score`, over `signals.features`). Then whole records: reward, confidence, label and signals, with the
rules and with a satisfaction model.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import polars as pl
import pytest

from signals.columns import (
    FEEDBACK_SCHEMA,
    GENERATION_SCHEMA,
    SIGNALS,
    score_frame,
    signal_names,
    signals_column,
)
from signals.events import FeedbackEvent, GenerationInfo
from signals.logistic import LogisticModel
from signals.reward import DEFAULT_DEFINITION, RewardDefinition
from signals.satisfaction import FEATURES

S = 1_000_000
NUMBERS: list[Any] = [None, 0, 3, 7.5, -4, 1e300, -1e300, 10**15, " 12 ", "abc", "nan", "inf", True, False, "", [1]]
# no list among them, so each type's properties are decoded in one pass (`columns._parsed_properties`), and numbers
# whose nearest float a less careful parse misses by an ulp
PLAIN_NUMBERS: list[Any] = [*NUMBERS[:-1], 943305.0469559873, 511173.55050439644, 0.1, 2**53 + 1, 10**20 + 1]
TEXTS: list[Any] = [None, "", "   ", "thanks, that works great", "this is wrong and broken", "not good", 0, False, 5]
VOTES: list[Any] = ["up", "down", "UP", "Down", "sideways", None, 1, True]
TYPES = ["shown", "accepted", "rejected", "ignored", "undone", "edited", "retained", "copied", "regenerated",
         "followup", "thumbs", "generation", "unknown_type"]  # fmt: skip
FOCUS: dict[str, list[str]] = {
    "thumbs": ["thumbs"],
    "decision": ["shown", "accepted", "rejected", "ignored"],
    "undo": ["accepted", "undone"],
    "edits": ["edited", "accepted"],
    "retention": ["retained", "accepted"],
    "copy_regenerate": ["copied", "regenerated"],
    "followup": ["followup"],
    "dwell": ["shown", "accepted", "rejected", "ignored"],
}


def _props(rng: random.Random, type_: str, numbers: list[Any]) -> dict[str, Any]:
    keys = {
        "thumbs": {"value": VOTES, "comment": TEXTS},
        "accepted": {"accepted_chars": numbers, "total_chars": numbers},
        "undone": {"seconds_after_accept": numbers},
        "edited": {"edit_distance": numbers},
        "retained": {"seconds_after_accept": numbers + [0, 5, 29, 30, 120, 900, 1000], "fraction_present": numbers},
        "followup": {"text": TEXTS},
    }.get(type_, {})
    # each property present with some value, present as null, or absent
    return {k: rng.choice(pool) for k, pool in keys.items() if rng.random() < 0.8}


Case = tuple[GenerationInfo, list[FeedbackEvent]]


def _generations(rng: random.Random, types: list[str], n: int = 150, numbers: list[Any] = NUMBERS) -> list[Case]:
    out = []
    for i in range(n):
        gen = GenerationInfo(
            f"g{i}", ts_us=0, finish_reason=rng.choice(["stop", "stop", "declined"]),
            completion_chars=rng.choice([0, 1, 20, 400]),
        )  # fmt: skip
        events = []
        for j in range(rng.choice([0, 1, 2, 3, 5, 8])):
            type_ = rng.choice(types) if rng.random() < 0.85 else rng.choice(TYPES)
            ts = rng.choice([0, 1, 1, 2, 5, 40, 10**6]) * S + rng.choice([0, 0, 7, rng.randrange(S)])  # ties in time
            events.append(FeedbackEvent(f"e{j:02d}-{rng.randrange(10)}", type_, ts, _props(rng, type_, numbers)))
        if events and rng.random() < 0.3:
            events.append(rng.choice(events))  # a duplicated event
        rng.shuffle(events)  # out of order
        out.append((gen, events))
    return out


def _frames(cases: list[Case]) -> tuple[pl.DataFrame, pl.DataFrame]:
    gens = pl.DataFrame(
        [{"generation_id": g.generation_id, "revision": 0, "finish_reason": g.finish_reason,
          "completion_chars": g.completion_chars} for g, _ in cases],
        schema=GENERATION_SCHEMA,
    )  # fmt: skip
    feedback = pl.DataFrame(
        [{"generation_id": g.generation_id, "revision": 0, "event_id": e.event_id, "type": e.type,
          "ts_us": e.ts_us, "properties": json.dumps(dict(e.properties))} for g, evs in cases for e in evs],
        schema=FEEDBACK_SCHEMA,
    )  # fmt: skip
    return gens, feedback


def signals_of(row: dict[str, object], names: tuple[str, ...]) -> dict[str, float]:
    """The naive reading of a record's `signals` from its row: the observed (non-null) ones, in `names`' order."""
    return {n: float(row[n]) for n in names if row[n] is not None}  # type: ignore[arg-type]


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return a == b


@pytest.mark.parametrize("numbers", [NUMBERS, PLAIN_NUMBERS], ids=["with-lists", "plain"])
@pytest.mark.parametrize("signal", SIGNALS, ids=[s.name for s in SIGNALS])
def test_each_signal_matches_the_per_generation_reference(signal: Any, numbers: list[Any]) -> None:
    rng = random.Random(f"columns-{signal.name}")
    cases = _generations(rng, FOCUS[signal.name], numbers=numbers)
    cases.append((GenerationInfo("empty", ts_us=0, completion_chars=3), []))  # no feedback at all
    scored = {r["generation_id"]: r for r in score_frame(DEFAULT_DEFINITION, *_frames(cases)).iter_rows(named=True)}
    for gen, events in cases:
        want = DEFAULT_DEFINITION.extract(gen, events, window_end_us=2**62)
        row = scored[gen.generation_id]
        for name in (*signal.produces, "declined", "feedback_events"):
            assert _same(row[name], want.get(name)), (signal.name, name, gen, events, row[name], want.get(name))


def _model() -> LogisticModel:
    rng = np.random.default_rng(7)
    x = rng.random((200, len(FEATURES)))
    x[rng.random(x.shape) < 0.3] = np.nan
    return LogisticModel.fit(x, (rng.random(200) < 0.5).astype(float), FEATURES)


@pytest.mark.parametrize("kind", ["rules", "vader-rules", "satisfaction"])
def test_records_match_the_per_generation_reference(kind: str) -> None:
    definition = {
        "rules": DEFAULT_DEFINITION,
        "vader-rules": RewardDefinition(version="vader-test"),
        "satisfaction": DEFAULT_DEFINITION.with_satisfaction(_model(), "sat-test"),
    }[kind]
    rng = random.Random(f"records-{kind}")
    cases = _generations(rng, sorted({t for types in FOCUS.values() for t in types}), n=300)
    cases.append((GenerationInfo("empty", ts_us=0, completion_chars=0), []))
    names = signal_names(definition)
    scored = score_frame(definition, *_frames(cases))
    by_column = signals_column(scored, names)  # the streaming worker's reading of the same frame
    for row, column_wise in zip(scored.iter_rows(named=True), by_column, strict=True):
        gen, events = next(c for c in cases if c[0].generation_id == row["generation_id"])
        want = definition.score(gen, events)
        got = signals_of(row, names)
        assert list(column_wise.items()) == list(got.items())
        assert got.keys() == want.signals.keys(), (events, got, want.signals)
        assert all(_same(got[k], want.signals[k]) for k in got), (events, got, want.signals)
        assert row["label_source"] == want.label_source
        assert _same(row["reward"], want.reward) and _same(row["confidence"], want.confidence), (events, row, want)


def test_no_rows_score_to_an_empty_frame() -> None:
    none = pl.DataFrame(schema=GENERATION_SCHEMA), pl.DataFrame(schema=FEEDBACK_SCHEMA)
    empty = score_frame(DEFAULT_DEFINITION, *none)
    assert empty.is_empty() and {"reward", "confidence", "label_source"} <= set(empty.columns)
