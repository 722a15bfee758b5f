"""Simulated users for `flywheel up`: a mix of populations calling serving and the collector over HTTP.

User `i` belongs to population `i mod len(populations)` (by default one of each kind in
`simulator.populations`), asks for completions of held-out code (`simulator.contexts`) and reacts
as its population's hidden preference says; only its actions reach Flywheel, as Segment events
(`simulator.product`). Nothing in the loop reads a population: the model only ever sees reactions.
`SimulationStats` counts per arm what the terminal table shows, from the ground truth.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import httpx

from simulator.contexts import ContextPool, held_out_contexts
from simulator.populations import Population, default_populations
from simulator.product import Outcome, SimulatedProduct

log = logging.getLogger(__name__)
RECENT = 100  # shown suggestions per arm in the recent accept rate


@dataclass
class SimulationStats:
    """Ground-truth counts per arm, and per arm and population.

    The accept rates are standardised to one population mix: users are split between the arms by a hash of
    their id, so with few users one arm can hold more of a population that accepts little (content users
    accept about 0.06 of what they see, length users 0.4), and a raw per-arm rate would then show a
    difference the versions did not make. Each arm's rate is its per-population rates weighted by every
    arm's shown suggestions per population, over the populations both arms have served."""

    served: Counter[str] = field(default_factory=Counter)  # per arm
    satisfied: Counter[str] = field(default_factory=Counter)  # kept suggestions, per arm
    declined: Counter[str] = field(default_factory=Counter)
    versions: Counter[str] = field(default_factory=Counter)
    shown_by: Counter[tuple[str, str]] = field(default_factory=Counter)  # (arm, population)
    kept_by: Counter[tuple[str, str]] = field(default_factory=Counter)
    recent: defaultdict[tuple[str, str], deque[bool]] = field(
        default_factory=lambda: defaultdict(lambda: deque(maxlen=RECENT)))  # fmt: skip
    errors: int = 0
    shed: int = 0  # stream requests dropped because `max_in_flight` were still waiting on serving
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, outcome: Outcome) -> None:
        with self.lock:
            self.served[outcome.arm] += 1
            self.versions[outcome.model_version] += 1
            if not outcome.truth.shown:
                self.declined[outcome.arm] += 1
                return
            key = (outcome.arm, outcome.population)
            self.shown_by[key] += 1
            self.kept_by[key] += outcome.reaction.kept
            self.recent[key].append(outcome.reaction.kept)
            if outcome.reaction.kept:
                self.satisfied[outcome.arm] += 1

    def _standardised(self, arm: str, rate: Callable[[str], float]) -> float:
        with self.lock:
            arms = {a for a, _ in self.shown_by}
            served = [{p for a, p in self.shown_by if a == other} for other in arms]
            common = set.intersection(*served) if served else set()
            weight = {p: sum(n for (_, q), n in self.shown_by.items() if q == p) for p in common}
        if arm not in arms or not weight:
            return float("nan")
        return sum(w * rate(p) for p, w in weight.items()) / sum(weight.values())

    def satisfaction(self, arm: str) -> float:
        """The ground-truth accept rate of `arm`'s shown suggestions (kept, not undone) since the start, at the
        population mix of every arm (see the class docstring)."""
        return self._standardised(arm, lambda p: self.kept_by[arm, p] / self.shown_by[arm, p])

    def shown_rate(self, arm: str) -> float:
        return (self.served[arm] - self.declined[arm]) / self.served[arm] if self.served[arm] else float("nan")

    def recent_accept_rate(self, arm: str) -> float:
        """The accept rate of each population's last `RECENT` shown suggestions in `arm`, at the common mix:
        how the version serving now does."""
        return self._standardised(arm, lambda p: sum(self.recent[arm, p]) / len(self.recent[arm, p]))


