"""Months-old product telemetry replayed through the Segment-compatible collector, two surfaces in one
deployment, and a backfill from the lake: one final reward per generation, counters that account for
every event, orphans counted and listed, and the trainer and dashboard reading only active versions."""

from __future__ import annotations

import base64
import time
from collections import Counter
from datetime import timedelta

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from deploy_gate.metrics import arm_metrics
from flywheel.bus import ensure_topics
from flywheel.bus.reader import read_topic
from flywheel.connections import redis_client
from flywheel.contract import Event, RewardRecord, utcnow
from flywheel.lake.tables import EVENTS, REWARDS
from flywheel.ops.http import ops_router
from flywheel.settings import Settings
from ingest.collector.app import create_app
from ingest.worker.loop import IngestWorker
from signals.config import SignalsConfig
from signals.definitions import DefinitionStore
from signals.orphans import orphan_feedback
from signals.recompute import backfill, recompute_records
from signals.reward import DEFAULT_DEFINITION, RewardDefinition, RuleWeights, builtin_definition
from signals.satisfaction import refit
from signals.sink import read_rewards, write_rewards
from signals.worker import SignalsWorker
from simulator.telemetry import (
    MISJUDGED_COEF,
    known_users,
    product_telemetry,
    segment_batches,
    send,
    write_events,
)

CONFIG = SignalsConfig(idle_after_s=1.5, poll_timeout_s=0.2)
AUTH = {"Authorization": "Basic " + base64.b64encode(b"dev-write-key:").decode()}


def realistic(settings: Settings) -> Settings:
    """The deployment's default window (16 minutes: covers the 15-minute retention check)."""
    return settings.model_copy(update={"reward_window_s": Settings.model_fields["reward_window_s"].default})


def streamed(settings: Settings) -> list[RewardRecord]:
    return [RewardRecord.model_validate_json(r.value) for r in read_topic(settings, settings.rewards_topic)]


def comparable(r: RewardRecord) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in r.model_dump(exclude={"emitted_at"}).items()))


