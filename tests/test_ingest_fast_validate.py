"""The plain batch path agrees with pydantic: it accepts only what pydantic accepts, with the same row.

Pure functions, no broker: every case goes through `validate_batch` and through
`Event.from_bytes` + `event_row`, and both must give the same row or the same refusal.
"""

from __future__ import annotations

import json

import pytest

from flywheel.bus import Record, RecordBatch
from flywheel.contract import MAX_EVENT_BYTES, Event, InvalidEvent
from flywheel.fast_validate import event_row, validate_batch
from flywheel.lake.tables import rows_frame

BASE = {
    "event_id": "e1",
    "type": "accepted",
    "schema_version": 1,
    "generation_id": "g1",
    "user_id": "u1",
    "session_id": "s1",
    "ts": "2026-01-02T03:04:05.123456Z",
    "received_at": "2026-01-02T03:04:06Z",
    "source": "native",
    "properties": {"accepted_chars": 3, "x": [1.5, "é", None, 2**63 - 1]},
}


def _with(**changes: object) -> bytes:
    doc = {**BASE, **changes}
    return json.dumps({k: v for k, v in doc.items() if v is not _DROP}).encode()


_DROP = object()

CASES = [
    _with(),
    Event(type="shown", generation_id="g", user_id="u").to_bytes(),
    _with(ts="2026-01-02T03:04:05.1234567Z"),  # pydantic truncates, msgspec would round
    _with(ts="2026-01-02T03:04:05"),  # naive: UTC
    _with(ts="2026-01-02T03:04:05+02:00"),
    _with(ts="2026-01-02 03:04:05Z"),
    _with(ts="2026-01-02"),
    _with(ts="2026-13-02T03:04:05Z"),
    _with(ts="2026-01-02T03:04:60Z"),
    _with(ts="2026-01-02t03:04:05z"),
    _with(ts="2026-01-02_03:04:05Z"),
    _with(ts="2026-01-02T03:04Z"),
    _with(ts="2026-01-02T03:04:05,5Z"),
    _with(ts="2026-01-02T03:04:05+0200"),
    _with(received_at="2026-01-02T03:04:05.000000001+01:00"),
    _with(ts=1767323045),
    _with(ts="yesterday"),
    _with(ts="0000-01-01T00:00:00Z"),  # the plain pattern, but Python has no year 0: pydantic refuses
    _with(ts="0001-01-01T00:00:00Z"),
    _with(event_id=_DROP),
    _with(received_at=_DROP),
    _with(event_id=""),
    _with(event_id="x" * 129),
    _with(user_id="é" * 256),  # lengths are in characters
    _with(user_id="é" * 257),
    _with(type="nope"),
    _with(type="generation"),
    _with(schema_version=2),
    _with(schema_version="1"),
    _with(schema_version=1.0),
    _with(schema_version=True),
    _with(user_id=7),
    _with(session_id=None),
    _with(properties=None),
    _with(properties=[1]),
    _with(extra="field"),
    b'{"event_id":"a","event_id":"b","type":"accepted","generation_id":"g","user_id":"u",'
    b'"ts":"2026-01-02T03:04:05Z","received_at":"2026-01-02T03:04:05Z"}',
    b"not json",
    b"\xff\xfe",
    b'{"type":"accepted","user_id":"\\ud800","generation_id":"g"}',
    b"[]",
    _with(properties={"big": "x" * MAX_EVENT_BYTES}),
    # Hostile records: each refused with a reason, none may raise.
    _with(ts="0001-01-01T00:30:00+01:00"),  # year 1 as written, year 0 in UTC
    _with(ts="9999-12-31T23:30:00-01:00"),  # year 10000 in UTC
    _with(received_at="0001-01-01T00:59:59.999999+01:00"),
    _with(ts="9999-12-31T23:59:59.999999Z"),  # the last instant the lake holds: accepted
    _with(properties={}).replace(b'"properties": {}', b'"properties": {"x": NaN}'),
    _with(properties={}).replace(b'"properties": {}', b'"properties": {"x": [1e400]}'),
    _with(properties={}).replace(b'"properties": {}', b'"properties": {"x": ' + b"[" * 1000 + b"]" * 1000 + b"}"),
    _with(properties={}).replace(b'"properties": {}', b'"properties": {"x": ' + b"[" * 70 + b"]" * 70 + b"}"),
    _with(properties={}).replace(b'"properties": {}', b'"properties": {"x": ' + b"9" * 5000 + b"}"),
    _with(properties={}).replace(b'"properties": {}', b'"properties": {"x": "\xff"}'),
    _with(user_id="u").replace(b'"u"', b'"\xc3\x28"'),
    None,  # a tombstone
]


