"""Simulated feedback in the lake: generation events and their rewards, for the trainer without the loop.

For tests, benchmarks and demos of the trainer alone: completions are sampled from a real
`Policy` (so the behaviour log-probs are real), rewards come from a function of the completion,
and both are written by the writers ingest and signals use (`simulator.telemetry.write_events`,
`signals.sink.write_rewards`), so the rows are exactly theirs (`flywheel.lake.tables`).
Generation events are signed with `settings.serving_key`, as serving signs its own, since they
stand for what serving logged.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from flywheel.contract import Event, EventType, GenerationRecord, RewardRecord
from flywheel.lake.tables import REWARDS
from flywheel.settings import Settings
from flywheel.signing import sign_generation
from signals.sink import write_rewards as write_lake_rewards
from simulator.telemetry import feedback_event, generation_event, write_events

if TYPE_CHECKING:  # the model stack (torch) is imported only by those who pass a policy
    from flywheel.lm import Generation, Policy


def write_rewards(settings: Settings, records: Sequence[RewardRecord]) -> None:
    """Write `records` to the lake's rewards table, in a file of their own."""
    write_lake_rewards(REWARDS.at(settings.lake_root), records, f"sim-{uuid.uuid4().hex[:8]}")


def consent_events(users: Sequence[str], consent: bool = True, prop: str = "training_consent") -> list[Event]:
    """One `shown` event per user stating their training consent (any event type may carry it)."""
    now = datetime.now(UTC)
    stated = {"properties": {prop: consent}}
    return [feedback_event(f"consent-{u}", EventType.SHOWN, now, user_id=u).model_copy(update=stated) for u in users]


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
        events.append(generation_event(gid, ts, user_id=user, record=record))
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
