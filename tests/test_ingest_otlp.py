"""OTLP/HTTP traces door: the official OpenTelemetry SDK and OTLP HTTP exporter, unchanged, export GenAI spans to
a running collector (real broker, real lake); generations land once each; feedback sent through Segment for their
ids gives them rewards. The same through OTLP/JSON. Bad input: a 4xx or a dead letter with its reason."""

from __future__ import annotations

import base64
import dataclasses
import gzip
import json
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from google.protobuf import json_format
from hypothesis import given
from hypothesis import settings as settings_for_fuzz
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from flywheel.bus import ensure_topics
from flywheel.bus.reader import read_topic
from flywheel.contract import Event, InvalidEvent, utcnow
from flywheel.lake.tables import EVENTS
from flywheel.settings import Settings
from ingest.collector.app import create_app
from ingest.collector.otlp import _as_fields, decode_request, traces_intake
from ingest.dead_letters import DeadLetter
from ingest.replay import revalidate
from ingest.worker.loop import IngestWorker
from launcher.embedded import free_port, wait_for_port
from signals.recompute import recompute_records
from signals.reward import builtin_definition

KEY = "dev-write-key"
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def collector_url(settings: Settings) -> Iterator[str]:
    ensure_topics(settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for_port("127.0.0.1", port)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def messages(role: str, text: str, **extra: object) -> str:
    return json.dumps([{"role": role, "parts": [{"type": "text", "content": text}], **extra}])


def genai_spans() -> Sequence[ReadableSpan]:
    """Spans as instrumentations emit them, made by the official SDK (a local provider, not the global one)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "acme-chat", "enduser.id": "user-r"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test-instrumentation")
    common = {"gen_ai.provider.name": "openai", "gen_ai.request.model": "gpt-x", "gen_ai.response.model": "gpt-x-0613"}
    # Latest conventions, content as span attributes.
    with tracer.start_as_current_span("chat gpt-x", attributes={
        **common, "gen_ai.operation.name": "chat", "gen_ai.response.id": "chatcmpl-1", "user.id": "user-a",
        "gen_ai.conversation.id": "conv-1", "gen_ai.response.finish_reasons": ["stop"],
        "gen_ai.request.temperature": 0.7, "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 5,
        "gen_ai.system_instructions": json.dumps([{"type": "text", "content": "Be brief."}]),
        "gen_ai.input.messages": messages("user", "What is 2+2?"),
        "gen_ai.output.messages": messages("assistant", "4.", finish_reason="stop"),
    }):  # fmt: skip
        pass
    # Latest conventions, content on the operation-details event; the user from the resource.
    with tracer.start_as_current_span("chat gpt-x", attributes={
        **common, "gen_ai.operation.name": "chat", "gen_ai.response.id": "chatcmpl-2",
    }) as span:  # fmt: skip
        span.add_event("gen_ai.client.inference.operation.details", {
            "gen_ai.input.messages": messages("user", "Name a colour."),
            "gen_ai.output.messages": messages("assistant", "Teal.", finish_reason="content_filter"),
        })  # fmt: skip
    # v1.36 and earlier: one span event per message, no response id (the ids name it).
    with tracer.start_as_current_span("text_completion gpt-x", attributes={
        **common, "gen_ai.operation.name": "text_completion", "user.id": "user-c",
    }) as span:  # fmt: skip
        span.add_event("gen_ai.system.message", {"content": "Complete the code."})
        span.add_event("gen_ai.user.message", {"content": "def add(a, b):"})
        choice = json.dumps({"role": "assistant", "content": " return a + b"})
        span.add_event("gen_ai.choice", {"index": 0, "finish_reason": "length", "message": choice})
    # Not generations: ignored and counted.
    with tracer.start_as_current_span("embeddings", attributes={**common, "gen_ai.operation.name": "embeddings"}):
        pass
    with tracer.start_as_current_span("GET /home", attributes={"http.request.method": "GET"}):
        pass
    provider.shutdown()
    return memory.get_finished_spans()


def drain_lake(settings: Settings, rows: int, group: str) -> None:
    worker = IngestWorker(settings, group_id=group, poll_timeout_s=0.3)
    table = EVENTS.at(settings.lake_root)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and EVENTS.read(table).height < rows:
            worker.run_once()
        worker.run_once()  # anything more would land now
    finally:
        worker.close()


def generation_ids(spans: Sequence[ReadableSpan]) -> dict[str, str]:
    """Span name and position -> the generation id its event must carry."""
    third = spans[2].get_span_context()
    return {"a": "chatcmpl-1", "b": "chatcmpl-2", "c": f"{third.trace_id:032x}-{third.span_id:016x}"}


def feedback_through_segment(base_url: str, ids: dict[str, str]) -> None:
    batch = [
        {"type": "track", "event": "Thumbs", "messageId": "t-a", "userId": "user-a",
         "properties": {"generation_id": ids["a"], "value": "up"}},
        {"type": "track", "event": "Thumbs", "messageId": "t-b", "userId": "user-r",
         "properties": {"generation_id": ids["b"], "value": "down"}},
        {"type": "track", "event": "Accepted", "messageId": "acc-c", "userId": "user-c",
         "properties": {"generation_id": ids["c"]}},
    ]  # fmt: skip
    r = httpx.post(f"{base_url}/v1/batch", json={"batch": batch}, auth=(KEY, ""))
    assert r.status_code == 200 and r.json()["accepted"] == 3, r.text


def check_lake_and_rewards(settings: Settings, ids: dict[str, str]) -> None:
    lake = EVENTS.read(EVENTS.at(settings.lake_root))
    gens = lake.filter(lake["type"] == "generation")
    assert sorted(gens["generation_id"].to_list()) == sorted(ids.values())  # once each
    by_id = {row["generation_id"]: row for row in gens.iter_rows(named=True)}
    a = json.loads(by_id[ids["a"]]["properties"])
    assert a["prompt"] == "system: Be brief.\n\nuser: What is 2+2?" and a["completion"] == "4."
    assert (a["model_version"], a["surface"], a["temperature"], a["input_tokens"]) == ("gpt-x-0613", "chat", 0.7, 12)
    assert by_id[ids["a"]]["user_id"] == "user-a" and by_id[ids["a"]]["session_id"] == "conv-1"
    assert by_id[ids["a"]]["source"] == "otlp"
    b = json.loads(by_id[ids["b"]]["properties"])
    assert (b["prompt"], b["completion"], by_id[ids["b"]]["user_id"]) == ("Name a colour.", "Teal.", "user-r")
    assert (b["finish_reason"], b["provider_finish_reason"]) == ("declined", "content_filter")
    c = json.loads(by_id[ids["c"]]["properties"])
    assert c["prompt"] == "system: Complete the code.\n\nuser: def add(a, b):" and c["completion"] == " return a + b"
    assert (c["surface"], c["finish_reason"]) == ("code-completion", "length")

    later = utcnow() + timedelta(days=1)  # every window closed
    rewards = {}
    for surface in ("chat", "code-completion"):
        for record in recompute_records(settings, builtin_definition(surface), now=later):
            rewards[record.generation_id] = record
    assert set(rewards) == set(ids.values())
    assert rewards[ids["a"]].reward > 0 and rewards[ids["a"]].label_source == "explicit"
    assert rewards[ids["b"]].reward < 0 and rewards[ids["b"]].label_source == "explicit"
    assert rewards[ids["c"]].reward > 0 and rewards[ids["c"]].model_version == "gpt-x-0613"


def ignored(why: str) -> float:
    """The collector's count (it runs in this process, on the default registry)."""
    labels = {"endpoint": "/v1/traces", "why": why}
    return REGISTRY.get_sample_value("flywheel_collector_ignored_total", labels) or 0.0


def test_official_otlp_http_exporter_lands_generations_once_and_segment_feedback_rewards_them(
    settings: Settings, collector_url: str
) -> None:
    before = {why: ignored(why) for why in ("operation:embeddings", "not_gen_ai")}
    spans = genai_spans()
    exporter = OTLPSpanExporter(endpoint=f"{collector_url}/v1/traces", headers=BEARER, compression=Compression.Gzip)
    assert exporter.export(spans) == SpanExportResult.SUCCESS
    assert exporter.export(spans) == SpanExportResult.SUCCESS  # a retried export: nothing doubles
    exporter.shutdown()
    ids = generation_ids(spans)
    feedback_through_segment(collector_url, ids)
    drain_lake(settings, 6, "g-otlp")
    assert EVENTS.read(EVENTS.at(settings.lake_root)).height == 6
    check_lake_and_rewards(settings, ids)
    assert read_topic(settings, settings.dead_letter_topic) == []
    assert ignored("operation:embeddings") == before["operation:embeddings"] + 2
    assert ignored("not_gen_ai") == before["not_gen_ai"] + 2


def otlp_json(spans: Sequence[ReadableSpan]) -> bytes:
    """The official encoder's request as OTLP/JSON (ids in hex, as the specification says)."""
    doc = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)  # as OTLP/JSON says
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for name in ("traceId", "spanId", "parentSpanId"):
                    if name in span:
                        span[name] = base64.b64decode(span[name]).hex()
    return json.dumps(doc).encode()


