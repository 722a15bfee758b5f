"""Signals: small pure functions from one generation's feedback events to named values.

Each function takes the generation's in-window feedback events, sorted by event
time (then event id), and returns the signal values it found; a signal that has
no evidence is left out rather than set to zero, so "not observed" and "observed
as 0" stay different. The docstrings name the event types and properties each
signal reads: that is what product teams must send.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from signals.events import FeedbackEvent
from signals.sentiment import Sentiment

# GitHub Copilot measures edit survival at these offsets after an accept (seconds).
RETENTION_CHECKPOINTS_S: tuple[int, ...] = (0, 5, 30, 120, 300, 600, 900)

Signals = dict[str, float]


def _of(events: Sequence[FeedbackEvent], *types: str) -> list[FeedbackEvent]:
    return [e for e in events if e.type in types]


def _num(value: object, default: float = 0.0) -> float:
    """A finite float from a property, or `default` (bad input must not poison a reward)."""
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default
    return out if math.isfinite(out) else default


def thumbs(events: Sequence[FeedbackEvent], sentiment: Sentiment) -> Signals:
    """Explicit feedback. Reads `thumbs` {"value": "up"|"down", "comment": str (optional)}.

    The latest thumbs wins (a user may change their mind). Gives `thumbs` (+1 / -1)
    and, with a comment, `thumbs_comment_sentiment` in [-1, 1].

    >>> from signals.sentiment import lexicon_sentiment
    >>> thumbs([FeedbackEvent("e1", "thumbs", 1, {"value": "down"}),
    ...         FeedbackEvent("e2", "thumbs", 2, {"value": "up", "comment": "great"})], lexicon_sentiment)
    {'thumbs': 1.0, 'thumbs_comment_sentiment': 1.0}
    """
    votes = [e for e in _of(events, "thumbs") if str(e.properties.get("value", "")).lower() in ("up", "down")]
    if not votes:
        return {}
    last = votes[-1]
    out: Signals = {"thumbs": 1.0 if str(last.properties["value"]).lower() == "up" else -1.0}
    comment = str(last.properties.get("comment") or "")
    if comment.strip():
        out["thumbs_comment_sentiment"] = sentiment(comment)
    return out


def decision(events: Sequence[FeedbackEvent]) -> Signals:
    """Shown / accepted / rejected / ignored, with partial accepts.

    Reads `shown`, `accepted` {"accepted_chars": int, "total_chars": int} (both optional;
    a missing pair means a full accept), `rejected`, `ignored`. An accept outranks a
    reject or ignore of the same generation (the user took it in the end).
    Gives `shown`, `accepted`, `accepted_fraction`, `accepted_chars`, `rejected`, `ignored`.
    """
    out: Signals = {}
    decided = _of(events, "accepted", "rejected", "ignored")
    if _of(events, "shown") or decided:
        out["shown"] = 1.0  # any decision implies the suggestion was on screen
    accepts = _of(events, "accepted")
    if accepts:
        props = accepts[-1].properties
        total = _num(props.get("total_chars"), 0.0)
        chars = _num(props.get("accepted_chars"), total)
        fraction = min(1.0, max(0.0, chars / total)) if total > 0 else 1.0
        out.update(accepted=1.0, accepted_fraction=fraction, accepted_chars=max(0.0, chars))
    elif _of(events, "rejected"):
        out["rejected"] = 1.0
    elif _of(events, "ignored"):
        out["ignored"] = 1.0
    return out


def undo(events: Sequence[FeedbackEvent], undo_window_s: float) -> Signals:
    """Undo after an accept. Reads `undone` {"seconds_after_accept": float}.

    Gives `undone` (1.0 within `undo_window_s` of the accept, 0.5 later: a late undo
    says less about the suggestion) and `undo_s`. Without a `seconds_after_accept`,
    it is measured from the accept event.
    """
    undos = _of(events, "undone")
    if not undos:
        return {}
    first = undos[0]
    seconds = first.properties.get("seconds_after_accept")
    if seconds is None:
        accepts = [a for a in _of(events, "accepted") if a.ts_us <= first.ts_us]
        seconds = (first.ts_us - accepts[-1].ts_us) / 1e6 if accepts else 0.0
    secs = max(0.0, _num(seconds))
    return {"undone": 1.0 if secs <= undo_window_s else 0.5, "undo_s": secs}


def edits(events: Sequence[FeedbackEvent], completion_chars: int) -> Signals:
    """Edits after accepting. Reads `edited` {"edit_distance": int} (summed over events).

    Gives `edit_distance` and `edit_ratio` (distance over the accepted text's length, capped at 1).
    """
    evs = _of(events, "edited")
    if not evs:
        return {}
    distance = sum(max(0.0, _num(e.properties.get("edit_distance"))) for e in evs)
    return {"edit_distance": distance, "edit_ratio": min(1.0, distance / max(1, completion_chars))}


def retention(
    events: Sequence[FeedbackEvent],
    accepted_chars: float,
    checkpoints: Sequence[int] = RETENTION_CHECKPOINTS_S,
) -> Signals:
    """Accepted text still present later.

    Reads `retained` {"seconds_after_accept": float, "fraction_present": float}.

    Gives `retention` (the latest measurement's fraction), `retained_chars`
    (accepted characters times that fraction) and, for each checkpoint c with a
    measurement taken at c seconds or later, `retained_<c>s`: the fraction measured
    at the first such time (so `retained_30s` is the first look at or after 30 s).
    """
    evs = [
        (
            max(0.0, _num(e.properties.get("seconds_after_accept"))),
            min(1.0, max(0.0, _num(e.properties.get("fraction_present"), 1.0))),
        )
        for e in _of(events, "retained")
    ]
    if not evs:
        return {}
    evs.sort(key=lambda x: x[0])
    latest = evs[-1][1]
    out: Signals = {"retention": latest, "retained_chars": accepted_chars * latest}
    for c in checkpoints:
        at = next((frac for secs, frac in evs if secs >= c), None)
        if at is not None:
            out[f"retained_{c}s"] = at
    return out


def copy_regenerate(events: Sequence[FeedbackEvent]) -> Signals:
    """Reads `copied` and `regenerated` (no properties). Gives `copied` and `regenerated` (1.0 when seen)."""
    out: Signals = {}
    if _of(events, "copied"):
        out["copied"] = 1.0
    if _of(events, "regenerated"):
        out["regenerated"] = 1.0
    return out


def followup(events: Sequence[FeedbackEvent], sentiment: Sentiment) -> Signals:
    """The user's next message. Reads `followup` {"text": str}: the first one within the window.

    Gives `followup` (1.0) and `followup_sentiment` in [-1, 1].
    """
    evs = _of(events, "followup")
    if not evs:
        return {}
    return {"followup": 1.0, "followup_sentiment": sentiment(str(evs[0].properties.get("text") or ""))}


def dwell(events: Sequence[FeedbackEvent]) -> Signals:
    """Seconds from `shown` to the first decision (`accepted`, `rejected` or `ignored`): `dwell_s`."""
    shown = _of(events, "shown")
    decided = _of(events, "accepted", "rejected", "ignored")
    if not shown or not decided:
        return {}
    return {"dwell_s": max(0.0, (decided[0].ts_us - shown[0].ts_us) / 1e6)}
