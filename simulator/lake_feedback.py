"""Simulated feedback in the lake: generation events and rewards in the agreed column layout.

For tests, benchmarks and demos of the trainer without the rest of the loop: completions are
sampled from a real `Policy` (so the behaviour log-probs are real), rewards come from a
function of the completion, and both are written with `flywheel.lake` exactly as ingest and
signals write them (notes/interfaces.md, "Lake tables"). Generation events are signed with
`settings.serving_key`, as serving signs its own, since they stand for what serving logged.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta

import polars as pl

from flywheel import lake
from flywheel.contract import Event, EventType, GenerationRecord, RewardRecord
from flywheel.lm import Generation, Policy
from flywheel.settings import Settings
from flywheel.signing import sign_generation

EVENT_SCHEMA: dict[str, pl.DataType] = {
    "event_id": pl.String(), "type": pl.String(), "schema_version": pl.Int64(), "generation_id": pl.String(),
    "user_id": pl.String(), "session_id": pl.String(), "ts": pl.Datetime("us", "UTC"),
    "received_at": pl.Datetime("us", "UTC"), "source": pl.String(), "properties": pl.String(),
    "kafka_topic": pl.String(), "kafka_partition": pl.Int32(), "kafka_offset": pl.Int64(),
}  # fmt: skip


def events_frame(events: Sequence[Event]) -> pl.DataFrame:
    rows = [
        {**e.model_dump(exclude={"properties", "type"}), "type": str(e.type),
         "properties": json.dumps(e.properties), "kafka_topic": "simulated", "kafka_partition": 0,
         "kafka_offset": i}
        for i, e in enumerate(events)
    ]  # fmt: skip
    return pl.DataFrame(rows, schema=EVENT_SCHEMA)


def rewards_frame(records: Sequence[RewardRecord]) -> pl.DataFrame:
    rows = [{**r.model_dump(), "signals": json.dumps(r.signals)} for r in records]
    return pl.DataFrame(rows).with_columns(
        pl.col(c).dt.cast_time_unit("us").dt.convert_time_zone("UTC")
        for c in ("window_start", "window_end", "emitted_at")
    )


def write_events(settings: Settings, events: Sequence[Event]) -> None:
    lake.write_partitioned(events_frame(events), settings.lake_dir / "events", f"sim-{uuid.uuid4().hex[:8]}")


def write_rewards(settings: Settings, records: Sequence[RewardRecord]) -> None:
    lake.write_partitioned(
        rewards_frame(records),
        settings.lake_dir / "rewards",
        f"sim-{uuid.uuid4().hex[:8]}",
        ts_column="emitted_at",
    )


def consent_events(users: Sequence[str], consent: bool = True, prop: str = "training_consent") -> list[Event]:
    """One `shown` event per user stating their training consent (any event type may carry it)."""
    return [
        Event(type=EventType.SHOWN, generation_id=f"consent-{u}", user_id=u, properties={prop: consent})
        for u in users
    ]


def simulate_feedback(
    settings: Settings,
    policy: Policy,
    prompts: Sequence[str],
    reward: Callable[[Generation], float],
    *,
    model_version: str,
    n: int,
    seed: int = 0,
    max_tokens: int = 8,
    emitted_at: datetime | None = None,
    reward_version: str = "sim-v1",
    users: Sequence[str] = ("u0", "u1", "u2", "u3"),
) -> list[tuple[Generation, float]]:
    """Sample `n` completions, write their generation events and rewards; returns them."""
    emitted_at = emitted_at or datetime.now(UTC)
    ids = random.Random(seed)  # seeded ids: the trainer orders samples by id, so runs repeat exactly
    events, rewards, out = [], [], []
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        gen = policy.generate(prompt, max_tokens=max_tokens, temperature=1.0, seed=seed * 100_003 + i)
        gid = uuid.UUID(int=ids.getrandbits(128)).hex
        user = users[i % len(users)]
        record = GenerationRecord(
            prompt=prompt, prompt_token_ids=gen.prompt_token_ids, completion=gen.completion,
            completion_token_ids=gen.completion_token_ids, behaviour_logprobs=gen.logprobs,
            model_version=model_version, finish_reason=gen.finish_reason,
        )  # fmt: skip
        record.signature = sign_generation(settings.serving_key.get_secret_value(), gid, user, record)
        ts = emitted_at - timedelta(minutes=10)
        events.append(Event(type=EventType.GENERATION, generation_id=gid, user_id=user, ts=ts, received_at=ts,
                            source="serving", properties=record.model_dump()))  # fmt: skip
        r = reward(gen)
        rewards.append(RewardRecord(
            generation_id=gid, reward_version=reward_version, reward=r, confidence=1.0,
            label_source="explicit", user_id=user, model_version=model_version, window_start=ts,
            window_end=emitted_at, emitted_at=emitted_at,
        ))  # fmt: skip
        out.append((gen, r))
    write_events(settings, events)
    write_rewards(settings, rewards)
    return out