def test_otlp_json_lands_the_same_generations(settings: Settings, collector_url: str) -> None:
    spans = genai_spans()
    r = httpx.post(
        f"{collector_url}/v1/traces",
        content=otlp_json(spans),
        headers={"Content-Type": "application/json", "x-flywheel-write-key": KEY},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json() == {}  # nothing rejected
    ids = generation_ids(spans)
    feedback_through_segment(collector_url, ids)
    drain_lake(settings, 6, "g-otlp-json")
    check_lake_and_rewards(settings, ids)


# ---------------------------------------------------------------- bad input, one door at a time


def kv(key: str, value: object) -> KeyValue:
    any_value = AnyValue()
    if isinstance(value, str):
        any_value.string_value = value
    elif isinstance(value, int):
        any_value.int_value = value
    return KeyValue(key=key, value=any_value)


def good(n: int, **over: object) -> Span:
    attrs = {
        "gen_ai.operation.name": "chat",
        "gen_ai.response.model": "m-1",
        "user.id": f"u{n}",
        "gen_ai.input.messages": messages("user", f"question {n}"),
        "gen_ai.output.messages": messages("assistant", f"answer {n}"),
        **over,
    }
    return Span(
        trace_id=n.to_bytes(16, "big"),
        span_id=n.to_bytes(8, "big"),
        name="chat",
        start_time_unix_nano=1_700_000_000_000_000_000,
        end_time_unix_nano=1_700_000_001_000_000_000,
        attributes=[kv(k, v) for k, v in attrs.items() if v is not None],
    )


def body(*spans: Span) -> bytes:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    scope.spans.extend(spans)
    return request.SerializeToString()


PROTOBUF = {**BEARER, "Content-Type": "application/x-protobuf"}


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    ensure_topics(settings)
    with TestClient(create_app(settings)) as c:
        yield c


def test_bad_spans_are_dead_lettered_with_their_reason_and_the_rest_land(
    client: TestClient, settings: Settings
) -> None:
    spans = [
        good(1),
        good(2, **{"gen_ai.input.messages": None, "gen_ai.output.messages": None}),  # content capture off
        good(3, **{"gen_ai.operation.name": "summon"}),  # unknown operation
        good(4, **{"user.id": None}),  # missing user
        good(5, **{"gen_ai.input.messages": messages("user", "x" * 400_000)}),  # a huge attribute
        good(6, **{"gen_ai.operation.name": "execute_tool"}),  # not a generation: ignored, no letter
        good(7, **{"unrelated.blob": "y" * 100_000}),  # a huge attribute Flywheel does not read: lands
    ]
    r = client.post("/v1/traces", content=gzip.compress(body(*spans)), headers={**PROTOBUF, "Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    answer = ExportTraceServiceResponse.FromString(r.content)
    assert answer.partial_success.rejected_spans == 4
    assert "content capture is off" in answer.partial_success.error_message

    events = [Event.from_bytes(rec.value) for rec in read_topic(settings, settings.events_topic)]
    assert sorted(e.user_id for e in events) == ["u1", "u7"]
    letters = {
        json.loads(d.original)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["spanId"]: d
        for d in (DeadLetter.from_bytes(rec.value) for rec in read_topic(settings, settings.dead_letter_topic))
    }
    reasons = {int(span_id, 16): d.reason for span_id, d in letters.items()}
    assert set(reasons) == {2, 3, 4, 5}
    assert "no input and output messages: content capture is off" in reasons[2]
    assert "'summon' is not an operation Flywheel knows" in reasons[3]
    assert "no user; set user.id or enduser.id" in reasons[4]
    assert "the limit is 262144" in reasons[5] and "cut in this letter's copy" in reasons[5]
    assert all(d.source == "http:/v1/traces" for d in letters.values())
    assert len(letters[f"{5:016x}"].original) < 262_144  # the letter itself stays producible


def test_a_malformed_body_is_a_400_and_kept_as_a_dead_letter(client: TestClient, settings: Settings) -> None:
    r = client.post("/v1/traces", content=b"\x0a\xff\xff\xff\xff\x0fnot protobuf", headers=PROTOBUF)
    assert r.status_code == 400 and "not an OTLP ExportTraceServiceRequest" in r.json()["error"]
    j = client.post("/v1/traces", content=b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
                    headers={**BEARER, "Content-Type": "application/json"})  # fmt: skip
    assert j.status_code == 400 and "ids are hex" in j.json()["error"]
    letters = [DeadLetter.from_bytes(rec.value) for rec in read_topic(settings, settings.dead_letter_topic)]
    assert sorted(d.original[:1] for d in letters) == [b"\n", b"{"]  # partitions: any order
    assert read_topic(settings, settings.events_topic) == []


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Content-Type": "application/x-protobuf"}, 401),
        ({"Content-Type": "application/x-protobuf", "Authorization": "Bearer nope"}, 401),
        ({"Content-Type": "application/x-protobuf", "x-flywheel-write-key": "nope"}, 401),
        ({"Content-Type": "text/plain", **BEARER}, 415),
    ],
)
def test_credentials_and_media_type_are_checked_before_the_body(
    client: TestClient, settings: Settings, headers: dict[str, str], status: int
) -> None:
    r = client.post("/v1/traces", content=body(good(1)), headers=headers)
    assert r.status_code == status, r.text
    assert read_topic(settings, settings.events_topic) == [] and read_topic(settings, settings.dead_letter_topic) == []


def test_basic_auth_and_a_configured_header_carry_the_key(settings: Settings) -> None:
    ensure_topics(settings)
    custom = settings.model_copy(update={"otlp_write_key_header": "x-api-key"})
    with TestClient(create_app(custom)) as c:
        basic = {"Authorization": "Basic " + base64.b64encode(f"{KEY}:".encode()).decode()}
        assert (
            c.post(
                "/v1/traces", content=body(good(1)), headers={**basic, "Content-Type": PROTOBUF["Content-Type"]}
            ).status_code
            == 200
        )
        assert (
            c.post(
                "/v1/traces",
                content=body(good(2)),
                headers={"x-api-key": KEY, "Content-Type": PROTOBUF["Content-Type"]},
            ).status_code
            == 200
        )
    assert len(read_topic(settings, settings.events_topic)) == 2


def test_a_body_past_the_limit_is_a_413(settings: Settings) -> None:
    ensure_topics(settings)
    with TestClient(create_app(settings, max_body_bytes=10_000)) as c:
        r = c.post("/v1/traces", content=body(good(1, **{"x": "z" * 20_000})), headers=PROTOBUF)
        bomb = c.post(
            "/v1/traces", content=gzip.compress(b"\0" * 50_000), headers={**PROTOBUF, "Content-Encoding": "gzip"}
        )
    assert r.status_code == 413 and bomb.status_code == 413
    assert read_topic(settings, settings.events_topic) == []


def test_a_dead_lettered_span_replays_after_a_fix_as_the_door_maps_it(client: TestClient, settings: Settings) -> None:
    r = client.post("/v1/traces", content=body(good(4, **{"user.id": None})), headers=PROTOBUF)
    assert r.status_code == 200
    (letter,) = [DeadLetter.from_bytes(rec.value) for rec in read_topic(settings, settings.dead_letter_topic)]
    with pytest.raises(InvalidEvent, match="no user"):
        revalidate(letter)
    doc = json.loads(letter.original)  # the fix: the span's resource names the user
    doc["resourceSpans"][0]["resource"] = {"attributes": [{"key": "enduser.id", "value": {"stringValue": "u4"}}]}
    event = revalidate(dataclasses.replace(letter, original=json.dumps(doc).encode()))
    assert (event.event_id, event.user_id, event.source) == (f"otlp-{4:032x}-{4:016x}", "u4", "otlp")
    assert event.properties["prompt"] == "question 4" and event.properties["completion"] == "answer 4"


_KEYS = ["gen_ai.operation.name", "gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.response.id",
         "gen_ai.response.model", "user.id", "gen_ai.response.finish_reasons", "gen_ai.request.temperature",
         "gen_ai.prompt.0.content", "gen_ai.completion.0.content", "flywheel.surface", "other"]  # fmt: skip
_TEXTS = ["chat", "text_completion", "embeddings", "summon", "", "[]", "{}", "[{}]", messages("user", "q"),
          '[{"role": "assistant", "parts": [{"type": "tool_call"}]}]', '[{"parts": [{"type": "text", "content": 3}]}]',
          "x" * 300, "Stop"]  # fmt: skip
_VALUES = st.sampled_from(_TEXTS) | st.integers(-(2**63), 2**63 - 1)
_NONE = dict.fromkeys(("gen_ai.operation.name", "gen_ai.response.model", "user.id", "gen_ai.input.messages",
                       "gen_ai.output.messages"))  # fmt: skip


@settings_for_fuzz(max_examples=200, deadline=None)
@given(spans=st.lists(st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=8), min_size=1, max_size=6))
def test_every_span_is_taken_ignored_or_refused_and_nothing_raises(spans: list[dict[str, object]]) -> None:
    request = ExportTraceServiceRequest.FromString(
        body(*(good(i + 1, **{**_NONE, **attrs}) for i, attrs in enumerate(spans)))
    )
    intake, ignored = traces_intake(request, utcnow(), 262_144)
    assert len(intake.accepted) + len(intake.refused) + sum(ignored.values()) == len(spans)
    assert all(r.reason for r in intake.refused)


