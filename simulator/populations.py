"""Populations of simulated users: each has a hidden preference and a ground truth per request.

A population judges a completion for a context (a prompt cut from code the model was not trained
on, see `simulator.contexts`) and says how satisfied its users are (`Truth`). From that truth a
user's actions are drawn (`Reaction`), and only those actions leave the simulator, as the events a
product would send (`simulator.product`). What must hold:

- nothing in Flywheel reads a population: the signals and the trainer see only events, so no
  population's rule can leak into the reward;
- every preference is reachable from the model's own samples (short completions, a quote style,
  the real continuation, an empty answer), so a policy can learn it from reactions alone;
- the ground truth is in Cursor's terms: a shown suggestion is accepted (and kept) with
  probability `p_accept`; its expected reward is +0.75 if accepted, -0.25 if not; nothing shown
  pays 0. `satisfaction` is `p_accept` for a shown suggestion and the population's value of
  silence (`declined_satisfaction`) for none.
"""

from __future__ import annotations

import difflib
import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

from simulator.contexts import Context

ACCEPT_REWARD = 0.75  # Cursor Tab's reward for an accepted suggestion
REJECT_REWARD = -0.25  # and for a shown one not accepted; nothing shown is 0

Thumb = Literal["up", "down"]


@dataclass(frozen=True)
class Truth:
    """What a population really thinks of one answer (never sent anywhere)."""

    shown: bool
    p_accept: float  # 0 when nothing was shown
    satisfaction: float  # p_accept when shown, the value of silence when not
    wanted: bool  # whether the user wanted a suggestion in this context

    @property
    def expected_reward(self) -> float:
        """Cursor's reward in expectation: 0.75 p - 0.25 (1 - p) when shown, 0 when not."""
        if not self.shown:
            return 0.0
        return ACCEPT_REWARD * self.p_accept + REJECT_REWARD * (1 - self.p_accept)


@dataclass(frozen=True)
class Reaction:
    """What one user did with one answer: the only thing turned into events."""

    shown: bool
    accepted: bool = False  # took the suggestion (an `accepted` event)
    kept: bool = False  # and did not undo it: the ground-truth accept
    retained: bool = False  # a retention check was sent
    thumbs: Thumb | None = None


@dataclass(frozen=True)
class Population(ABC):
    """Users sharing one hidden preference; subclasses say how they judge a shown suggestion."""

    name: str = "population"
    comment_share: float = 0.1  # share of their requests made while writing a comment
    thumbs_rate: float = 0.15  # chance a reacted-to suggestion also gets a thumbs vote
    contradiction_rate: float = 0.0  # chance a vote says the opposite of what the user did
    retained_rate: float = 0.5  # chance a kept suggestion gets a retention check
    undo_rate: float = 0.2  # chance an unwanted suggestion is accepted, then undone
    declined_satisfaction: float = 0.25  # silence: worth what a suggestion accepted a quarter of the time is

    @abstractmethod
    def judge(self, ctx: Context, text: str, finish_reason: str) -> float:
        """The probability a shown suggestion `text` is accepted and kept, in [0, 1]."""

    def wants_suggestion(self, ctx: Context) -> bool:
        return True

    def truth(self, ctx: Context, text: str, finish_reason: str) -> Truth:
        wanted = self.wants_suggestion(ctx)
        if finish_reason == "declined" or not text:
            return Truth(shown=False, p_accept=0.0, satisfaction=self.declined_satisfaction, wanted=wanted)
        p = min(1.0, max(0.0, self.judge(ctx, text, finish_reason)))
        return Truth(shown=True, p_accept=p, satisfaction=p, wanted=wanted)

    def react(self, truth: Truth, rng: random.Random) -> Reaction:
        """A user's actions, drawn from the truth (a seeded `rng` gives the same actions)."""
        if not truth.shown:
            return Reaction(shown=False)
        kept = rng.random() < truth.p_accept
        accepted = kept or rng.random() < self.undo_rate
        retained = kept and rng.random() < self.retained_rate
        thumbs: Thumb | None = None
        if rng.random() < self.thumbs_rate:
            honest = rng.random() >= self.contradiction_rate
            thumbs = "up" if kept == honest else "down"
        return Reaction(shown=True, accepted=accepted, kept=kept, retained=retained, thumbs=thumbs)


def _first_line(text: str) -> str:
    return text.split("\n", 1)[0]


@dataclass(frozen=True)
class LengthPopulation(Population):
    """Likes short completions that finish the current line; rejects ones that run on to `max_tokens`.

    A suggestion is good when it stopped by itself (`finish_reason` "stop"), has at most
    `max_good_chars` characters before its first newline and nothing after it.
    """

    name: str = "length"
    max_good_chars: int = 24
    p_good: float = 0.85
    p_bad: float = 0.15

    def judge(self, ctx: Context, text: str, finish_reason: str) -> float:
        body = text.rstrip("\n")
        good = finish_reason == "stop" and "\n" not in body and len(body) <= self.max_good_chars
        return self.p_good if good else self.p_bad


_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
_CAMEL = re.compile(r"^[a-z]+[A-Z][A-Za-z0-9]*$")
_SNAKE = re.compile(r"^[a-z]+(_[a-z0-9]+)+$")


