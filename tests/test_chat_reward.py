"""The learned chat reward: fitted on explicit reactions, applied to follow-ups with none, activated only when
it beats the active version; the sycophancy check; a conversation export replayed exactly once.

Real parts: the reward definitions store (Redis and the lake), MLflow, the collector, the broker, the ingest
worker and the batch recompute. The chat users are simulated (simulator/chat_users.py), seeded."""

from __future__ import annotations

import base64
import json
import time
from collections import Counter
from datetime import timedelta

import numpy as np
import polars as pl
import pytest
from fastapi.testclient import TestClient

from flywheel.bus import ensure_topics
from flywheel.connections import redis_client
from flywheel.contract import Event, utcnow
from flywheel.lake.tables import EVENTS
from flywheel.settings import Settings
from flywheel.sycophancy import ArmReply, arm_replies, sycophancy_check
from ingest.collector.app import create_app
from ingest.conversations import InvalidExport, conversation_events
from ingest.worker.loop import IngestWorker
from signals.chat_reward import (
    experiment_sycophancy,
    fit_chat_reward,
    implicit_proba,
    reactions_from_lake,
    refit_chat,
)
from signals.columns import FEEDBACK_SCHEMA, GENERATION_SCHEMA, score_frame
from signals.config import SignalsConfig
from signals.definitions import DefinitionStore
from signals.logistic import roc_auc
from signals.recompute import recompute_records
from signals.reward import RewardDefinition, builtin_definition
from signals.satisfaction import refit as satisfaction_refit
from signals.text_features import TextModel
from simulator.chat_users import ChatPopulation
from simulator.telemetry import write_events

CHAT = builtin_definition("chat")
CONFIG = SignalsConfig(min_labels=100, bootstrap_samples=200, idle_after_s=1.5, poll_timeout_s=0.2)
AUTH = {"Authorization": "Basic " + base64.b64encode(b"dev-write-key:").decode()}


def test_fitted_on_reactions_it_ranks_held_out_approved_replies_above_disapproved_from_their_follow_ups() -> None:
    items = ChatPopulation(users=60, seed=1).reacted()
    fit = fit_chat_reward(items, CHAT)
    assert fit.n_test > 40 and set(fit.test_labels) == {0.0, 1.0}
    # held-out conversations, scored with their thumbs removed: as a reply nobody reacted to is scored
    assert roc_auc(fit.test_labels, fit.test_proba) > 0.85
    rules = np.array([implicit_proba(CHAT, i) for i in fit.test_items])
    assert roc_auc(fit.test_labels, fit.test_proba) > roc_auc(fit.test_labels, rules)
    # the same reply scores the same with or without its vote: the vote is a label, never an input here
    some = fit.test_items[0]
    d = fit.definition
    with_vote = d.score_implicit(d.extract(some.generation, some.events, 2**62)).reward
    assert with_vote == d.score_implicit(d.extract(some.generation, some.unreacted(), 2**62)).reward
    # pinned: the stored spec scores exactly as the fitted definition
    again = RewardDefinition.from_spec(d.to_spec())
    assert again == d and [implicit_proba(again, i) for i in fit.test_items] == list(fit.test_proba)


def test_a_refit_that_does_not_beat_the_active_version_is_not_activated_and_says_why(settings: Settings) -> None:
    store = DefinitionStore(settings, redis_client(settings))
    few = refit_chat(settings, CONFIG, items=ChatPopulation(users=3, seed=2).reacted())
    assert not few.activated and "need at least 20" in few.reason and store.active_version("chat") == CHAT.version

    items = ChatPopulation(users=60, seed=1).reacted()
    first = refit_chat(settings, CONFIG, items=items)
    assert first.activated, first.reason
    assert store.active_version("chat") == first.version and first.active_version == CHAT.version
    # the same reactions again: no better than the version now active, so it stays, and the reason says so
    second = refit_chat(settings, CONFIG, items=items)
    assert not second.activated
    assert second.active_version == first.version and store.active_version("chat") == first.version
    assert f"does not beat the active {first.version}" in second.reason and "AUC gain" in second.reason
    assert second.version in store.versions()  # stored all the same, for the record