def test_otlp_json_the_shortcut_does_not_take_is_decoded_by_protobufs_parser_to_the_same_request() -> None:
    spans = genai_spans()
    compact = otlp_json(spans)
    doc = json.loads(compact)
    first = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    first["start_time_unix_nano"] = first.pop("startTimeUnixNano")  # the field's own name, which proto3 JSON allows
    first["kind"] = "SPAN_KIND_CLIENT"  # an enum by name
    unusual = json.dumps(doc, indent=2).encode()  # spaced out, as Go's protojson may write it
    with pytest.raises(TypeError):  # the constructors' shortcut does not take it ...
        ExportTraceServiceRequest(**_as_fields(json.loads(unusual)))
    expected = encode_spans(spans)
    expected.resource_spans[0].scope_spans[0].spans[0].kind = Span.SPAN_KIND_CLIENT
    assert decode_request(unusual, "application/json") == expected  # ... protobuf's parser does
    assert decode_request(compact, "application/json") == encode_spans(spans)


def test_refused_spans_sharing_one_big_resource_cost_letters_within_a_constant_factor_of_the_request(
    client: TestClient, settings: Settings
) -> None:
    """300 refused spans (content capture off) under one resource of 200 kB: the resource is kept whole in one
    letter; the others keep what the mapping reads of it (the user) and where the whole is, so the letters add up
    to a small multiple of the request, not 300 copies of the resource (60 MB); each still replays as before."""
    from ingest.collector.otlp import ELIDED

    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.extend([kv("enduser.id", "u-shared"), kv("host.blob", "b" * 200_000)])
    scope = rs.scope_spans.add()
    scope.scope.name = "instrumentation"
    scope.spans.extend(good(n, **{"user.id": None, "gen_ai.input.messages": None}) for n in range(1, 301))
    sent = request.SerializeToString()
    r = client.post("/v1/traces", content=sent, headers=PROTOBUF)
    assert r.status_code == 200
    assert ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans == 300
    records = read_topic(settings, settings.dead_letter_topic)
    assert len(records) == 300
    assert sum(len(rec.value) for rec in records) < 3 * len(sent)
    letters = [DeadLetter.from_bytes(rec.value) for rec in records]
    docs = [json.loads(d.original)["resourceSpans"][0] for d in letters]
    whole = [d for d in docs if any(a["key"] == "host.blob" for a in d["resource"]["attributes"])]
    assert len(whole) == 1
    for letter in letters:
        with pytest.raises(InvalidEvent, match="content capture is off"):  # the user is still read: same reason
            revalidate(letter)
    elided = [d for d in docs if d is not whole[0]]
    assert all({a["key"] for a in d["resource"]["attributes"]} == {"enduser.id", ELIDED} for d in elided)


