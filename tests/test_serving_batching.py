"""Batched serving: concurrent requests share forward passes; n, stop, logprobs and stream are honoured.

The batcher's own rules are tested with a recording generator (a test double: it only records
which requests shared a call, which the real model cannot tell us); everything else runs the real
app with the tiny model, Redis for the split and the embedded broker for the generation events.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from flywheel.bus import ensure_topics, make_producer
from flywheel.bus.reader import read_topic
from flywheel.connections import redis_client
from flywheel.contract import Event, TrafficSplit
from flywheel.lm import load_policy
from flywheel.settings import Settings
from flywheel.signing import check_generation
from flywheel.traffic import TrafficSplitStore
from serving.app import create_app
from serving.batching import Batcher
from serving.generator import Generation, GenerationRequest
from serving.pool import PolicyPool

OK: dict[str, Any] = {"prompt": "import os\n\nclass Config:\n    def __init__(self", "user": "u1", "max_tokens": 12}


class Recorder:
    """Answers each request with its prompt; records the prompts of each call. Fails on prompt 'bad'."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls: list[list[str]] = []
        self.context = 64
        self.gate = gate

    def count_prompt_tokens(self, prompt: str) -> int:
        return max(1, len(prompt))

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        return [str(t) for t in token_ids]

    def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        if self.gate is not None:
            self.gate.wait(30)
        self.calls.append([r.prompt for r in requests])
        if any(r.prompt == "bad" for r in requests):
            raise ValueError("bad prompt")
        return [Generation([1], [2], r.prompt, [-0.5], "stop") for r in requests]


def test_requests_queued_together_share_a_call_up_to_max_batch() -> None:
    gen = Recorder()
    batcher = Batcher(max_batch=4, max_wait_s=0.0)
    futures = batcher.submit(gen, [GenerationRequest(str(i)) for i in range(10)])
    assert [f.result(timeout=30).completion for f in futures] == [str(i) for i in range(10)]
    batcher.stop()
    assert [len(c) for c in gen.calls][-2:] == [4, 2] and sum(map(len, gen.calls)) == 10
    assert all(len(c) <= 4 for c in gen.calls)


def test_a_batch_never_mixes_generators() -> None:
    old, new = Recorder(), Recorder()
    batcher = Batcher(max_batch=16, max_wait_s=0.0)
    blocker = threading.Event()
    slow = Recorder(gate=blocker)
    first = batcher.submit(slow, [GenerationRequest("hold")])  # keeps the worker busy while the queue fills
    mixed = []
    for i in range(6):
        mixed += batcher.submit(old if i % 2 else new, [GenerationRequest(f"{i}")])
    blocker.set()
    assert first[0].result(timeout=30).completion == "hold"
    assert [f.result(timeout=30).completion for f in mixed] == [str(i) for i in range(6)]
    batcher.stop()
    assert old.calls == [["1", "3", "5"]] and new.calls == [["0", "2", "4"]]


def test_a_failing_request_fails_alone() -> None:
    gen = Recorder()
    batcher = Batcher(max_batch=8, max_wait_s=0.0)
    futures = batcher.submit(gen, [GenerationRequest(p) for p in ("a", "bad", "c")])
    assert futures[0].result(timeout=30).completion == "a" and futures[2].result(timeout=30).completion == "c"
    with pytest.raises(ValueError, match="bad prompt"):
        futures[1].result(timeout=30)
    batcher.stop()


def test_with_two_workers_a_slow_batch_does_not_hold_up_another() -> None:
    # For back ends that batch continuously themselves (a vLLM server): several batches in flight.
    gate = threading.Event()
    slow, fast = Recorder(gate=gate), Recorder()
    batcher = Batcher(max_batch=8, max_wait_s=0.0, workers=2)
    held = batcher.submit(slow, [GenerationRequest("slow")])
    assert batcher.submit(fast, [GenerationRequest("fast")])[0].result(timeout=30).completion == "fast"
    assert not held[0].done(), "the slow batch is still running"
    gate.set()
    assert held[0].result(timeout=30).completion == "slow"
    batcher.stop()


def make_app(settings: Settings, tiny_model_dir: Path, **batching: Any) -> TestClient:
    ensure_topics(settings)
    store = TrafficSplitStore(redis_client(settings), settings)
    store.put(TrafficSplit(champion_version="1", experiment="exp"))
    pool = PolicyPool(store.get, lambda _: str(tiny_model_dir))
    producer = make_producer(settings)  # closed with the app (its lifespan), not left running after the test
    app = create_app(pool, producer, settings.events_topic, on_shutdown=producer.close,
                     signing_key=settings.serving_key.get_secret_value(), **batching)  # fmt: skip
    return TestClient(app)


@pytest.fixture
def client(settings: Settings, tiny_model_dir: Path) -> Iterator[TestClient]:
    with make_app(settings, tiny_model_dir) as c:
        yield c