def drain(worker: SignalsWorker, done, timeout_s: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"worker did not finish in {timeout_s}s: {worker.stats}"
        worker.run_once()
    for _ in range(3):
        worker.run_once()


def recompute_all(settings: Settings, store: DefinitionStore) -> list[RewardRecord]:
    return [
        r for surface in ("code-completion", "chat")
        for r in recompute_records(settings, store.active(surface), config=CONFIG)
    ]  # fmt: skip


def test_months_old_telemetry_through_the_collector_gives_one_final_reward_per_generation(
    settings: Settings,
) -> None:
    settings = realistic(settings)
    ensure_topics(settings)
    tel = product_telemetry(start=utcnow() - timedelta(days=90), seed=1, duplicate_share=0.03)
    assert tel.duplicates > 0 and tel.out_of_window > 0 and tel.orphan_ids
    with TestClient(create_app(settings)) as collector:
        for body in segment_batches(tel.events):
            r = collector.post("/v1/batch", json=body, headers=AUTH)
            assert r.status_code == 200 and r.json()["refused"] == [], r.text

    worker = SignalsWorker(settings, CONFIG)
    ingest = IngestWorker(settings)
    try:
        drain(worker, lambda: worker.stats.records >= len(tel.surfaces))
        deadline = time.monotonic() + 60
        unique = {e.event_id for e in tel.events}
        lake = EVENTS.read(EVENTS.at(settings.lake_root))
        while lake.height < len(unique) and time.monotonic() < deadline:
            ingest.run_once()
            lake = EVENTS.read(EVENTS.at(settings.lake_root))
    finally:
        ingest.close()
        worker.close()

    # every event lands once
    assert lake.height == len(unique) and lake["event_id"].n_unique() == len(unique)
    # every generation gets exactly one reward, its final one: no default followed by revisions
    records = streamed(settings)
    assert Counter(r.generation_id for r in records) == Counter(set(tel.surfaces))
    assert {r.revision for r in records} == {0} and read_rewards(REWARDS.at(settings.lake_root)).height == len(records)
    by_id = {r.generation_id: r for r in records}
    assert {r.reward_version for r in records} == {"rules-v1", "chat-rules-v1"}
    assert all(by_id[g].reward_version == builtin_definition(s).version for g, s in tel.surfaces.items())
    # accepted suggestions score above rejected ones
    accepted = [by_id[g].reward for g, d in tel.decisions.items() if d == "accepted"]
    rejected = [by_id[g].reward for g, d in tel.decisions.items() if d == "rejected"]
    assert accepted and rejected and min(accepted) > max(rejected)
    # the 10- and 15-minute retention checks are inside the window and count
    assert sum("retained_900s" in by_id[g].signals for g in tel.decisions) > 5
    # the counters account for every event sent
    s = worker.stats
    assert s.generations == len(tel.surfaces)
    assert s.duplicates == tel.duplicates and s.orphans == len(tel.orphan_ids)
    assert s.out_of_window == tel.out_of_window and s.late_events == 0 == s.revisions
    assert s.generations + s.on_time + s.out_of_window + s.late_events + s.orphans + s.duplicates + s.invalid == len(
        tel.events
    ), s
    # equal to the batch recompute over the lake
    store = DefinitionStore(settings, redis_client(settings))
    batch = recompute_all(settings, store)
    # the stream coalesces a micro-batch's late events into one revision: its records are the recompute's
    assert set(map(comparable, records)) <= set(map(comparable, batch))
    last = {(r.generation_id, r.reward_version): comparable(r) for r in sorted(records, key=lambda r: r.revision)}
    assert last == {(r.generation_id, r.reward_version): comparable(r) for r in sorted(batch, key=lambda r: r.revision)}

    # orphans are listed, and the counters are on /metrics
    listed = orphan_feedback(settings)
    assert sorted(listed["generation_id"].to_list()) == sorted(tel.orphan_ids)
    app = FastAPI()
    app.include_router(ops_router(worker.health))
    text = TestClient(app).get("/metrics").text
    for outcome in ("orphan", "out_of_window", "duplicate", "late", "on_time", "generation"):
        assert f'flywheel_signals_events_total{{outcome="{outcome}"}}' in text, outcome
    assert 'flywheel_signals_records_total{kind="revision"}' in text


def test_chat_thumbs_never_change_code_completion_rewards(settings: Settings) -> None:
    """Two surfaces through one deployment, chat scored by a model fitted on chat thumbs."""
    settings = realistic(settings)
    ensure_topics(settings)
    store = DefinitionStore(settings, redis_client(settings))
    users = known_users(600, seed=4, thumbs_share=1.0, coef=MISJUDGED_COEF, surface="chat")
    chat_rules = builtin_definition("chat")
    write_rewards(
        REWARDS.at(settings.lake_root),
        [chat_rules.record(u.gen, u.events, window_end_us=600_000_000) for u in users],
        "chat-labels",
    )
    fitted = refit(settings, SignalsConfig(min_labels=100), surface="chat")
    assert fitted.activated and store.active_version("code-completion") == "rules-v1", fitted

    tel = product_telemetry(start=utcnow() - timedelta(days=2), seed=2, per_user=4, orphans=0, duplicate_share=0)
    send(settings, tel.events)
    worker = SignalsWorker(settings, CONFIG)
    try:
        drain(worker, lambda: worker.stats.records >= len(tel.surfaces))
    finally:
        worker.close()
    records = {r.generation_id: r for r in streamed(settings)}
    code = {g for g, s in tel.surfaces.items() if s == "code-completion"}
    chat = set(tel.surfaces) - code
    assert {records[g].reward_version for g in chat} == {fitted.version}
    assert {records[g].reward_version for g in code} == {"rules-v1"}
    # each code suggestion's reward is what the rules give its own events, chat or no chat
    for g in code:
        own = [e for e in tel.events if e.generation_id == g and str(e.type) != "generation"]
        gen_event = next(e for e in tel.events if e.generation_id == g and str(e.type) == "generation")
        expected = _rules_record(gen_event, own, records[g].window_end)
        assert records[g].reward == expected.reward and records[g].signals == expected.signals


def _rules_record(gen_event: Event, own: list[Event], window_end) -> RewardRecord:  # noqa: ANN001
    from signals.events import FeedbackEvent, GenerationInfo, to_us

    return DEFAULT_DEFINITION.record(
        GenerationInfo.from_event(gen_event),
        [FeedbackEvent.from_event(e) for e in own],
        window_end_us=to_us(window_end),
    )


def test_backfilling_a_month_old_day_gives_one_record_per_generation_and_changes_nothing_until_activated(
    settings: Settings,
) -> None:
    settings = realistic(settings)
    store = DefinitionStore(settings, redis_client(settings))
    store.ensure_pointer()
    tel = product_telemetry(start=utcnow() - timedelta(days=30), seed=3, per_user=6)
    # as ingest writes them: the events topic, one partition, offsets in arrival order (first copy of each)
    seen: set[str] = set()
    firsts = [e for e in tel.events if not (e.event_id in seen or seen.add(e.event_id))]  # type: ignore[func-returns-value]
    write_events(settings, firsts, at=[(settings.events_topic, 0, i) for i in range(len(firsts))])

    experimental = RewardDefinition(version="rules-v2", weights=RuleWeights(reject=-0.5))
    store.put(experimental)
    written, present = backfill(settings, "rules-v2")
    code = sorted(g for g, s in tel.surfaces.items() if s == "code-completion")
    assert (written, present) == (len(code), 0)
    lake = read_rewards(REWARDS.at(settings.lake_root))
    assert sorted(lake["generation_id"].to_list()) == code and set(lake["revision"].to_list()) == {0}
    batch = recompute_records(settings, experimental, config=CONFIG, final_only=True)
    assert {r.generation_id: (r.reward, r.signals) for r in batch} == {
        r["generation_id"]: (r["reward"], __import__("json").loads(r["signals"])) for r in lake.iter_rows(named=True)
    }
    assert backfill(settings, "rules-v2") == (0, len(code)), "a second backfill writes nothing"

    # the dashboard and the trainer read the active versions, not the backfilled one ...
    before = arm_metrics(settings)
    assert before.reward_version == "chat-rules-v1,rules-v1" and before.arms == []
    assert _trainer_reads(settings) == "chat-rules-v1,rules-v1"
    # ... until someone activates it
    store.set_active("rules-v2")
    after = arm_metrics(settings)
    assert after.reward_version == "chat-rules-v1,rules-v2" and sum(a.n for a in after.arms) == len(code)
    assert _trainer_reads(settings) == "chat-rules-v1,rules-v2"


def _trainer_reads(settings: Settings) -> str | None:
    from trainer.config import TrainerConfig
    from trainer.data import load_selection

    selection = load_selection(
        settings, TrainerConfig(), watermark=None, quarantined=set(), encode_prompt=lambda s: [1]
    )
    return selection.window.reward_version if selection.window else _active(settings)


def _active(settings: Settings) -> str:
    from flywheel.reward_versions import describe, read_active

    return describe((read_active(settings.lake_dir) or {}).values())


def test_orphans_command_lists_feedback_without_a_generation(settings: Settings) -> None:
    import json

    from typer.testing import CliRunner

    from signals.cli import app

    now = utcnow()
    tel = product_telemetry(start=now - timedelta(days=1), seed=4, code_users=1, chat_users=1, per_user=2,
                            orphans=2, duplicate_share=0)  # fmt: skip
    write_events(settings, tel.events)
    result = CliRunner().invoke(app, ["orphans"], env={"FLYWHEEL_DATA_DIR": str(settings.data_dir)})
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert lines[0] == {"orphan_generations": 2, "orphan_events": 2}
    assert sorted(row["generation_id"] for row in lines[1:]) == sorted(tel.orphan_ids)
    assert all(row["types"] == ["accepted"] for row in lines[1:])


@pytest.mark.parametrize(
    "windows",
    [{"reward_window_s": 600.0},  # the old default: 10 minutes
     # the same window for code completion alone (per surface); other surfaces keep 16 minutes
     {"reward_window_s": 960.0, "reward_windows_s": {"code-completion": 600.0, "chat": 30.0}}],
    ids=["deployment", "per-surface"],
)  # fmt: skip
def test_a_window_shorter_than_the_latest_check_warns_and_counts_the_checks_out_of_window(
    settings: Settings, caplog, windows: dict[str, object]  # noqa: ANN001
) -> None:
    settings = settings.model_copy(update=windows)
    ensure_topics(settings)
    tel = product_telemetry(start=utcnow() - timedelta(days=3), seed=5, code_users=2, chat_users=0,
                            per_user=4, orphans=0, duplicate_share=0)  # fmt: skip
    send(settings, tel.events)
    gen_ts = {e.generation_id: e.ts for e in tel.events if str(e.type) == "generation"}
    past = [e for e in tel.events if str(e.type) != "generation" and e.ts > gen_ts[e.generation_id] + timedelta(
        seconds=600)]  # fmt: skip
    assert past and all(str(e.type) == "retained" for e in past)
    worker = SignalsWorker(settings, CONFIG)
    with caplog.at_level("WARNING", logger="signals.worker"):
        try:
            drain(worker, lambda: worker.stats.records >= len(tel.surfaces))
        finally:
            worker.close()
    assert "shorter than the latest checkpoint" in caplog.text
    assert worker.stats.out_of_window == len(past) and worker.stats.late_events == 0
    assert not any("retained_900s" in r.signals for r in streamed(settings))


def test_live_traffic_and_a_replay_of_history_together_agree_with_the_batch_recompute(settings: Settings) -> None:
    """Both lanes in the same partitions (live events with late and duplicate copies, and months-old
    history): the stream and the recompute over the lake give the same records."""
    from simulator.telemetry import history, lake_events_from_topic

    ensure_topics(settings)
    live = history(40, start=utcnow() - timedelta(minutes=30), seed=6, late_share=0.25,
                   window_s=settings.reward_window_s)  # fmt: skip
    old = product_telemetry(start=utcnow() - timedelta(days=60), seed=6, code_users=2, chat_users=2, per_user=3)
    mixed = [e for pair in zip(live.events, old.events, strict=False) for e in pair]
    mixed += live.events[len(old.events):] + old.events[len(live.events):]
    send(settings, mixed)
    worker = SignalsWorker(settings, CONFIG)
    try:
        drain(worker, lambda: worker.stats.records >= len(live.generation_ids) + len(old.surfaces))
    finally:
        worker.close()
    assert worker.stats.late_events > 0, "live late events make revisions"
    lake_events_from_topic(settings)
    store = DefinitionStore(settings, redis_client(settings))
    records = streamed(settings)
    batch = recompute_all(settings, store)
    # the stream coalesces a micro-batch's late events into one revision: its records are the recompute's
    assert set(map(comparable, records)) <= set(map(comparable, batch))
    last = {(r.generation_id, r.reward_version): comparable(r) for r in sorted(records, key=lambda r: r.revision)}
    assert last == {(r.generation_id, r.reward_version): comparable(r) for r in sorted(batch, key=lambda r: r.revision)}