@pytest.mark.parametrize(("depth", "kind"), [(300, "kvlistValue"), (1200, "arrayValue"), (5000, "kvlistValue")])
def test_otlp_json_nested_past_the_parsers_depth_is_a_400(client: TestClient, depth: int, kind: str) -> None:
    inner = {"kvlistValue": '{"kvlistValue":{"values":[{"key":"a","value":',
             "arrayValue": '{"arrayValue":{"values":['}[kind] * depth + '{"stringValue":"x"}'  # fmt: skip
    inner += {"kvlistValue": "}]}}", "arrayValue": "]}}"}[kind] * depth
    doc = json.loads(otlp_json(genai_spans()[:1]))
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"].append({"key": "deep", "value": "PLACE"})
    raw = json.dumps(doc).replace('"PLACE"', inner)
    r = client.post("/v1/traces", content=raw, headers={**BEARER, "Content-Type": "application/json"})
    assert r.status_code == 400 and "nested" in r.json()["error"]


def test_the_answer_counts_a_span_the_time_bounds_refused_as_rejected(client: TestClient, settings: Settings) -> None:
    now_ns = int(utcnow().timestamp() * 1e9)
    recent = good(1)
    recent.start_time_unix_nano, recent.end_time_unix_nano = now_ns - 10**9, now_ns
    ancient = good(2)  # 2001: past the arrival window
    ancient.start_time_unix_nano, ancient.end_time_unix_nano = 978_307_200 * 10**9, 978_307_201 * 10**9
    r = client.post("/v1/traces", content=body(recent, ancient), headers=PROTOBUF)
    assert r.status_code == 200
    assert ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans == 1
    assert len(read_topic(settings, settings.events_topic)) == 1
