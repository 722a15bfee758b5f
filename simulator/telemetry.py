"""Synthetic events: the one place simulators build them, send them and put them in the lake.

`generation_event` and `feedback_event` build events as serving and a product would
(`simulator.lake_feedback` writes them for the trainer; the simulated users of `simulator.product`
send theirs as Segment calls over HTTP); `history` builds a reproducible event history (late and
duplicated events included) in the order a broker would receive it; `send` puts events on the
events topic; `write_events` writes events to the lake's events table through ingest's own writer;
`lake_events_from_topic` plays ingest: it reads the topic back and writes the table (first copy of each event id kept),
so the batch recompute can run over exactly what the stream saw.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

import polars as pl

from flywheel.bus import Outgoing, make_producer
from flywheel.bus.reader import read_topic
from flywheel.contract import Event, EventType, GenerationRecord
from flywheel.lake.tables import EVENTS, events_frame
from flywheel.settings import Settings
from flywheel.signing import sign_generation
from ingest.worker.lake_sink import write_events as write_lake_events
from signals.events import FeedbackEvent, GenerationInfo

Arm = Literal["champion", "challenger"]


def generation_event(
    gid: str,
    ts: datetime,
    *,
    user_id: str = "u1",
    model_version: str = "1",
    arm: Arm = "champion",
    completion: str = "return x + 1\n",
    received_at: datetime | None = None,
    experiment: str = "default",
    record: GenerationRecord | None = None,
    signing_key: str | None = None,
) -> Event:
    """A `generation` event as serving logs it; `record` (a real sample) replaces the made-up one, whose
    completion is `completion` (empty: declined) from `model_version` on `arm`. With `signing_key` (serving's
    key) the record is signed as serving signs it, so the trainer may learn from it."""
    declined = completion == ""
    rec = record or GenerationRecord(
        prompt="def f(x):\n    ",
        prompt_token_ids=[1, 2, 3],
        completion=completion,
        completion_token_ids=[] if declined else [4, 5],
        behaviour_logprobs=[] if declined else [-0.5, -0.7],
        model_version=model_version,
        arm=arm,
        experiment=experiment,
        finish_reason="declined" if declined else "stop",
    )
    if signing_key is not None:
        rec = rec.model_copy(update={"signature": sign_generation(signing_key, gid, user_id, rec)})
    return Event(
        type=EventType.GENERATION,
        generation_id=gid,
        user_id=user_id,
        ts=ts,
        received_at=received_at or ts,
        source="serving",
        properties=rec.model_dump(),
    )


def feedback_event(
    gid: str,
    type_: EventType | str,
    ts: datetime,
    *,
    user_id: str = "u1",
    received_at: datetime | None = None,
    source: str = "native",
    **properties: object,
) -> Event:
    """A product's event about generation `gid` (`properties` as the contract names them)."""
    return Event(
        type=EventType(type_),
        generation_id=gid,
        user_id=user_id,
        ts=ts,
        received_at=received_at or ts,
        source=source,
        properties=properties,
    )


def _user_reaction(rng: random.Random, gid: str, t0: datetime, user: str) -> list[Event]:
    """A plausible reaction: shown, then accept (maybe partial, undone, retained, edited) or reject/ignore."""

    def at(s: float) -> datetime:
        return t0 + timedelta(seconds=s)

    out = [feedback_event(gid, "shown", at(0.05), user_id=user)]
    roll = rng.random()
    if roll < 0.5:
        out.append(
            feedback_event(
                gid, "accepted", at(0.3), user_id=user, accepted_chars=rng.randint(3, 13), total_chars=13
            )
        )
        if rng.random() < 0.2:
            out.append(feedback_event(gid, "undone", at(0.8), user_id=user, seconds_after_accept=0.5))
        else:
            out.append(
                feedback_event(
                    gid,
                    "retained",
                    at(1.2),
                    user_id=user,
                    seconds_after_accept=0.9,
                    fraction_present=round(rng.random(), 3),
                )
            )
        if rng.random() < 0.3:
            out.append(feedback_event(gid, "edited", at(1.0), user_id=user, edit_distance=rng.randint(1, 8)))
    elif roll < 0.8:
        out.append(feedback_event(gid, "rejected", at(0.4), user_id=user))
    else:
        out.append(feedback_event(gid, "ignored", at(0.9), user_id=user))
    if rng.random() < 0.25:
        up = rng.random() < 0.6
        out.append(
            feedback_event(
                gid,
                "thumbs",
                at(1.5),
                user_id=user,
                value="up" if up else "down",
                comment=rng.choice(["", "great, thanks", "wrong"]),
            )
        )
    if rng.random() < 0.15:
        out.append(
            feedback_event(
                gid,
                "followup",
                at(1.6),
                user_id=user,
                text=rng.choice(["thanks that works", "no, that is broken", "ok"]),
            )
        )
    if rng.random() < 0.1:
        out.append(feedback_event(gid, rng.choice(["copied", "regenerated"]), at(1.7), user_id=user))
    return out