def logged(settings: Settings) -> dict[str, Event]:
    events = [Event.from_bytes(r.value) for r in read_topic(settings, settings.events_topic)]
    return {e.generation_id: e for e in events}


def post(client: TestClient, **body: Any) -> dict[str, Any]:
    resp = client.post("/v1/completions", json={**OK, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def test_n_choices_are_each_logged_as_a_signed_generation(client: TestClient, settings: Settings) -> None:
    body = post(client, n=3, seed=11)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    ids = body["flywheel"]["generation_ids"]
    assert len(set(ids)) == 3 and [c["generation_id"] for c in body["choices"]] == ids and body["id"] == ids[0]
    events = logged(settings)
    key = settings.serving_key.get_secret_value()
    for choice in body["choices"]:
        event = events[choice["generation_id"]]
        record = event.generation()
        assert check_generation(key, event.generation_id, "u1", record) is None
        assert record.completion == choice["text"] and record.model_version == "1" and record.experiment == "exp"
    assert body["usage"]["completion_tokens"] == sum(
        len(events[i].generation().completion_token_ids) for i in ids
    )
    # Seeded: the same request gives the same choices, and choice 0 is the n=1 completion.
    again = post(client, n=3, seed=11)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]
    assert post(client, seed=11)["choices"][0]["text"] == body["choices"][0]["text"]
    assert len({tuple(events[i].generation().completion_token_ids) for i in ids}) > 1, "choices differ"


def stream(client: TestClient, **body: Any) -> tuple[list[dict[str, Any]], str]:
    with client.stream("POST", "/v1/completions", json={**OK, **body, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = "".join(resp.iter_text())
    frames = [f.removeprefix("data: ") for f in raw.split("\n\n") if f]
    assert frames[-1] == "[DONE]", "a stream ends with [DONE]"
    return [json.loads(f) for f in frames[:-1]], raw


def test_streaming_returns_the_same_text_as_not_streaming(client: TestClient, settings: Settings) -> None:
    plain = post(client, n=2, seed=5, logprobs=1)
    chunks, _ = stream(client, n=2, seed=5, logprobs=1, stream_options={"include_usage": True})
    for i, choice in enumerate(plain["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
        streamed_lp = [v for c in mine for v in c["logprobs"]["token_logprobs"]]
        assert streamed_lp == choice["logprobs"]["token_logprobs"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    # Both were logged (a stream is sent only once its choices are): four generations.
    assert len(logged(settings)) == 4


def test_stop_sequences_cut_the_output_and_the_log(client: TestClient, settings: Settings) -> None:
    for seed in range(40):
        free = post(client, seed=seed)["choices"][0]
        if len(free["text"].strip()) >= 4:
            break
    stop = free["text"][2:4]
    body = post(client, seed=seed, stop=[stop, "\x00unused"])
    choice = body["choices"][0]
    assert choice["text"] == free["text"][: free["text"].find(stop)] and stop not in choice["text"]
    assert choice["finish_reason"] == "stop"
    record = logged(settings)[body["id"]].generation()
    assert record.completion == choice["text"] and record.finish_reason == "stop"
    assert len(record.behaviour_logprobs) == len(record.completion_token_ids)
    assert post(client, seed=seed, stop=stop)["choices"][0]["text"] == choice["text"], "a string or a list"


def test_logprobs_are_the_logged_behaviour_logprobs(client: TestClient, settings: Settings) -> None:
    body = post(client, seed=3, logprobs=2)
    lp = body["choices"][0]["logprobs"]
    record = logged(settings)[body["id"]].generation()
    assert lp["token_logprobs"] == record.behaviour_logprobs
    assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(record.completion_token_ids)
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"])
    assert lp["text_offset"][0] == len(OK["prompt"])
    assert post(client, seed=3)["choices"][0]["logprobs"] is None
    assert post(client, seed=3, logprobs=0)["choices"][0]["logprobs"]["top_logprobs"] is None


def test_concurrent_requests_share_a_batch_and_get_what_they_would_alone(
    settings: Settings, tiny_model_dir: Path
) -> None:
    bodies: list[dict[str, Any]] = [{"prompt": p, "seed": i, "user": f"u{i}", "max_tokens": 6 + i}
              for i, p in enumerate(["def ", "x = ", "", "    for key, value in "])]  # fmt: skip
    # A long wait with max_batch=4: the four concurrent requests form one batch as soon as all are queued.
    with make_app(settings, tiny_model_dir, max_batch=4, max_batch_wait_s=60.0) as client:
        with ThreadPoolExecutor(4) as threads:
            together = list(threads.map(lambda b: client.post("/v1/completions", json=b).json(), bodies))
        metrics = client.get("/metrics").text
    assert "flywheel_serving_batch_size_count 1.0" in metrics and "flywheel_serving_batch_size_sum 4.0" in metrics
    policy = load_policy(tiny_model_dir)
    for body, got in zip(bodies, together, strict=True):
        alone = policy.generate(body["prompt"], body["max_tokens"], seed=body["seed"])
        assert got["choices"][0]["text"] == alone.completion