@dataclass(frozen=True)
class StylePopulation(Population):
    """Cares about style: the quote character of string literals and the naming of identifiers.

    A suggestion using the other quote or the disliked naming is mostly rejected; one with a string in
    the liked quote (and nothing disliked) is mostly accepted; any other is accepted now and then. The
    default likes double quotes, which the standard library (the pretraining corpus) mostly does not
    use, so the base model has something to learn.
    """

    name: str = "style"
    quote: Literal["'", '"'] = '"'
    naming: Literal["snake", "camel"] = "snake"
    p_liked: float = 0.8
    p_neutral: float = 0.35
    p_disliked: float = 0.05

    def judge(self, ctx: Context, text: str, finish_reason: str) -> float:
        other_quote = '"' if self.quote == "'" else "'"
        disliked_naming = _CAMEL if self.naming == "snake" else _SNAKE
        if other_quote in text or any(disliked_naming.match(n) for n in _IDENTIFIER.findall(text)):
            return self.p_disliked
        return self.p_liked if self.quote in text else self.p_neutral


@dataclass(frozen=True)
class ContentPopulation(Population):
    """Judges what the completion says: how closely its first line matches what the author really wrote.

    The context's `truth` is the real rest of the line from code the model never trained on; the
    accept probability rises from `p_floor` (nothing in common) to `p_ceiling` (the same text).
    """

    name: str = "content"
    p_floor: float = 0.02
    p_ceiling: float = 0.95

    def similarity(self, ctx: Context, text: str) -> float:
        said, meant = _first_line(text).strip(), _first_line(ctx.truth).strip()
        if not said or not meant:
            return 0.0
        return difflib.SequenceMatcher(None, said, meant, autojunk=False).ratio()

    def judge(self, ctx: Context, text: str, finish_reason: str) -> float:
        return self.p_floor + (self.p_ceiling - self.p_floor) * self.similarity(ctx, text) ** 2


@dataclass(frozen=True)
class DecliningPopulation(Population):
    """Wants no suggestion while writing a comment (declining is right there); elsewhere judges as `inner`.

    In a comment, silence is worth `silence_satisfaction` and a shown suggestion is accepted with
    probability `p_unwanted` at most.
    """

    name: str = "declining"
    comment_share: float = 0.4
    inner: Population = field(default_factory=LengthPopulation)
    silence_satisfaction: float = 1.0
    p_unwanted: float = 0.03

    def wants_suggestion(self, ctx: Context) -> bool:
        return ctx.kind != "comment"

    def judge(self, ctx: Context, text: str, finish_reason: str) -> float:
        p = self.inner.judge(ctx, text, finish_reason)
        return p if self.wants_suggestion(ctx) else min(p, self.p_unwanted)

    def truth(self, ctx: Context, text: str, finish_reason: str) -> Truth:
        truth = super().truth(ctx, text, finish_reason)
        if not truth.shown and not truth.wanted:
            return Truth(shown=False, p_accept=0.0, satisfaction=self.silence_satisfaction, wanted=False)
        return truth


@dataclass(frozen=True)
class NoisyPopulation(Population):
    """Judges as `inner`, but votes often and its thumbs contradict its actions `contradiction_rate` of the time."""

    name: str = "noisy"
    thumbs_rate: float = 0.6
    contradiction_rate: float = 0.3
    inner: Population = field(default_factory=LengthPopulation)

    def judge(self, ctx: Context, text: str, finish_reason: str) -> float:
        return self.inner.judge(ctx, text, finish_reason)


def default_populations() -> list[Population]:
    """One of each kind, with their default preferences (the mix `flywheel up`'s users are drawn from)."""
    return [LengthPopulation(), StylePopulation(), ContentPopulation(), DecliningPopulation(), NoisyPopulation()]


@dataclass(frozen=True)
class BracketPopulation(Population):
    """A kind added after the defaults were fixed (never used to tune them): likes suggestions that open and
    close their own brackets on the line, dislikes ones leaving a bracket open, is lukewarm about the rest."""

    name: str = "brackets"
    p_closed: float = 0.75
    p_plain: float = 0.3
    p_open: float = 0.08

    def judge(self, ctx: Context, text: str, finish_reason: str) -> float:
        line = _first_line(text)
        depth = 0
        for ch in line:
            depth += ch in "([{"
            depth -= ch in ")]}"
        if depth > 0:
            return self.p_open
        return self.p_closed if any(ch in line for ch in "([{") and depth == 0 else self.p_plain


def tuning_populations() -> list[Population]:
    """The populations the defaults (trainer config, windows, cycle length, gate settings) were chosen on."""
    return [LengthPopulation(), StylePopulation(), DecliningPopulation()]


def reporting_populations() -> list[Population]:
    """Populations only reported on, never tuned on: two known kinds with other preferences, and new kinds.

    Content judges by the real continuation (a preference no default was chosen for); `noisy` contradicts
    itself; `style` liking single quotes and camelCase is the mirror of the tuned style; `brackets` is a
    kind added after the defaults were fixed."""
    return [ContentPopulation(), NoisyPopulation(inner=StylePopulation()),
            StylePopulation(name="style-mirror", quote="'", naming="camel"), BracketPopulation()]  # fmt: skip


def populations_named(names: list[str]) -> list[Population]:
    """The populations of these names, in this order; a name of both a default and a reporting kind (`noisy`)
    is the reporting one. Raises ValueError naming the known ones for an unknown name."""
    known = {p.name: p for p in default_populations()} | {p.name: p for p in reporting_populations()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown populations {unknown}; known: {sorted(known)}")
    return [known[n] for n in names]