@dataclass(frozen=True)
class History:
    events: list[Event]  # in send order (duplicates included)
    generation_ids: list[str]


def history(
    n_generations: int,
    *,
    start: datetime,
    seed: int = 0,
    spacing_s: float = 0.25,
    late_share: float = 0.1,
    duplicate_share: float = 0.05,
    declined_share: float = 0.1,
    silent_share: float = 0.1,
    window_s: float = 2.0,
    arms: Sequence[Arm] = ("champion", "challenger"),
    prefix: str = "g",
    signing_key: str | None = None,
) -> History:
    """Generations every `spacing_s` from `start`, each with a user's reaction.

    Events arrive at their event time, except `late_share` of generations get one
    in-window event that arrives `5 * window_s` late, and `duplicate_share` of all
    events are sent twice (the copy a little later). Some generations are declined
    (empty completion, never shown) or get no feedback at all.
    """
    rng = random.Random(seed)
    timed: list[tuple[datetime, int, Event]] = []
    gids = []
    seq = 0
    for i in range(n_generations):
        gid = f"{prefix}{i:06d}"
        gids.append(gid)
        t0 = start + timedelta(seconds=i * spacing_s)
        user = f"user{rng.randrange(max(2, n_generations // 4))}"
        arm = rng.choice(list(arms))
        version = "2" if arm == "challenger" else "1"
        roll = rng.random()
        declined = roll < declined_share
        evs = [
            generation_event(
                gid,
                t0,
                user_id=user,
                model_version=version,
                arm=arm,
                completion="" if declined else "return x + 1\n",
                signing_key=signing_key,
            )
        ]
        if not declined and roll >= declined_share + silent_share:
            evs += _user_reaction(rng, gid, t0, user)
        if len(evs) > 1 and rng.random() < late_share:
            late = evs.pop(rng.randrange(1, len(evs)))
            evs.append(late.model_copy(update={"received_at": late.ts + timedelta(seconds=5 * window_s)}))
        for e in evs:
            seq += 1
            timed.append((e.received_at, seq, e))
            if rng.random() < duplicate_share:
                seq += 1
                timed.append((e.received_at + timedelta(seconds=rng.uniform(0.1, 3 * window_s)), seq, e))
    timed.sort(key=lambda x: (x[0], x[1]))
    return History([e for _, _, e in timed], gids)


def send(settings: Settings, events: Iterable[Event]) -> None:
    """Put events on the events topic, keyed by generation id (as serving and the collector do)."""
    producer = make_producer(settings)
    try:
        producer.send_all(
            [Outgoing(settings.events_topic, e.to_bytes(), e.generation_id.encode()) for e in events],
            timeout_s=30,
        )
    finally:
        producer.close()


# Where `write_events` places events without a Kafka position: a topic no deployment reads from, so
# the batch recompute (which reads only the events topic's rows) leaves them alone.
SIMULATED_TOPIC = "simulated"