# `generation` events: serving's signed samples and a product's text-only ones take the plain path; what
# `generation_properties` maps (another API's finish reason, a product's arm) or refuses goes to pydantic.
SIGNED = {
    "prompt": "def f(x):\n    ", "prompt_token_ids": [1, 2, 3], "completion": "return x  # é",
    "completion_token_ids": [4, 5], "behaviour_logprobs": [-0.5, -1e-7], "model_version": "v3", "arm": "challenger",
    "surface": "code-completion", "latency_ms": 12.5, "finish_reason": "length", "temperature": 0.7,
    "signature": "ab" * 32,
}  # fmt: skip
TEXT_ONLY = {"prompt": "p", "completion": "c", "model_version": "mine-1"}


def _gen(**changes: object) -> bytes:
    return _with(type="generation", properties={k: v for k, v in {**SIGNED, **changes}.items() if v is not _DROP})


def _text(**changes: object) -> bytes:
    return _with(type="generation", properties={**TEXT_ONLY, **changes})


GENERATIONS = [
    _gen(),
    _text(),
    _text(prompt_token_ids=None, completion_token_ids=None, behaviour_logprobs=None),
    _gen(behaviour_logprobs=_DROP),  # ids without their log-probs
    _text(prompt_token_ids=[1]),
    _gen(behaviour_logprobs=[-0.5]),  # one log-prob for two tokens
    _gen(arm="variant-b"),  # a product's arm: moved to product_arm
    _gen(arm="variant-b", product_arm="other"),
    _gen(finish_reason="max_tokens"),
    _gen(finish_reason="Stop"),
    _gen(finish_reason="bogus"),
    _gen(language="python"),  # a product's own name: kept
    _gen(completoin="x"),  # a misspelling: refused
    _gen(experiment=None),  # null for a name that is not nullable: not sent
    _gen(latency_ms=12, temperature=1),
    _gen(latency_ms=True),
    _gen(prompt_token_ids=[1, True, 3]),
    _gen(prompt_token_ids=[1.0, 2, 3]),
    _gen(completion_token_ids=[10**30, -1]),
    _gen(language=2**63),  # past 64 bits: refused by the contract, whichever path judges it
    _gen(language=-(2**63)),
    _with(properties={"n": 2**63 - 1, "m": -(2**63)}),
    _with(properties={"n": 2**63}),
    _with(properties={"n": [10**30]}),
    _with(properties={"n": "1" * 40}),  # digits in a string are text
    _gen(prompt=5),
    _gen(prompt=_DROP),
    _gen(model_version=None),
    _gen(surface="chat\n"),  # pydantic's `$` is the end of the text
    _gen(surface="Chat"),
    _gen(surface="a" * 64),
    _gen(surface="a" * 65),
    _gen(product_arm="é" * 128),
    _gen(product_arm="é" * 129),
    _gen(provider_finish_reason="x" * 64),
    _gen(provider_finish_reason="x" * 65),
    _gen(signature="s" * 129),
    _gen(prompt="a[" * 100),  # more brackets than the depth limit, all in text
    _gen(completion="\ud83d\ude00 \u2028"),
    _gen().replace(b'"behaviour_logprobs": [-0.5, -1e-07]', b'"behaviour_logprobs": [-0.5, NaN]'),
    _gen().replace(b'"behaviour_logprobs": [-0.5, -1e-07]', b'"behaviour_logprobs": [-0.5, -1e400]'),
    _gen().replace(b'"prompt": ', b'"prompt": "first", "prompt": '),  # a repeated name: the last value
    _gen().replace(b'"behaviour_logprobs": [-0.5, -1e-07]', b'"behaviour_logprobs": [-0.5, [-1]]'),
]
CASES += GENERATIONS


def _one(raw: bytes | None) -> RecordBatch:
    return RecordBatch(["events"], [0], [7], [raw])


