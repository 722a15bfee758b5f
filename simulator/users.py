"""Simulated users: they call serving and send feedback the way a product would (over HTTP).

Their hidden preference is something the policy can learn from rewards alone:
they like short completions that finish the current line (at most
`Preference.max_good_tokens` tokens, ending in a newline or end-of-text) and tend
to reject long ones that run to `max_tokens`. Nothing in the loop reads this class:
the model only ever sees their reactions.
"""

from __future__ import annotations

import logging
import random
import sysconfig
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from flywheel.contract import utcnow
from simulator.telemetry import feedback_event

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preference:
    max_good_tokens: int = 6
    p_satisfied_good: float = 0.85
    p_satisfied_bad: float = 0.15

    def p_satisfied(self, completion_tokens: int, finish_reason: str) -> float:
        """The probability a user is happy with a completion (the ground truth rewards should track).

        >>> Preference().p_satisfied(3, "stop") > Preference().p_satisfied(16, "length")
        True
        """
        good = finish_reason == "stop" and completion_tokens <= self.max_good_tokens
        return self.p_satisfied_good if good else self.p_satisfied_bad


def code_prompts(n: int, seed: int = 0) -> list[str]:
    """Prompts cut from the standard library's source: a few lines, then part of the next one."""
    rng = random.Random(seed)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    prompts: list[str] = []
    while len(prompts) < n and files:
        lines = rng.choice(files).read_text(encoding="utf-8", errors="replace").splitlines()
        if len(lines) < 10:
            continue
        i = rng.randrange(3, len(lines))
        if not lines[i].strip():
            continue
        cut = rng.randrange(1, max(2, len(lines[i]) // 2 + 1))
        prompts.append("\n".join(lines[i - 3 : i]) + "\n" + lines[i][:cut])
    return prompts


@dataclass
class SimulationStats:
    served: Counter[str] = field(default_factory=Counter)  # per arm
    satisfied: Counter[str] = field(default_factory=Counter)
    declined: Counter[str] = field(default_factory=Counter)
    versions: Counter[str] = field(default_factory=Counter)
    errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def satisfaction(self, arm: str) -> float:
        shown = self.served[arm] - self.declined[arm]
        return self.satisfied[arm] / shown if shown else float("nan")


class UserSimulator:
    """`n_users` simulated users, each with its own seeded random stream."""

    def __init__(
        self,
        serving_url: str,
        collector_url: str,
        write_key: str,
        *,
        n_users: int = 20,
        seed: int = 0,
        max_tokens: int = 16,
        think_time_s: float = 0.2,
        preference: Preference | None = None,
    ) -> None:
        self._serving = serving_url.rstrip("/")
        self._collector = collector_url.rstrip("/")
        self._auth = (write_key, "")
        self._n_users = n_users
        self._seed = seed
        self._max_tokens = max_tokens
        self._think = think_time_s
        self.preference = preference or Preference()
        self._prompts = code_prompts(200, seed)
        self.stats = SimulationStats()

    def step(self, client: httpx.Client, user_id: str, rng: random.Random) -> dict[str, Any]:
        """One interaction: ask for a completion, react to it, send the reaction. Returns the completion."""
        resp = client.post(
            f"{self._serving}/v1/completions",
            json={"prompt": rng.choice(self._prompts), "max_tokens": self._max_tokens, "user": user_id,
                  "seed": rng.randrange(2**31)},
        )
        resp.raise_for_status()
        body = resp.json()
        meta = body["flywheel"]
        choice = body["choices"][0]
        arm = meta["arm"]
        events = self.reactions(meta["generation_id"], user_id, choice, body["usage"]["completion_tokens"], rng)
        if events:
            sent = client.post(f"{self._collector}/v1/events", json={"events": events}, auth=self._auth)
            sent.raise_for_status()
        with self.stats.lock:
            self.stats.served[arm] += 1
            self.stats.versions[meta["model_version"]] += 1
            if choice["finish_reason"] == "declined":
                self.stats.declined[arm] += 1
            elif any(e["type"] == "accepted" for e in events) and not any(e["type"] == "undone" for e in events):
                self.stats.satisfied[arm] += 1
        return body

    def reactions(
        self, generation_id: str, user_id: str, choice: dict[str, Any], n_tokens: int, rng: random.Random
    ) -> list[dict[str, Any]]:
        """The feedback events a product would send for this completion."""
        if choice["finish_reason"] == "declined" or not choice["text"]:
            return []  # nothing was shown, so there is nothing to react to
        text = choice["text"]

        def ev(type_: str, **props: Any) -> dict[str, Any]:
            event = feedback_event(generation_id, type_, utcnow(), user_id=user_id, source="simulator", **props)
            return event.model_dump(mode="json", exclude={"received_at"})  # the collector sets received_at

        out = [ev("shown", chars=len(text), training_consent=True)]  # simulated users all opted in
        happy = rng.random() < self.preference.p_satisfied(n_tokens, choice["finish_reason"])
        if happy:
            out.append(ev("accepted", accepted_chars=len(text), total_chars=len(text)))
            if rng.random() < 0.5:
                out.append(ev("retained", seconds_after_accept=30.0, fraction_present=round(rng.uniform(0.8, 1), 3)))
            if rng.random() < 0.15:
                out.append(ev("thumbs", value="up", comment=""))
        elif rng.random() < 0.8:
            out.append(ev("rejected"))
            if rng.random() < 0.15:
                out.append(ev("thumbs", value="down", comment="not what I wanted"))
        else:
            out.append(ev("accepted", accepted_chars=len(text), total_chars=len(text)))
            out.append(ev("undone", seconds_after_accept=round(rng.uniform(0.5, 4), 2)))
        return out

    def run_user(self, index: int, stop: threading.Event, max_steps: int | None = None) -> None:
        rng = random.Random(self._seed * 100_003 + index)
        user_id = f"sim-user-{index:04d}"
        steps = 0
        with httpx.Client(timeout=60) as client:
            while not stop.is_set() and (max_steps is None or steps < max_steps):
                try:
                    self.step(client, user_id, rng)
                except httpx.HTTPError as exc:
                    with self.stats.lock:
                        self.stats.errors += 1
                    log.warning("simulated user %s: %s", user_id, exc)
                    stop.wait(1.0)
                steps += 1
                stop.wait(rng.expovariate(1 / self._think) if self._think > 0 else 0)

    def start(self, stop: threading.Event, max_steps: int | None = None) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self.run_user, args=(i, stop, max_steps), name=f"sim-user-{i}", daemon=True)
            for i in range(self._n_users)
        ]
        for t in threads:
            t.start()
            time.sleep(0.01)
        return threads