class UserSimulator:
    """`n_users` simulated users, each in one population.

    Two ways to drive them. With `rate_per_s` 0, every user is a thread of its own that asks again after a
    think time (a handful of very active users). With `rate_per_s` > 0, requests arrive as one Poisson
    stream at that rate, each from a user drawn uniformly from the `n_users` (a small product: thousands of
    users who each come back a few times an hour), at most `max_in_flight` of them waiting on serving at once.
    A request that arrives while all of those wait is shed (counted in `stats.shed`), as a product's client
    gives up rather than queue: queued without bound, a stream faster than serving would grow memory and
    latency for as long as it runs. Per-user analysis needs the stream: an A/B test on eight users has eight
    users, however many requests they make.
    """

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
        populations: Sequence[Population] | None = None,
        contexts: ContextPool | None = None,
        rate_per_s: float = 0.0,
        max_in_flight: int = 16,
    ) -> None:
        if rate_per_s < 0 or max_in_flight < 1 or n_users < 0:
            raise ValueError("rate_per_s must be >= 0 (0: a thread per user), max_in_flight >= 1, n_users >= 0")
        self._serving = serving_url.rstrip("/")
        self._collector = collector_url.rstrip("/")
        self._write_key = write_key
        self._n_users = n_users
        self._seed = seed
        self._max_tokens = max_tokens
        self._think = think_time_s
        self.populations = list(populations or default_populations())
        self._contexts = contexts or held_out_contexts(200, seed)
        self._rate = rate_per_s
        self._max_in_flight = max_in_flight
        self.stats = SimulationStats()

    def population_of(self, index: int) -> Population:
        return self.populations[index % len(self.populations)]

    def run_user(self, index: int, stop: threading.Event, max_steps: int | None = None) -> None:
        rng = random.Random(self._seed * 100_003 + index)
        population = self.population_of(index)
        user_id = self.user_id(index)
        steps = 0
        with httpx.Client(base_url=self._serving, timeout=60) as serving, \
                httpx.Client(base_url=self._collector, timeout=60) as collector:
            product = SimulatedProduct(serving, collector, self._write_key, self._contexts,
                                       max_tokens=self._max_tokens)
            while not stop.is_set() and (max_steps is None or steps < max_steps):
                try:
                    self.stats.record(product.step(population, user_id, rng))
                except (httpx.HTTPError, ValueError) as exc:
                    with self.stats.lock:
                        self.stats.errors += 1
                    log.warning("simulated user failed", extra={"user_id": user_id, "error": str(exc)})
                    stop.wait(1.0)
                steps += 1
                stop.wait(rng.expovariate(1 / self._think) if self._think > 0 else 0)

    def user_id(self, index: int) -> str:
        return f"sim-{self.population_of(index).name}-{index:04d}"

    def run_stream(self, stop: threading.Event, max_steps: int | None = None) -> None:
        """Requests as a Poisson stream at `rate_per_s`, each from a uniformly drawn user (see the class doc)."""
        from concurrent.futures import ThreadPoolExecutor

        rng = random.Random(self._seed)
        local = threading.local()

        def product() -> SimulatedProduct:
            if not hasattr(local, "product"):
                serving = httpx.Client(base_url=self._serving, timeout=60)
                collector = httpx.Client(base_url=self._collector, timeout=60)
                local.product = SimulatedProduct(serving, collector, self._write_key, self._contexts,
                                                 max_tokens=self._max_tokens)  # fmt: skip
            return cast(SimulatedProduct, local.product)

        def one(index: int, seed: int) -> None:
            try:
                self.stats.record(product().step(self.population_of(index), self.user_id(index), random.Random(seed)))
            except (httpx.HTTPError, ValueError) as exc:
                with self.stats.lock:
                    self.stats.errors += 1
                log.warning("simulated user failed", extra={"user_id": self.user_id(index), "error": str(exc)})
            finally:
                slots.release()

        # A slot per request waiting on serving, taken when it arrives: a full house sheds the arrival instead
        # of queueing it in the pool (whose queue has no bound).
        slots = threading.BoundedSemaphore(self._max_in_flight)
        arrived = 0
        with ThreadPoolExecutor(self._max_in_flight, thread_name_prefix="sim-request") as pool:
            next_at = time.monotonic()
            while not stop.is_set() and (max_steps is None or arrived < max_steps) and self._n_users:
                next_at += rng.expovariate(self._rate)
                if stop.wait(max(0.0, next_at - time.monotonic())):
                    break
                arrived += 1
                index, seed = rng.randrange(self._n_users), rng.randrange(2**31)  # drawn either way: same stream
                if not slots.acquire(blocking=False):
                    with self.stats.lock:
                        self.stats.shed += 1
                        shed = self.stats.shed
                    if shed == 1 or shed % 1000 == 0:
                        log.warning("serving is slower than the simulated stream: requests shed",
                                    extra={"shed": shed, "max_in_flight": self._max_in_flight})  # fmt: skip
                    continue
                pool.submit(one, index, seed)

    def start(self, stop: threading.Event, max_steps: int | None = None) -> list[threading.Thread]:
        """Start the users (see the class doc); `max_steps` bounds each user's requests, or the stream's
        arrivals (shed ones included)."""
        if self._rate > 0:
            stream = threading.Thread(target=self.run_stream, args=(stop, max_steps), name="sim-stream", daemon=True)
            stream.start()
            return [stream]
        threads = [
            threading.Thread(target=self.run_user, args=(i, stop, max_steps), name=f"sim-user-{i}", daemon=True)
            for i in range(self._n_users)
        ]
        for t in threads:
            t.start()
            time.sleep(0.01)
        return threads