def write_events(
    settings: Settings, events: Sequence[Event], *, at: Sequence[tuple[str, int, int]] | None = None
) -> pl.DataFrame:
    """Write `events` to the lake's events table with ingest's writer; returns the rows written.

    `at`: each event's Kafka (topic, partition, offset); by default partition 0 of `SIMULATED_TOPIC`,
    offsets in order.
    """
    positions = at if at is not None else [(SIMULATED_TOPIC, 0, i) for i in range(len(events))]
    df = events_frame((e, *pos) for e, pos in zip(events, positions, strict=True))
    write_lake_events(EVENTS.at(settings.lake_root), df)
    return df


def lake_events_from_topic(settings: Settings, *, write: bool = True) -> pl.DataFrame:
    """Read the events topic (no consumer group), write it to the lake; first copy of each id kept."""
    events: list[Event] = []
    positions: list[tuple[str, int, int]] = []
    seen: set[str] = set()
    for r in read_topic(settings, settings.events_topic):
        e = Event.from_bytes(r.value)
        if e.event_id not in seen:
            seen.add(e.event_id)
            events.append(e)
            positions.append((r.topic, r.partition, r.offset))
    if write:
        return write_events(settings, events, at=positions)
    return events_frame((e, *pos) for e, pos in zip(events, positions, strict=True))


# ---------------------------------------------------------------- users whose satisfaction is known

# The true model of the synthetic users: logit P(satisfied) = TRUE_INTERCEPT + sum coef * signal.
TRUE_INTERCEPT = -0.4
TRUE_COEF = {
    "accepted": 1.2,
    "accepted_fraction": 1.0,
    "rejected": -1.0,
    "undone": -2.0,
    "edit_ratio": -1.5,
    "retention": 1.6,
    "followup_sentiment": 1.2,
    "copied": 0.8,
    "regenerated": -1.2,
}


# Users the rules misjudge: accepting says little (they accept, then rewrite it), what they copy and
# say next says a lot. A satisfaction model fitted on their thumbs beats the rules by far.
MISJUDGED_COEF = {
    "accepted": -0.8,
    "accepted_fraction": -0.4,
    "rejected": 0.6,
    "retention": 0.3,
    "followup_sentiment": 2.5,
    "copied": 2.5,
    "regenerated": -2.0,
}


@dataclass(frozen=True)
class KnownUser:
    generation_id: str
    signals: dict[str, float]
    true_p: float  # P(satisfied) the user really had
    satisfied: bool
    thumbs: bool  # whether this user also gave a thumbs vote (= satisfied)
    events: list[FeedbackEvent]
    gen: GenerationInfo