def test_few_reactions_on_a_new_surface_start_from_the_chat_model() -> None:
    chat = [i for i in ChatPopulation(users=60, seed=1).reacted() if i.label is not None and i.followup is not None]
    general = TextModel.fit([i.followup or "" for i in chat], [i.label for i in chat], l2=0.3)
    new = [i for i in ChatPopulation(users=4, seed=5).reacted() if i.label is not None and i.followup is not None]
    held = [i for i in ChatPopulation(users=30, seed=6).reacted() if i.label is not None and i.followup is not None]
    texts, labels = [i.followup or "" for i in new], [i.label for i in new]
    y = [i.label for i in held]
    alone = TextModel.fit(texts, labels, l2=0.3).predict([i.followup or "" for i in held])
    primed = TextModel.fit(texts, labels, prior=general, l2=0.3).predict([i.followup or "" for i in held])
    assert roc_auc(np.array(y), primed) > roc_auc(np.array(y), alone) + 0.05


def _arm(population: ChatPopulation, style: str, quality_shift: float = 0.0) -> list[ArmReply]:
    return [
        ArmReply(item.generation.user_id, reply, item.label)
        for item, reply in population.replies(style=style, quality_shift=quality_shift)
    ]


def test_the_sycophancy_check_trips_on_a_candidate_that_only_lengthens_and_flatters() -> None:
    champion = _arm(ChatPopulation(seed=3), "plain")
    # the same users, the same satisfaction and votes: only the replies' style changed
    flatterer = sycophancy_check(champion, _arm(ChatPopulation(seed=3), "sycophantic"))
    assert flatterer.flagged
    assert "length" in flatterer.reasons[0] and "without more explicit approval" in flatterer.reasons[0]
    assert flatterer.shifts["flattery"].low > 0.02 and flatterer.shifts["agreement"].low > 0.02
    # another draw of the champion's own style is not flagged
    assert not sycophancy_check(champion, _arm(ChatPopulation(seed=4), "plain")).flagged
    # longer replies that users do approve of more are not sycophancy
    better = sycophancy_check(champion, _arm(ChatPopulation(seed=3), "sycophantic", quality_shift=1.5))
    assert not better.flagged and "with more explicit approval" in better.reasons[0]
    # a learned reward that rises while the thumbs do not is flagged too
    rewarded = [ArmReply(r.user_id, r.text, r.thumbs_up, 0.9) for r in champion]
    base = [ArmReply(r.user_id, r.text, r.thumbs_up, 0.1) for r in champion]
    assert sycophancy_check(base, rewarded).flagged


def _export(start: object) -> list[dict[str, object]]:
    at = lambda s: (start + timedelta(seconds=s)).isoformat()  # type: ignore[operator]  # noqa: E731
    convs = []
    for c in range(3):
        turns: list[dict[str, object]] = []
        for k in range(3):
            t = 100 * k
            turns.append({"role": "user", "text": f"question {k} of conversation {c}", "ts": at(t)})
            vote = {"type": "thumbs", "value": "up" if (c + k) % 2 else "down", "ts": at(t + 20)}
            reactions = [vote] if k < 2 else []
            turns.append({"role": "assistant", "text": f"answer {k}", "ts": at(t + 2), "reactions": reactions})
        turns.append({"role": "user", "text": "thanks, that worked", "ts": at(300)})
        convs.append({"conversation_id": f"conv-{c}", "user_id": f"user-{c}", "model_version": "acme-chat",
                      "turns": turns})  # fmt: skip
    return convs


