"""Fuzzing `POST /v1/completions` with JSON bodies: whatever a client sends, never a 5xx.

Hypothesis builds bodies from the OpenAI parameters with values of every JSON type (edge
numbers, NaN and Infinity included), plus arbitrary JSON documents and raw bytes. Seeded
(derandomized) and bounded, against the real app with the tiny model, Redis and the broker;
max_tokens values stay small or out of range, so each served example generates a few tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from flywheel.bus import ensure_topics, make_producer
from flywheel.connections import redis_client
from flywheel.contract import TrafficSplit
from flywheel.settings import Settings
from flywheel.traffic import TrafficSplitStore
from serving.app import create_app
from serving.pool import PolicyPool

EDGE_INTS = st.sampled_from([0, 1, 2, -1, 255, 256, 257, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), 10**40])
EDGE_FLOATS = st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 2.0001, -1.0, 1e-300, 1e308, float("nan"), float("inf")])
TEXT = st.text(max_size=40) | st.sampled_from(["", "x" * 300, "\x00", "def f(x):\n    return", "\u202e"])
JSON_LEAF = st.none() | st.booleans() | EDGE_INTS | EDGE_FLOATS | TEXT
ANY_JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
PARAMS = [
    "prompt", "max_tokens", "temperature", "user", "session_id", "seed", "model", "n", "best_of", "stream",
    "logprobs", "echo", "stop", "suffix", "top_p", "presence_penalty", "frequency_penalty", "logit_bias",
    "stream_options", "top_k",
]  # fmt: skip
SMALL_MAX_TOKENS = st.integers(min_value=1, max_value=4)

REQUIRED = {
    "prompt": TEXT | ANY_JSON,
    "user": st.text(min_size=1, max_size=8) | ANY_JSON,
    "max_tokens": SMALL_MAX_TOKENS | EDGE_INTS | ANY_JSON,
}
completion_bodies = st.fixed_dictionaries(
    REQUIRED, optional={name: ANY_JSON | EDGE_INTS | EDGE_FLOATS for name in PARAMS if name not in REQUIRED}
)


def encode(doc: Any) -> bytes:
    # allow_nan: the bodies may carry NaN / Infinity literals, as some clients send them.
    return json.dumps(doc, allow_nan=True).encode()


def small_generation(doc: Any) -> bool:
    """True when the body could make the model generate more than a handful of tokens (kept fast)."""
    if not isinstance(doc, dict):
        return False
    value = doc.get("max_tokens", 16)
    return isinstance(value, int) and not isinstance(value, bool) and 4 < value <= 256


def test_no_body_makes_serving_answer_5xx(settings: Settings, tiny_model_dir: Path) -> None:
    ensure_topics(settings)
    store = TrafficSplitStore(redis_client(settings), settings)
    store.put(TrafficSplit(champion_version="1"))
    pool = PolicyPool(store.get, lambda _: str(tiny_model_dir))
    producer = make_producer(settings)  # closed with the app (its lifespan), not left running after the test
    app = create_app(pool, producer, settings.events_topic, on_shutdown=producer.close,
                     signing_key=settings.serving_key.get_secret_value())  # fmt: skip
    statuses: set[int] = set()

    @hsettings(max_examples=250, derandomize=True, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])  # fmt: skip
    @given(
        body=completion_bodies.filter(lambda d: not small_generation(d)).map(encode)
        | ANY_JSON.filter(lambda d: not small_generation(d)).map(encode)
        | st.binary(max_size=64)
    )
    def never_5xx(body: bytes) -> None:
        resp = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert resp.status_code < 500, (body[:300], resp.status_code, resp.text[:300])
        if resp.status_code >= 400:
            assert resp.json()["error"]["message"], "every refusal says why"
        statuses.add(resp.status_code)

    with TestClient(app) as client:
        never_5xx()
    # The examples reach both sides: some served, some refused (as 400 and as 422).
    assert {200, 400, 422} <= statuses, statuses