def known_users(
    n: int,
    *,
    seed: int = 0,
    thumbs_share: float = 0.4,
    coef: Mapping[str, float] | None = None,
    surface: str = "code-completion",
) -> list[KnownUser]:
    """Users who react with implicit signals, are satisfied with a known probability (logit
    `TRUE_INTERCEPT + sum coef * signal`, `coef` default `TRUE_COEF`), and sometimes vote."""
    coef = TRUE_COEF if coef is None else coef
    from signals.reward import builtin_definition

    rng = random.Random(seed)
    s = 1_000_000
    out = []
    for i in range(n):
        gid = f"k{seed}-{i:06d}"
        gen = GenerationInfo(gid, ts_us=0, user_id=f"u{i % 97}", completion_chars=20, surface=surface)
        evs = [FeedbackEvent(f"{gid}-shown", "shown", s // 10)]
        r = rng.random()
        if r < 0.55:
            evs.append(
                FeedbackEvent(
                    f"{gid}-acc", "accepted", s, {"accepted_chars": rng.randint(4, 20), "total_chars": 20}
                )
            )
            if rng.random() < 0.15:
                evs.append(FeedbackEvent(f"{gid}-undo", "undone", 2 * s, {"seconds_after_accept": 1.0}))
            elif rng.random() < 0.7:
                evs.append(
                    FeedbackEvent(
                        f"{gid}-ret",
                        "retained",
                        31 * s,
                        {"seconds_after_accept": 30, "fraction_present": rng.random()},
                    )
                )
            if rng.random() < 0.3:
                evs.append(
                    FeedbackEvent(f"{gid}-edit", "edited", 5 * s, {"edit_distance": rng.randint(1, 10)})
                )
        else:
            evs.append(FeedbackEvent(f"{gid}-dec", "rejected" if r < 0.85 else "ignored", s))
        if rng.random() < 0.3:
            text = rng.choice(["thanks, works great", "that is wrong", "ok next", "perfect", "broken again"])
            evs.append(FeedbackEvent(f"{gid}-fu", "followup", 40 * s, {"text": text}))
        for kind in ("copied", "regenerated"):
            if rng.random() < 0.1:
                evs.append(FeedbackEvent(f"{gid}-{kind}", kind, 3 * s))
        signals = builtin_definition(surface).extract(gen, evs, 600 * s)
        logit = TRUE_INTERCEPT + sum(
            c * signals.get(k, 0.5 if k == "retention" else 0.0) for k, c in coef.items()
        )
        true_p = 1.0 / (1.0 + math.exp(-logit))
        satisfied = rng.random() < true_p
        thumbs = rng.random() < thumbs_share
        if thumbs:
            evs.append(
                FeedbackEvent(f"{gid}-thumbs", "thumbs", 50 * s, {"value": "up" if satisfied else "down"})
            )
        out.append(KnownUser(gid, signals, true_p, satisfied, thumbs, evs, gen))
    return out


# ---------------------------------------------------------------- product telemetry, as products send it

# When a code-completion product checks how much of an accepted suggestion is still there (seconds after the
# accept): from 15 s to 15 minutes, as in published studies of completion retention.
RETENTION_CHECKS_S: tuple[int, ...] = (15, 30, 120, 300, 600, 900)


@dataclass(frozen=True)
class Telemetry:
    events: list[Event]  # in event-time order (duplicates included, right after their original)
    surfaces: dict[str, str]  # generation id -> surface, for every generation event
    decisions: dict[str, str]  # code-completion generation id -> accepted | rejected | ignored
    orphan_ids: list[str]  # generation ids that get feedback but no generation event
    out_of_window: int  # feedback events deliberately timed after their generation's window
    duplicates: int  # events sent twice


def product_telemetry(
    *,
    start: datetime,
    code_users: int = 6,
    chat_users: int = 4,
    per_user: int = 8,
    seed: int = 0,
    spacing_s: float = 45.0,
    window_s: float = 960.0,
    orphans: int = 3,
    duplicate_share: float = 0.02,
) -> Telemetry:
    """Code-completion and chat users as their products would report them, from `start` on.

    Code completion (`surface` code-completion): each suggestion is shown, then accepted (some
    partially, some undone within seconds, some edited), rejected or ignored; an accepted one that is
    kept gets retention checks at `RETENTION_CHECKS_S` after the accept, the fraction still present
    falling with time. Chat (`surface` chat): each reply may get a thumbs vote (with a comment now and
    then), a follow-up message, a copy or a regenerate; each chat user's second reply gets its
    follow-up hours later, past the `window_s` window. Generations of one user are `spacing_s`
    apart. `orphans` generation ids get feedback and no generation event; `duplicate_share` of
    events are sent twice (a client retry).
    """
    rng = random.Random(seed)
    events: list[Event] = []
    surfaces: dict[str, str] = {}
    decisions: dict[str, str] = {}
    out_of_window = 0

    def at(t0: datetime, s: float) -> datetime:
        return t0 + timedelta(seconds=s)

    for u in range(code_users):
        user = f"coder{u}"
        for k in range(per_user):
            gid = f"cc-{seed}-{u}-{k}"
            t0 = start + timedelta(seconds=(u * per_user + k) * spacing_s + rng.uniform(0, 1))
            surfaces[gid] = "code-completion"
            events.append(_generation(gid, t0, user, "code-completion", "    return sorted(items)\n"))
            events.append(feedback_event(gid, "shown", at(t0, 0.05), user_id=user))
            roll = rng.random()
            decide = at(t0, rng.uniform(0.3, 4.0))
            if roll < 0.55:
                decisions[gid] = "accepted"
                total = 26
                part = total if rng.random() < 0.7 else rng.randint(8, 25)
                events.append(feedback_event(gid, "accepted", decide, user_id=user, accepted_chars=part,
                                             total_chars=total))  # fmt: skip
                if rng.random() < 0.15:
                    events.append(
                        feedback_event(gid, "undone", at(decide, 3.0), user_id=user, seconds_after_accept=3.0)
                    )
                    continue
                if rng.random() < 0.3:
                    events.append(feedback_event(gid, "edited", at(decide, 8.0), user_id=user,
                                                 edit_distance=rng.randint(1, 10)))  # fmt: skip
                present = 1.0
                for check in RETENTION_CHECKS_S:
                    present = max(0.0, present - rng.choice([0.0, 0.0, 0.1, 0.3]))
                    fraction = round(present, 2)
                    events.append(feedback_event(gid, "retained", at(decide, check), user_id=user,
                                                 seconds_after_accept=check, fraction_present=fraction))  # fmt: skip
            elif roll < 0.85:
                decisions[gid] = "rejected"
                events.append(feedback_event(gid, "rejected", decide, user_id=user))
            else:
                decisions[gid] = "ignored"
                events.append(feedback_event(gid, "ignored", decide, user_id=user))

    comments = ["", "", "great, exactly right", "wrong answer", "thanks"]
    followups = ["thanks, that works", "no, that is broken", "can you explain more?", "perfect"]
    for u in range(chat_users):
        user = f"chatter{u}"
        for k in range(per_user):
            gid = f"chat-{seed}-{u}-{k}"
            t0 = start + timedelta(seconds=(u * per_user + k) * spacing_s + rng.uniform(0, 1))
            surfaces[gid] = "chat"
            events.append(_generation(gid, t0, user, "chat", "Sort the list with sorted(items)."))
            if rng.random() < 0.5:
                value, comment = rng.choice(["up", "up", "down"]), rng.choice(comments)
                events.append(feedback_event(gid, "thumbs", at(t0, rng.uniform(5, 60)), user_id=user,
                                             value=value, comment=comment))  # fmt: skip
            late = k == 1  # each chat user's second reply gets its follow-up hours later
            if late or rng.random() < 0.6:
                delay = window_s + 3600 if late else rng.uniform(10, 120)
                out_of_window += late
                events.append(feedback_event(gid, "followup", at(t0, delay), user_id=user, text=rng.choice(followups)))
            if rng.random() < 0.2:
                events.append(feedback_event(gid, rng.choice(["copied", "regenerated"]), at(t0, 20), user_id=user))

    orphan_ids = [f"orphan-{seed}-{i}" for i in range(orphans)]
    for i, gid in enumerate(orphan_ids):
        events.append(feedback_event(gid, "accepted", start + timedelta(seconds=100 + i), user_id="coder0"))

    events.sort(key=lambda e: (e.ts, e.event_id))
    out: list[Event] = []
    duplicates = 0
    for e in events:
        out.append(e)
        if rng.random() < duplicate_share:
            out.append(e)
            duplicates += 1
    return Telemetry(out, surfaces, decisions, orphan_ids, out_of_window, duplicates)


def _generation(gid: str, ts: datetime, user: str, surface: str, completion: str) -> Event:
    event = generation_event(gid, ts, user_id=user, completion=completion)
    return event.model_copy(update={"properties": {**event.properties, "surface": surface}})


def segment_batches(events: Sequence[Event], *, size: int = 100) -> list[dict[str, object]]:
    """`events` as Segment `/v1/batch` bodies, in order: `messageId` = event id, the event time as
    `timestamp` and no `sentAt`, so history keeps its own times (the collector stamps `received_at`)."""
    messages = [
        {
            "type": "track",
            "event": str(e.type),
            "messageId": e.event_id,
            "userId": e.user_id,
            "timestamp": e.ts.isoformat(),
            "properties": {**e.properties, "generation_id": e.generation_id},
        }
        for e in events
    ]
    return [{"batch": messages[i : i + size]} for i in range(0, len(messages), size)]