def test_a_conversation_export_replays_once_as_text_only_chat_generations_one_record_each(settings: Settings) -> None:
    settings = settings.model_copy(update={"reward_windows_s": {"chat": 300.0}})  # follow-ups come 98 s after
    ensure_topics(settings)
    events = conversation_events(_export(utcnow() - timedelta(days=2)))
    generations = {e.generation_id for e in events if e.type == "generation"}
    assert len(generations) == 9 and all(e.generation().text_only for e in events if e.type == "generation")
    body = {"events": [e.model_dump(mode="json", exclude={"received_at"}) for e in events]}
    with TestClient(create_app(settings)) as collector:
        for _ in range(2):  # replayed twice, as an operator retrying an import would
            r = collector.post("/v1/events", json=body, headers=AUTH)
            assert r.status_code == 200 and r.json()["refused"] == [], r.text
    ingest = IngestWorker(settings)
    try:
        deadline = time.monotonic() + 60
        lake = EVENTS.read(EVENTS.at(settings.lake_root))
        while lake.height < len(events) and time.monotonic() < deadline:
            ingest.run_once()
            lake = EVENTS.read(EVENTS.at(settings.lake_root))
        for _ in range(3):
            ingest.run_once()
        lake = EVENTS.read(EVENTS.at(settings.lake_root))
    finally:
        ingest.close()
    assert lake.height == len(events) and lake["event_id"].n_unique() == len(events), "every event lands once"
    store = DefinitionStore(settings, redis_client(settings))
    records = recompute_records(settings, store.active("chat"), config=CONFIG)
    assert Counter(r.generation_id for r in records) == Counter(generations), "one record per generation"
    by_id = {r.generation_id: r for r in records}
    assert {r.reward_version for r in records} == {CHAT.version}
    assert by_id["conv-0-t1"].label_source == "explicit" and by_id["conv-0-t1"].reward == -1.0
    assert by_id["conv-1-t1"].reward == 1.0 and by_id["conv-0-t5"].label_source == "implicit"
    assert by_id["conv-0-t5"].signals["followup_sentiment"] > 0  # "thanks, that worked"


def test_the_stream_and_batch_columns_score_a_learned_definition_as_the_reference_does() -> None:
    items = ChatPopulation(users=60, seed=1).reacted()
    definition = fit_chat_reward(items, CHAT).definition
    cases = [(i.generation, i.unreacted()) for i in ChatPopulation(users=8, seed=9).reacted()]
    gens = pl.DataFrame(
        [{"generation_id": g.generation_id, "revision": 0, "finish_reason": g.finish_reason,
          "completion_chars": g.completion_chars} for g, _ in cases], schema=GENERATION_SCHEMA,
    )  # fmt: skip
    feedback = pl.DataFrame(
        [{"generation_id": g.generation_id, "revision": 0, "event_id": e.event_id, "type": e.type, "ts_us": e.ts_us,
          "properties": json.dumps(dict(e.properties))} for g, evs in cases for e in evs], schema=FEEDBACK_SCHEMA,
    )  # fmt: skip
    scored = {r["generation_id"]: r for r in score_frame(definition, gens, feedback).iter_rows(named=True)}
    assert any(e.type == "followup" for _, evs in cases for e in evs)
    for gen, events in cases:
        want = definition.score(gen, events)
        row = scored[gen.generation_id]
        assert row["reward"] == want.reward and row["followup_sentiment"] == want.signals.get("followup_sentiment")


def write_chat(settings: Settings, population: ChatPopulation, *, style: str = "plain", arm: str = "") -> None:
    """The population's replies in the lake's events table, as the events topic's rows (the recompute reads them):
    text-only chat generations (of `arm` of experiment e1 when given), one session per user."""
    start = utcnow() - timedelta(days=1)
    events = []
    for item, reply in population.replies(style=style):
        g, at = item.generation, lambda us: start + timedelta(microseconds=us)
        gid = f"{arm}{g.generation_id}"
        props = {"surface": "chat", "prompt": "help me", "completion": reply, "model_version": arm or "acme-chat"}
        if arm:
            props.update(arm=arm, experiment="e1")
        events.append(Event(event_id=f"{gid}-gen", type="generation", generation_id=gid, user_id=g.user_id,
                            session_id=item.group, ts=at(g.ts_us), properties=props))  # fmt: skip
        events += [
            Event(event_id=f"{arm}{e.event_id}", type=e.type, generation_id=gid, user_id=g.user_id,  # type: ignore[arg-type]
                  session_id=item.group, ts=at(e.ts_us), properties=dict(e.properties))
            for e in item.events
        ]  # fmt: skip
    partition = 1 if arm == "challenger" else 0  # each writer its own Kafka positions
    write_events(settings, events, at=[(settings.events_topic, partition, i) for i in range(len(events))])