@pytest.mark.parametrize("raw", CASES)
def test_batch_path_matches_pydantic(raw: bytes | None) -> None:
    record = Record("events", 0, 7, None, raw or b"", 0)
    try:
        expected: tuple[object, ...] | str = event_row(Event.from_bytes(raw), record)
    except InvalidEvent as exc:
        expected = str(exc)
    valid, refused = validate_batch(_one(raw))
    if isinstance(expected, str):
        assert valid.height == 0 and refused == [(0, expected)]
    else:
        assert refused == [] and valid["_i"].to_list() == [0]
        # Events without an id or time get fresh defaults: compare the rest.
        if raw and b'"event_id"' in raw and b'"received_at"' in raw and b'"ts"' in raw:
            assert valid.drop("_i").to_dicts() == rows_frame([expected]).to_dicts()


def test_ordinary_events_take_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pydantic(_raw: bytes) -> Event:
        raise AssertionError("an ordinary event reached pydantic")

    monkeypatch.setattr(Event, "from_bytes", staticmethod(no_pydantic))
    raws = [Event(type="shown", generation_id=f"g{i}", user_id="u", properties={"n": i}).to_bytes() for i in range(3)]
    valid, refused = validate_batch(RecordBatch(["events"] * 3, [0] * 3, [0, 1, 2], raws))
    assert refused == [] and valid.height == 3


def test_ordinary_generations_take_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving's signed samples and a product's text-only generations: one each per generation, as many as
    all its feedback; pydantic would cost them ~60 us each."""
    monkeypatch.setattr(Event, "from_bytes", staticmethod(_no_pydantic))
    raws = [_gen(), _text(), _gen(finish_reason="stop", arm="holdout", surface="")]
    valid, refused = validate_batch(RecordBatch(["events"] * 3, [0] * 3, [0, 1, 2], raws))
    assert refused == [] and valid.height == 3


def _no_pydantic(_raw: bytes) -> Event:
    raise AssertionError("an ordinary event reached pydantic")


@pytest.mark.parametrize(
    "properties", [{}, {"a": "é\n\u2028\U0001f600", "b": [1, 2.5, None, True, 10**30, 1e300, -0.0], "c": {"d": 1.5e-7}}]
)
def test_properties_column_is_compact_json_of_the_same_values(properties: dict[str, object]) -> None:
    from flywheel.fast_validate import properties_json

    text = properties_json(properties)
    assert json.loads(text) == properties and repr(json.loads(text)) == repr(properties)
    assert ", " not in text and ": " not in text


@pytest.mark.parametrize("item", [{"a": "é", "b": [1, 2.5, None], "c": {"d": True}}, [1, "x"], "s", 5, {"s": "\ud800"}])
def test_refused_item_bytes_are_compact_json_of_the_item(item: object) -> None:
    from ingest.collector.intake import _item_bytes

    assert json.loads(_item_bytes(item)) == item


def test_leniently_parsed_items_are_written_back_as_json_dumps_does() -> None:
    """NaN, which msgspec would write as null, keeps its spelling in a refused item's bytes."""
    from ingest.collector.intake import _item_bytes

    item = {"a": "é", "b": [1, float("nan"), float("inf")]}
    assert _item_bytes(item, lenient=True) == json.dumps(item, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    "body", [b'{"a":[1,2.5,-0.0,1e300,123456789012345678901234567890,"\\u00e9"]}', b"[NaN]", b'["\\ud800"]', b"[1e400]"]
)
def test_body_parse_matches_json_loads(body: bytes) -> None:
    from ingest.collector.intake import parse_json

    assert repr(parse_json(body).doc) == repr(json.loads(body))


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"a":"\xff"}', "body is not UTF-8"),
        (b"[" * 1000 + b"]" * 1000, "body is nested too deeply"),
        (b"[" + b"9" * 5000 + b"]", "body is not JSON: Exceeds the limit (4300 digits)"),
    ],
)
def test_unreadable_bodies_are_refused_with_a_reason(body: bytes, reason: str) -> None:
    from ingest.collector.intake import BodyError, parse_json

    with pytest.raises(BodyError) as err:
        parse_json(body)
    assert err.value.status == 400 and err.value.reason.startswith(reason)


def test_body_that_is_not_json_keeps_its_reason() -> None:
    from ingest.collector.intake import BodyError, parse_json

    with pytest.raises(BodyError) as err:
        parse_json(b"{nope")
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(b"{nope")
    assert err.value.reason == f"body is not JSON: {expected.value}"


