"""A simulated product: asks serving for a completion, lets a population's user react, sends the events.

It talks to Flywheel only as a real product would: `POST /v1/completions` on serving and a
Segment-compatible `POST /v1/batch` on the collector (the write key as basic-auth user), with the
documented event properties (docs/sending-events.md, "Properties of each event type") and a `surface`. What goes
out is the user's actions; the population's rule and ground truth stay here, in the `Outcome`
returned to the caller (a benchmark or a test), never on the wire.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from simulator.contexts import Context, ContextPool
from simulator.populations import Population, Reaction, Truth

SURFACE = "code-completion"
RETENTION_CHECK_S = 30.0  # when the product measures whether accepted text is still there


@dataclass(frozen=True)
class Outcome:
    """One request, with its ground truth (for measurement only)."""

    population: str
    context: Context
    arm: str
    model_version: str
    generation_id: str
    text: str
    finish_reason: str
    truth: Truth
    reaction: Reaction
    events: int  # how many events were sent


def segment_messages(
    generation_id: str, user_id: str, text: str, reaction: Reaction, *, surface: str = SURFACE,
    training_consent: bool = True, now: datetime | None = None,
) -> list[dict[str, Any]]:
    """The Segment track calls a product sends for `reaction` (none when nothing was shown)."""
    if not reaction.shown:
        return []
    stamp = (now or datetime.now(UTC)).isoformat()

    def track(event: str, **props: Any) -> dict[str, Any]:
        return {
            "type": "track", "event": event, "userId": user_id, "messageId": str(uuid.uuid4()),
            "timestamp": stamp,
            "properties": {"generation_id": generation_id, "surface": surface, **props},
        }

    # Simulated users all opted in; the product states it on what it sends.
    out = [track("shown", chars=len(text), training_consent=training_consent)]
    if reaction.accepted:
        out.append(track("accepted", accepted_chars=len(text), total_chars=len(text)))
        if not reaction.kept:
            out.append(track("undone", seconds_after_accept=2.0))
        elif reaction.retained:
            out.append(track("retained", seconds_after_accept=RETENTION_CHECK_S, fraction_present=1.0))
    else:
        out.append(track("rejected"))
    if reaction.thumbs is not None:
        out.append(track("thumbs", value=reaction.thumbs))
    return out


class HttpClient(Protocol):
    """What the product needs of an HTTP client: `httpx.Client`, or a test client of an in-process app."""

    def post(self, url: str, *, json: Any = None, auth: Any = None) -> Any: ...


class SimulatedProduct:
    """Serves one population's users through real HTTP clients (or in-process test clients)."""

    def __init__(self, serving: HttpClient, collector: HttpClient, write_key: str, contexts: ContextPool,
                 *, max_tokens: int = 16, temperature: float | None = None) -> None:
        self._serving = serving
        self._collector = collector
        self._auth = (write_key, "")
        self._contexts = contexts
        self._max_tokens = max_tokens
        self._temperature = temperature

    def complete(self, prompt: str, user_id: str, seed: int) -> dict[str, Any]:
        request: dict[str, Any] = {"prompt": prompt, "max_tokens": self._max_tokens, "user": user_id, "seed": seed}
        if self._temperature is not None:
            request["temperature"] = self._temperature
        resp = self._serving.post("/v1/completions", json=request)
        resp.raise_for_status()
        body: dict[str, Any] = resp.json()
        return body

    def send(self, messages: list[dict[str, Any]]) -> None:
        if not messages:
            return
        sent = self._collector.post(
            "/v1/batch", json={"batch": messages, "sentAt": datetime.now(UTC).isoformat()}, auth=self._auth
        )
        sent.raise_for_status()
        refused = sent.json().get("refused")
        if refused:  # the simulator builds only valid events: a refusal is a bug here or a contract change
            raise ValueError(f"the collector refused simulated events: {refused}")

    def step(self, population: Population, user_id: str, rng: random.Random, context: Context | None = None) -> Outcome:
        """One interaction: a context, a completion, the user's reaction, its events sent."""
        ctx = context or self._contexts.draw(rng, population.comment_share)
        body = self.complete(ctx.prompt, user_id, rng.randrange(2**31))
        choice, meta = body["choices"][0], body["flywheel"]
        text, finish = choice["text"], choice["finish_reason"]
        truth = population.truth(ctx, text, finish)
        reaction = population.react(truth, rng)
        messages = segment_messages(body["id"], user_id, text, reaction)
        self.send(messages)
        return Outcome(population.name, ctx, meta["arm"], meta["model_version"], body["id"], text, finish,
                       truth, reaction, len(messages))