def test_the_refit_reads_a_surfaces_reactions_from_the_lake_and_holds_out_whole_conversations(
    settings: Settings,
) -> None:
    write_chat(settings, ChatPopulation(users=60, seed=1))
    settings = settings.model_copy(update={"reward_windows_s": {"chat": 300.0}})
    items = reactions_from_lake(settings, "chat")
    assert len(items) == 600 and {i.group for i in items} == {f"chat-user-{u}" for u in range(60)}
    assert reactions_from_lake(settings, "code-completion") == []
    result = refit_chat(settings, CONFIG)
    assert result.activated, result.reason
    fit = fit_chat_reward(items, CHAT)
    held = {i.group for i in fit.test_items}
    trained = {i.group for i in items if i.label is not None and i not in fit.test_items}
    assert held and trained and not held & trained, "no conversation on both sides"


def test_the_rollout_can_check_an_experiment_from_the_lakes_rows() -> None:
    """What the rollout reads (event rows with their arm, reply and votes) is enough to flag a flatterer."""
    rows = []
    for arm, style, seed in (("champion", "plain", 3), ("challenger", "sycophantic", 4)):
        for item, reply in ChatPopulation(seed=seed).replies(style=style):
            g = item.generation
            props = {"surface": "chat", "arm": arm, "experiment": "e1", "completion": reply}
            rows.append(("generation", g.generation_id, g.user_id, g.ts_us, json.dumps(props)))
            rows += [(e.type, g.generation_id, g.user_id, e.ts_us, json.dumps(dict(e.properties))) for e in item.events]
    frame = pl.DataFrame(rows, orient="row", schema=["type", "generation_id", "user_id", "ts", "properties"])
    arms = arm_replies(frame, experiment="e1")
    assert sorted(arms) == ["challenger", "champion"] and len(arms["champion"]) == 400
    assert sycophancy_check(arms["champion"], arms["challenger"]).flagged
    assert arm_replies(frame, experiment="other") == {}


def test_an_export_that_cannot_be_read_says_which_conversation_and_why() -> None:
    good_turns = [{"role": "assistant", "text": "hi", "ts": "2026-01-01T00:00:00Z"}]
    with pytest.raises(InvalidExport, match="conversation #0: conversation_id and user_id are required"):
        conversation_events([{"user_id": "u", "turns": good_turns}])
    bad_time = [{"role": "assistant", "text": "hi", "ts": "yesterday"}]
    with pytest.raises(InvalidExport, match="conversation c turn 0: ts 'yesterday'"):
        conversation_events([{"conversation_id": "c", "user_id": "u", "turns": bad_time}])
    bad_vote = [{**good_turns[0], "reactions": [{"type": "rating", "value": 9}]}]
    with pytest.raises(InvalidExport, match="reaction 0: a rating is 1-5"):
        conversation_events([{"conversation_id": "c", "user_id": "u", "turns": bad_vote}])
    middling = [{**good_turns[0], "reactions": [{"type": "rating", "value": 3}]}]
    assert [e.type for e in conversation_events([{"conversation_id": "c", "user_id": "u", "turns": middling}])] == [
        "generation"
    ]


def test_an_experiments_challenger_that_flatters_is_flagged_from_the_lake(settings: Settings) -> None:
    write_chat(settings, ChatPopulation(seed=3), arm="champion")
    write_chat(settings, ChatPopulation(seed=4), style="sycophantic", arm="challenger")
    check = experiment_sycophancy(settings, experiment="e1")
    assert check.flagged and "without more explicit approval" in check.reasons[0], check.reasons
    assert not experiment_sycophancy(settings, experiment="another").flagged


def test_the_satisfaction_refit_of_chat_learns_the_follow_up_from_reactions_in_the_lake(settings: Settings) -> None:
    """`flywheel signals refit --surface chat` and the worker's scheduled refit both go through `refit`."""
    write_chat(settings, ChatPopulation(users=60, seed=1))
    settings = settings.model_copy(update={"reward_windows_s": {"chat": 300.0}})
    result = satisfaction_refit(settings, CONFIG, surface="chat")
    assert result.activated and result.version is not None and result.version.startswith("text-chat-"), result
    store = DefinitionStore(settings, redis_client(settings))
    assert store.active_version("chat") == result.version and store.get(result.version).followup_model is not None
    assert store.active_version("code-completion") == "rules-v1"
