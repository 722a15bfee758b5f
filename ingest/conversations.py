"""A chat product's conversation export as the events its product would have sent: text-only chat
generations with their follow-ups and reactions, ready for the collector's native door (`POST /v1/events`).

An export is a list of conversations:

```json
{"conversation_id": "c-1", "user_id": "u-7", "model_version": "acme-chat-3",
 "turns": [{"role": "user", "text": "How do I sort a dict by value?", "ts": "2026-05-01T10:00:00Z"},
           {"role": "assistant", "text": "Use sorted(d.items(), key=...)", "ts": "2026-05-01T10:00:02Z",
            "reactions": [{"type": "thumbs", "value": "up", "ts": "2026-05-01T10:00:30Z"}]},
           {"role": "user", "text": "thanks, that worked", "ts": "2026-05-01T10:01:00Z"}]}
```

Each assistant turn becomes one `generation` event (surface `chat`, its text the `completion`, the user turn
before it the `prompt`, `model_version` from the conversation: a text-only generation, scored and never
trained on off-policy); the next user turn becomes its `followup`; each reaction a `thumbs` (`value`
up/down, optional `comment`) or a `rating` of 1-5 read as a thumbs (>= 4 up, <= 2 down, 3 no vote).
Every event's id is derived from the conversation id and the turn's position, and the conversation id is the
session, so:

- **Replaying is idempotent**: the same export gives the same event ids, which ingest writes once however
  often they are sent (ingest/worker/dedup.py), so each generation gets one reward record however often it is
  replayed;
- the chat refit holds out whole conversations (`signals.chat_reward.Reacted.group` is the session).

History keeps its own times: send it through the collector with these events' `ts`, and the signals worker
windows it by event time (docs/rewards.md, "History").
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from flywheel.contract import Event


class InvalidExport(ValueError):
    """A conversation the export cannot be read from; the message says which and why."""


def _time(raw: object, where: str) -> datetime:
    if isinstance(raw, datetime):
        return raw
    try:
        return datetime.fromisoformat(str(raw).replace("Z", "+00:00"))
    except ValueError:
        raise InvalidExport(f"{where}: ts {raw!r} is not an ISO 8601 time") from None


def _vote(reaction: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    kind = reaction.get("type", "thumbs")
    if kind == "thumbs":
        value = str(reaction.get("value", "")).lower()
        if value not in ("up", "down"):
            raise InvalidExport(f"{where}: a thumbs reaction's value is up or down, not {value!r}")
        out: dict[str, Any] = {"value": value}
    elif kind == "rating":
        try:
            rating = float(reaction.get("value", 0))
        except (TypeError, ValueError):
            raise InvalidExport(f"{where}: a rating is a number 1-5, not {reaction.get('value')!r}") from None
        if not 1 <= rating <= 5:
            raise InvalidExport(f"{where}: a rating is 1-5, not {rating}")
        if 2 < rating < 4:
            return None
        out = {"value": "up" if rating >= 4 else "down"}
    else:
        raise InvalidExport(f"{where}: reaction type {kind!r} is not thumbs or rating")
    if reaction.get("comment"):
        out["comment"] = str(reaction["comment"])
    return out


def _event(
    kind: str, suffix: str, at: datetime, props: dict[str, Any], *, gid: str, user: str, session: str, source: str
) -> Event:
    return Event(event_id=f"{gid}-{suffix}", type=kind, generation_id=gid, user_id=user,  # type: ignore[arg-type]
                 session_id=session, ts=at, received_at=at, source=source, properties=props)  # fmt: skip


def conversation_events(export: Iterable[Mapping[str, Any]], *, source: str = "conversation-export") -> list[Event]:
    """The events of every conversation in `export`, in conversation then turn order (see the module docstring).

    >>> conv = {"conversation_id": "c1", "user_id": "u1", "model_version": "m", "turns": [
    ...     {"role": "assistant", "text": "How can I help?", "ts": "2026-01-01T00:00:00Z"},
    ...     {"role": "user", "text": "hi", "ts": "2026-01-01T00:00:00Z"},
    ...     {"role": "assistant", "text": "hello", "ts": "2026-01-01T00:00:01Z",
    ...      "reactions": [{"type": "rating", "value": 5, "ts": "2026-01-01T00:00:09Z"}]},
    ...     {"role": "user", "text": "thanks", "ts": "2026-01-01T00:00:05Z"}]}
    >>> events = conversation_events([conv])
    >>> [e.event_id for e in events if e.generation_id == "c1-t2"]
    ['c1-t2-generation', 'c1-t2-followup', 'c1-t2-reaction-0']
    >>> [e.properties["prompt"] for e in events if e.type == "generation"]
    ['', 'hi']
    """
    out: list[Event] = []
    for n, conv in enumerate(export):
        cid = str(conv.get("conversation_id") or "")
        user = str(conv.get("user_id") or "")
        if not cid or not user:
            raise InvalidExport(f"conversation #{n}: conversation_id and user_id are required")
        turns = list(conv.get("turns") or [])
        model_version = str(conv.get("model_version") or "unknown")
        for i, turn in enumerate(turns):
            if turn.get("role") != "assistant":
                continue
            where = f"conversation {cid} turn {i}"
            gid = f"{cid}-t{i}"
            ts = _time(turn.get("ts"), where)
            before = next((t for t in reversed(turns[:i]) if t.get("role") == "user"), None)
            after = next((t for t in turns[i + 1 :] if t.get("role") in ("user", "assistant")), None)

            event = functools.partial(_event, gid=gid, user=user, session=cid, source=source)
            prompt = str(before.get("text") or "") if before is not None else ""  # an assistant's opening line: none
            props = {"surface": "chat", "prompt": prompt, "completion": str(turn.get("text") or ""),
                     "model_version": model_version}  # fmt: skip
            out.append(event("generation", "generation", ts, props))
            if after is not None and after.get("role") == "user":
                at = _time(after.get("ts"), f"conversation {cid} turn {i + 1}")
                out.append(event("followup", "followup", at, {"text": str(after.get("text") or "")}))
            for j, reaction in enumerate(turn.get("reactions") or []):
                vote = _vote(reaction, f"{where} reaction {j}")
                if vote is not None:
                    out.append(event("thumbs", f"reaction-{j}", _time(reaction.get("ts", ts), where), vote))
    return out
