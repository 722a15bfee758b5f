"""The reward definition: one generation's events -> one `RewardRecord`.

A `RewardDefinition` is versioned and immutable: the same version always turns the
same events into the same record, which is what lets the batch recompute
reproduce the stream exactly and lets a new definition be backfilled.

How a reward is decided, in order:
1. Explicit thumbs: +1 (up) / -1 (down), label source "explicit".
2. A declined completion (empty: the policy chose not to suggest) that was never
   shown: neutral `declined_reward` (0), label "default", full confidence, because
   not suggesting is an outcome we know, not missing data.
3. Implicit signals (shown, accept, undo, retention, ...): the rule-based reward
   below, or, when the definition carries a fitted satisfaction model, its
   expected explicit label 2 * P(satisfied) - 1: the scale of thumbs (+1 / -1) and of the
   rules (clipped to [-1, 1]). Label "implicit".
4. Nothing at all: `default_reward`, label "default", low confidence. A definition with a
   model sets it to what the model says of a generation without any signal
   (`with_satisfaction`), so having some signal is never worth +0.5 by itself.

A definition belongs to one product surface (`surface`, from the generation event's
`surface` property) and scores only that surface's generations: a model fitted on chat
thumbs never scores a code suggestion. Its feedback window is `window_s` (None: the
deployment's window for the surface, `Settings.window_for`); it must cover the latest
retention checkpoint the definition reads (`latest_checkpoint_s`), or those checks fall outside
the window and are counted out-of-window by the worker (it warns at start).

The rule-based reward follows the published Cursor Tab reward (+0.75 accept,
-0.25 reject), scaled by the accepted fraction and by how much of it survived.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from flywheel.contract import LabelSource, RewardRecord, utcnow
from flywheel.reward_versions import DEFAULT_SURFACE, surface_of
from signals import features
from signals.events import FeedbackEvent, GenerationInfo, from_us
from signals.logistic import LogisticModel
from signals.sentiment import DEFAULT_SENTIMENT, Sentiment
from signals.sentiment import SENTIMENTS as _SENTIMENTS
from signals.text_features import TextModel


@dataclass(frozen=True)
class RuleWeights:
    """Weights of the rule-based reward. Result is clipped to [-1, 1]."""

    accept: float = 0.75  # Cursor Tab: +0.75 for an accept ...
    reject: float = -0.25  # ... and -0.25 for a reject
    ignored: float = -0.10  # shown, then ignored or no decision at all
    undone: float = -0.10  # the whole reward of an accept undone at once: worse than nothing, not a reject
    retention_floor: float = 0.2  # share of the accept credit kept when none of the text survived
    edit: float = -0.25  # times edit_ratio
    copied: float = 0.20
    regenerated: float = -0.30
    followup: float = 0.30  # times follow-up sentiment

    def __post_init__(self) -> None:
        if not self.undone > self.reject:
            raise ValueError("RuleWeights.undone must be above reject: an undone accept still beats a reject")
        if not 0 <= self.retention_floor <= 1:
            raise ValueError("RuleWeights.retention_floor must be in [0, 1]")


@dataclass(frozen=True)
class Score:
    reward: float
    confidence: float
    label_source: LabelSource
    signals: dict[str, float]


@dataclass(frozen=True)
class RewardDefinition:
    """A versioned reward definition. Change anything -> give it a new `version`.

    >>> d = RewardDefinition()
    >>> g = GenerationInfo("g1", ts_us=0, completion_chars=10)
    >>> d.score(g, [FeedbackEvent("e1", "accepted", 1_000_000)]).reward
    0.75
    >>> d.score(g, [FeedbackEvent("e1", "rejected", 1_000_000)]).reward
    -0.25
    """

    version: str = "rules-v1"
    weights: RuleWeights = field(default_factory=RuleWeights)
    undo_window_s: float = 30.0
    default_reward: float = 0.0
    default_confidence: float = 0.05
    declined_reward: float = 0.0
    sentiment_name: str = DEFAULT_SENTIMENT
    satisfaction: LogisticModel | None = None
    notes: str = ""
    surface: str = DEFAULT_SURFACE
    window_s: float | None = None  # None: the deployment's window for the surface (`Settings.window_for`)
    rules_version: str = ""  # with a satisfaction model: the rules definition it was fitted over
    # A text model learned from the surface's explicit reactions (signals/chat_reward.py): when set, it is the
    # sentiment of follow-ups (and thumbs comments), 2 P(approved | text) - 1, in place of `sentiment_name`'s.
    followup_model: TextModel | None = None

    def __post_init__(self) -> None:
        if not self.version or any(c in self.version for c in " /:"):
            raise ValueError(f"reward version {self.version!r} must be non-empty, without spaces, '/' or ':'")
        surface_of(self.surface)  # a valid name
        if self.window_s is not None and not self.window_s > 0:
            raise ValueError(f"window_s must be positive; got {self.window_s}")
        if self.sentiment_name not in _SENTIMENTS:
            raise ValueError(f"unknown sentiment {self.sentiment_name!r}; known: {sorted(_SENTIMENTS)}")

    @property
    def sentiment(self) -> Sentiment:
        if self.followup_model is not None:
            return self.followup_model.sentiment
        return _SENTIMENTS[self.sentiment_name]

    @property
    def latest_checkpoint_s(self) -> float:
        """The latest time after a generation at which a signal this definition reads is measured."""
        return float(max(features.RETENTION_CHECKPOINTS_S))

    def window(self, default_s: float) -> float:
        """This surface's feedback window in seconds (`default_s`: the deployment's `reward_window_s`)."""
        return self.window_s if self.window_s is not None else default_s

    # ------------------------------------------------------------------ scoring

    def extract(
        self, gen: GenerationInfo, events: Iterable[FeedbackEvent], window_end_us: int
    ) -> dict[str, float]:
        """Every signal's value for this generation, from its in-window feedback events."""
        evs = sorted(
            (e for e in events if e.ts_us <= window_end_us and e.type != "generation"),
            key=lambda e: (e.ts_us, e.event_id),
        )
        out: dict[str, float] = {"declined": 1.0 if gen.declined else 0.0, "feedback_events": float(len(evs))}
        out.update(features.thumbs(evs, self.sentiment))
        out.update(features.decision(evs))
        out.update(features.undo(evs, self.undo_window_s))
        out.update(features.edits(evs, gen.completion_chars))
        out.update(features.retention(evs, out.get("accepted_chars", 0.0)))
        out.update(features.copy_regenerate(evs))
        out.update(features.followup(evs, self.sentiment))
        out.update(features.dwell(evs))
        return out

    def score(
        self, gen: GenerationInfo, events: Iterable[FeedbackEvent], window_end_us: int | None = None
    ) -> Score:
        s = self.extract(gen, events, window_end_us if window_end_us is not None else 2**62)
        if "thumbs" in s:
            agrees = s.get("thumbs_comment_sentiment", s["thumbs"]) * s["thumbs"] >= 0
            return Score(s["thumbs"], 1.0 if agrees else 0.8, "explicit", s)
        return self.score_implicit(s)

    def score_implicit(self, s: dict[str, float]) -> Score:
        """The reward of extracted signals `s` without the explicit vote (thumbs are not read): what the
        refit compares with held-out thumbs."""
        implicit = {"shown", "copied", "regenerated", "followup", "edit_distance", "retention", "undone"}
        if not implicit & s.keys():
            if s.get("declined"):
                return Score(self.declined_reward, 1.0, "default", s)
            return Score(self.default_reward, self.default_confidence, "default", s)
        if self.satisfaction is not None:
            p = self.satisfaction.predict_one(s)
            s = {**s, "p_satisfied": p}
            return Score(2.0 * p - 1.0, max(p, 1.0 - p), "implicit", s)
        return self._rules(s)

    def _rules(self, s: dict[str, float]) -> Score:
        w = self.weights
        evidence = 0
        if s.get("accepted"):
            reward = w.accept * s["accepted_fraction"]
            evidence += 1
            if "undone" in s:
                # a late undo (undone = 0.5) is halfway between keeping and undoing at once
                reward = reward + s["undone"] * (w.undone - reward)
                evidence += 1
            elif "retention" in s:
                reward *= w.retention_floor + (1.0 - w.retention_floor) * s["retention"]
                evidence += 1
            reward += w.edit * s.get("edit_ratio", 0.0)
        elif s.get("rejected"):
            reward, evidence = w.reject, evidence + 1
        else:
            reward = w.ignored if s.get("shown") else 0.0
        if s.get("copied"):
            reward, evidence = reward + w.copied, evidence + 1
        if s.get("regenerated"):
            reward, evidence = reward + w.regenerated, evidence + 1
        if "followup_sentiment" in s:
            reward, evidence = reward + w.followup * s["followup_sentiment"], evidence + 1
        reward = min(1.0, max(-1.0, reward))
        return Score(reward, min(0.9, 0.3 + 0.2 * evidence), "implicit", s)

    def record(
        self,
        gen: GenerationInfo,
        events: Iterable[FeedbackEvent],
        *,
        window_end_us: int,
        revision: int = 0,
        late_events: int = 0,
        emitted_at: datetime | None = None,
    ) -> RewardRecord:
        if gen.surface != self.surface:
            raise ValueError(
                f"reward definition {self.version} scores surface {self.surface!r}, "
                f"not generation {gen.generation_id} of surface {gen.surface!r}"
            )
        sc = self.score(gen, events, window_end_us)
        return RewardRecord(
            generation_id=gen.generation_id,
            reward_version=self.version,
            revision=revision,
            reward=sc.reward,
            confidence=sc.confidence,
            label_source=sc.label_source,
            signals=sc.signals,
            user_id=gen.user_id,
            model_version=gen.model_version,
            arm=gen.arm,
            experiment=gen.experiment,
            window_start=from_us(gen.ts_us),
            window_end=from_us(window_end_us),
            late_events=late_events,
            emitted_at=emitted_at or utcnow(),
        )

    # ------------------------------------------------------------------ versioned spec

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "version": self.version,
            "weights": self.weights.__dict__.copy(),
            "undo_window_s": self.undo_window_s,
            "default_reward": self.default_reward,
            "default_confidence": self.default_confidence,
            "declined_reward": self.declined_reward,
            "sentiment_name": self.sentiment_name,
            "notes": self.notes,
            "satisfaction": self.satisfaction.to_json() if self.satisfaction else None,
            "surface": self.surface,
            "window_s": self.window_s,
            "rules_version": self.rules_version,
        }
        if self.followup_model is not None:  # only then: every older version keeps its stored spec, byte for byte
            spec["followup_model"] = self.followup_model.to_json()
        return spec

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> RewardDefinition:
        raw = dict(spec)
        raw["weights"] = RuleWeights(**raw.get("weights", {}))
        sat = raw.get("satisfaction")
        raw["satisfaction"] = LogisticModel.from_json(sat) if sat else None
        if raw.get("followup_model"):
            raw["followup_model"] = TextModel.from_json(raw["followup_model"])
        return cls(**raw)

    def with_satisfaction(self, model: LogisticModel, version: str, notes: str = "") -> RewardDefinition:
        """This definition scored by `model`; its "no signal" default becomes the model's own value
        for a generation with no signal (2 * P(satisfied | nothing) - 1), on the same scale."""
        if self.satisfaction is not None:
            raise ValueError(f"{self.version} already has a model; fit over its rules ({self.rules_version})")
        baseline = 2.0 * model.predict_one({}) - 1.0
        return replace(
            self, version=version, satisfaction=model, notes=notes, default_reward=baseline,
            rules_version=self.version,
        )  # fmt: skip