BATCH_EXTRA = [
    _with(ts="2026-02-30T00:00:00Z"),  # the plain pattern, no such day: pydantic refuses
    _with(ts="2028-02-29T23:59:59.5Z"),
    json.dumps({**BASE, "properties": {"a": 1, "b": "x y", "c": None, "d": True}}, separators=(",", ":")).encode(),
    json.dumps({**BASE, "properties": {"a": 1.5}}, separators=(",", ":")).encode(),
    json.dumps({**BASE, "properties": {"a": "é"}}, separators=(",", ":"), ensure_ascii=False).encode(),
    json.dumps({**BASE, "properties": {"a": {"b": [1]}}}, separators=(",", ":")).encode(),
    json.dumps({**BASE, "properties": "text"}, separators=(",", ":")).encode(),
    json.dumps({**BASE, "properties": {}}, separators=(",", ":")).encode(),
    # Canonical-looking properties that pydantic stores otherwise: -0 reads as 0, a repeated key keeps its last value.
    json.dumps({**BASE, "properties": {}}, separators=(",", ":")).encode().replace(b"{}", b'{"a":-0,"b":-1}'),
    json.dumps({**BASE, "properties": {}}, separators=(",", ":")).encode().replace(b"{}", b'{"a":1,"b":"x","a":2}'),
    json.dumps({**BASE, "properties": {}}, separators=(",", ":")).encode().replace(b"{}", b'{"a":1,"ab":2,"b":"a"}'),
]


def test_batch_path_matches_pydantic_row_for_row() -> None:
    """Every case in one batch: the same rows (in order) or the same refusals as `Event.from_bytes`."""
    raws = [*CASES, *BATCH_EXTRA]
    batch = RecordBatch(["events"] * len(raws), [0] * len(raws), list(range(len(raws))), raws)
    valid, refused = validate_batch(batch)
    expected_rows, expected_refused = [], []
    for i, raw in enumerate(raws):
        try:
            expected_rows.append((i, event_row(Event.from_bytes(raw), Record("events", 0, i, None, raw, 0))))
        except InvalidEvent as exc:
            expected_refused.append((i, str(exc)))
    assert refused == expected_refused
    assert valid["_i"].to_list() == [i for i, _ in expected_rows]
    # Events without an id or time get fresh defaults: compare those that carry them.
    carry = (b'"event_id"', b'"ts"', b'"received_at"')
    fixed = [k for k, (i, _) in enumerate(expected_rows) if all(f in raws[i] for f in carry)]
    want = rows_frame([expected_rows[k][1] for k in fixed])
    assert valid.drop("_i")[fixed].to_dicts() == want.to_dicts()


def test_values_that_are_not_one_object_each_are_judged_alone() -> None:
    """A batch is decoded as one JSON array when it can be: a value holding two events, or none, must not
    shift the others onto the wrong records."""
    a, b = _with(event_id="a"), _with(event_id="b")
    raws = [a + b"," + b, b"", b" ", b]
    valid, refused = validate_batch(RecordBatch(["events"] * 4, [0] * 4, [0, 1, 2, 3], raws))
    assert valid["_i"].to_list() == [3] and valid["event_id"].to_list() == ["b"]
    assert [i for i, _ in refused] == [0, 1, 2]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (_with(ts="0001-01-01T00:30:00+01:00"), "ts: Value error, 0001-01-01T00:30:00+01:00 is outside"),
        (_with(ts="9999-12-31T23:30:00-01:00"), "ts: Value error, 9999-12-31T23:30:00-01:00 is outside"),
        (_with(properties={}).replace(b"{}", b'{"x": NaN}'), "properties: Value error, nan is not a JSON number"),
        (_with(properties={}).replace(b"{}", b'{"x": -Infinity}'), "properties: Value error, -inf is not a JSON"),
        (_with(properties={}).replace(b"{}", b'{"x": ' + b"[" * 1000 + b"]" * 1000 + b"}"), "body: Invalid JSON"),
        (_with(properties={}).replace(b"{}", b'{"x": ' + b"[" * 70 + b"]" * 70 + b"}"), "properties: Value error"),
        (_with(user_id="u").replace(b'"u"', b'"\xff"'), "body: Invalid JSON: invalid unicode code point"),
        (None, "record has no value (a tombstone)"),
    ],
)
def test_hostile_records_are_refused_with_a_reason_never_raised(raw: bytes | None, reason: str) -> None:
    valid, refused = validate_batch(RecordBatch(["events", "events"], [0, 0], [7, 8], [raw, _with()]))
    assert valid["_i"].to_list() == [1]
    assert len(refused) == 1 and refused[0][0] == 0 and refused[0][1].startswith(reason), refused
