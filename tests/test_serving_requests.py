"""What a client may send to `POST /v1/completions`: every mistake is a 4xx with a reason, never a 500.

Against the real app with the tiny model (256-token context), Redis for the split and the real
broker for the generation events.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from flywheel.bus import ensure_topics, make_producer
from flywheel.bus.reader import read_topic
from flywheel.connections import redis_client
from flywheel.contract import Event, TrafficSplit
from flywheel.settings import Settings
from flywheel.signing import check_generation
from flywheel.traffic import TrafficSplitStore
from serving.app import create_app
from serving.pool import PolicyPool

OK = {"prompt": "x = ", "user": "u1", "max_tokens": 2}


@pytest.fixture
def client(settings: Settings, tiny_model_dir: Path) -> Iterator[TestClient]:
    ensure_topics(settings)
    store = TrafficSplitStore(redis_client(settings), settings)
    store.put(TrafficSplit(champion_version="1"))
    pool = PolicyPool(store.get, lambda _: str(tiny_model_dir))
    producer = make_producer(settings)  # closed with the app (its lifespan), not left running after the test
    app = create_app(pool, producer, settings.events_topic, on_shutdown=producer.close,
                     signing_key=settings.serving_key.get_secret_value(), max_body_bytes=8192)  # fmt: skip
    with TestClient(app) as c:
        yield c


def logged(settings: Settings) -> list[Event]:
    """The generation events serving has logged (it waits for the broker before answering)."""
    return [Event.from_bytes(r.value) for r in read_topic(settings, settings.events_topic)]


def error(resp, status: int) -> dict:  # type: ignore[no-untyped-def]
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def test_session_id_over_256_characters_is_a_422_naming_it(client: TestClient) -> None:
    err = error(client.post("/v1/completions", json={**OK, "session_id": "s" * 257}), 422)
    assert err["param"] == "session_id" and "256" in err["message"]
    assert client.post("/v1/completions", json={**OK, "session_id": "s" * 256}).status_code == 200


@pytest.mark.parametrize("seed", [2**63, 2**200, -1])
def test_out_of_range_seed_is_a_422(client: TestClient, seed: int) -> None:
    err = error(client.post("/v1/completions", json={**OK, "seed": seed}), 422)
    assert err["param"] == "seed"


def test_largest_seed_is_served(client: TestClient) -> None:
    assert client.post("/v1/completions", json={**OK, "seed": 2**63 - 1}).status_code == 200


def test_a_seed_too_long_to_parse_is_a_400(client: TestClient) -> None:
    body = '{"prompt": "x", "user": "u", "seed": ' + "9" * 5000 + "}"
    resp = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert "not valid JSON" in error(resp, 400)["message"]


def test_max_tokens_must_leave_room_for_the_prompt_in_the_context(client: TestClient) -> None:
    # The tiny model's context is 256 tokens: 256 completion tokens leave none for the prompt.
    err = error(client.post("/v1/completions", json={**OK, "max_tokens": 256}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "256-token context" in err["message"]
    long_prompt = {**OK, "prompt": "x = 1\n" * 400, "max_tokens": 8}
    assert error(client.post("/v1/completions", json=long_prompt), 400)["code"] == "context_length_exceeded"
    assert error(client.post("/v1/completions", json={**OK, "max_tokens": 10**6}), 422)["param"] == "max_tokens"


@pytest.mark.parametrize(
    "raw",
    [
        '{"prompt": "x", "user": "u", "temperature": NaN}',
        '{"prompt": "x", "user": "u", "temperature": Infinity}',
        '{"prompt": "x", "user": "u", "max_tokens": -Infinity}',
        '{"prompt": "x", "user": "u", "temperature": 1e999}',
        '{"prompt": NaN, "user": "u"}',
    ],
)
def test_nan_and_infinity_are_refused(client: TestClient, raw: str) -> None:
    resp = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert "not valid JSON" in error(resp, 400)["message"]


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"x"', b"{", b"\xff\xfe{}", b"[" * 3000 + b"]" * 3000])
def test_a_body_that_is_not_a_json_object_is_a_400(client: TestClient, raw: bytes) -> None:
    resp = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    error(resp, 400)


def test_a_body_over_the_cap_is_a_413_declared_or_streamed(client: TestClient) -> None:
    big = {**OK, "prompt": "x" * 9000}
    assert error(client.post("/v1/completions", json=big), 413)["code"] == "body_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the cap must hold while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'", "user": "u"}'

    assert error(client.post("/v1/completions", content=chunked()), 413)["code"] == "body_too_large"


def test_temperature_zero_is_greedy(client: TestClient, settings: Settings) -> None:
    texts = set()
    for seed in (1, 2, 3):
        resp = client.post("/v1/completions", json={**OK, "prompt": "def ", "max_tokens": 6, "temperature": 0,
                                                    "seed": seed})  # fmt: skip
        assert resp.status_code == 200, resp.text
        texts.add(resp.json()["choices"][0]["text"])
    assert len(texts) == 1, "greedy decoding does not depend on the seed"
    events = logged(settings)
    assert len(events) == 3
    assert {e.generation().temperature for e in events} == {0.0}


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("best_of", 3), ("echo", True), ("suffix", "}"), ("top_p", 0.9),
        ("presence_penalty", 0.5), ("frequency_penalty", 1), ("logit_bias", {"50256": -100}), ("top_k", 5),
        ("stream_options", {"include_usage": True}),  # without stream=true
    ],
)  # fmt: skip
def test_an_openai_parameter_serving_does_not_honour_is_refused_by_name(
    client: TestClient, param: str, value: object
) -> None:
    err = error(client.post("/v1/completions", json={**OK, param: value}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("param", "value", "named"),
    [
        ("n", True, "n"), ("n", 1.0, "n"), ("n", 0, "n"), ("n", 17, "n"), ("logprobs", 6, "logprobs"),
        ("logprobs", True, "logprobs"), ("logprobs", -1, "logprobs"), ("stop", "", "stop.0"),
        ("stop", ["a", "b", "c", "d", "e"], "stop"), ("stop", [1], "stop.0"), ("stop", "x" * 65, "stop.0"),
        ("stream", 1, "stream"), ("stream", "yes", "stream"),
    ],
)  # fmt: skip
def test_an_honoured_parameter_out_of_range_is_a_422_naming_it(
    client: TestClient, param: str, value: object, named: str
) -> None:
    assert error(client.post("/v1/completions", json={**OK, param: value}), 422)["param"] == named


def test_openai_parameters_at_their_neutral_values_are_served(client: TestClient) -> None:
    neutral = {"n": 1, "best_of": 1, "stream": False, "logprobs": None, "echo": False, "stop": None,
               "suffix": None, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
               "model": "anything"}  # fmt: skip
    resp = client.post("/v1/completions", json={**OK, **neutral})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 1


def test_unencodable_text_is_a_422(client: TestClient) -> None:
    raw = json.dumps({**OK, "prompt": "x"}).replace('"x"', '"\\ud800"')
    resp = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert error(resp, 422)["param"] == "prompt"


def test_served_generations_carry_serving_signature(client: TestClient, settings: Settings) -> None:
    body = client.post("/v1/completions", json={**OK, "user": "alice"}).json()
    (event,) = logged(settings)
    key = settings.serving_key.get_secret_value()
    assert event.generation_id == body["id"]
    assert check_generation(key, event.generation_id, "alice", event.generation()) is None
    assert check_generation("another key", event.generation_id, "alice", event.generation()) is not None


def test_the_openapi_document_describes_the_body_and_its_refused_parameters(client: TestClient) -> None:
    doc = client.get("/openapi.json")
    assert doc.status_code == 200
    body = doc.json()["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "user", "max_tokens", "temperature"} <= set(body["required"]) | set(body["properties"])
    assert "logged as a generation of its own" in body["properties"]["n"]["description"]
    assert "top_p is not supported" not in body["properties"]["n"]["description"]
    assert "nucleus sampling is not supported" in body["properties"]["top_p"]["description"]