# The built-in version keeps the sentiment it was defined with: a version's scores never change under its id.
DEFAULT_DEFINITION = RewardDefinition(sentiment_name="lexicon-v1")
"""The built-in rules of the default surface (code completion)."""


def builtin_definition(surface: str) -> RewardDefinition:
    """The built-in rules of a surface: `rules-v1` for code completion, `<surface>-rules-v1` for others.

    >>> builtin_definition("chat").version, builtin_definition("chat").surface
    ('chat-rules-v1', 'chat')
    """
    surface = surface_of(surface)
    if surface == DEFAULT_SURFACE:
        return DEFAULT_DEFINITION
    return RewardDefinition(version=f"{surface}-rules-v1", surface=surface)


def builtin_for_version(version: str) -> RewardDefinition | None:
    """The built-in definition named `version`, whatever its surface (a product may name its own), or None.

    >>> builtin_for_version("docs-rules-v1").surface, builtin_for_version("sat-docs-1")
    ('docs', None)
    """
    if version == DEFAULT_DEFINITION.version:
        return DEFAULT_DEFINITION
    surface = version.removesuffix("-rules-v1")
    if surface == version:
        return None
    try:
        definition = builtin_definition(surface)
    except ValueError:
        return None
    return definition if definition.version == version else None


BUILTIN_SURFACES: tuple[str, ...] = (DEFAULT_SURFACE, "chat")
