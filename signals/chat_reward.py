"""The chat reward, learned from a product's explicit reactions and read from the user's follow-up.

A chat user's next message says whether the reply helped ("thanks, that did it" / "that's not what I
asked"), but which words say so depends on the product. So the follow-up's sentiment is learned: a
hashed n-gram logistic model of P(thumbs up | follow-up text) (`signals.text_features.TextModel`),
fitted on the surface's generations that got a thumbs vote, then applied to every generation of the
surface as its `followup_sentiment` (2p - 1). A logistic satisfaction model over the definition's
implicit signals (`signals.satisfaction.FEATURES`: the follow-up's learned score, copy, regenerate) then
calibrates and combines them, fitted on the learned score out-of-fold, so it calibrates what the text
model says of text it has not seen.

Only the user's own text is read, never the reply: the policy writes the reply, so a reward that read it
could be raised by writing what it likes (longer, more agreeable), which is the failure the sycophancy
check (`flywheel.sycophancy`) watches for. On the shared collections the reply added nothing the
follow-up did not already say (bench/chat_reward_auc.py).

What must hold:

- **Versioned and pinned.** A fit is a `RewardDefinition` holding both models (`text-<surface>-<labels>-<hash>`,
  over the rules of the active version), stored whatever happens; the same labels give the same version.
- **Activated only when it beats the active version** on held-out reactions: the held-out generations are
  whole conversations (`Reacted.group`: a hash picks them, so the same ones every refit), scored by both
  definitions with their thumbs removed, exactly as a generation with no reaction is scored. The rules are
  `signals.satisfaction.Comparison.beats` (AUC gain over the margin with its paired bootstrap interval
  above 0, ECE no worse) and `min_labels`; otherwise the result says why and the active version stays.
- **Cold start and few reactions.** Below `MIN_FIT_LABELS` reactions nothing is fitted: the active version
  (the rules, VADER on the follow-up) stays. A surface other than chat with few reactions fits over the chat
  surface's learned text model as a prior (`TextModel.fit(prior=...)`), so its weights start from what chat
  learned and move as far as its own reactions say.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import polars as pl

from flywheel.connections import configure_mlflow, experiment_artifact_location, redis_client
from flywheel.lake.tables import EVENTS, REWARDS
from flywheel.reward_versions import DEFAULT_SURFACE, surface_of
from flywheel.settings import Settings
from flywheel.sycophancy import SycophancyCheck, arm_replies, sycophancy_check
from signals.config import SignalsConfig
from signals.definitions import DefinitionStore
from signals.events import FeedbackEvent, GenerationInfo, to_us
from signals.logistic import LogisticModel
from signals.reward import RewardDefinition
from signals.satisfaction import (
    FEATURES,
    Comparison,
    RefitResult,
    compare_with_rules,
    feature_matrix,
    is_held_out,
)
from signals.sink import read_rewards
from signals.text_features import Hashing, TextModel

log = logging.getLogger(__name__)

MIN_FIT_LABELS = 20  # reactions with a follow-up below which nothing is fitted (the active version stays)
HASHING = Hashing(bits=18, word_ngrams=2)  # chosen on the shared collections (bench/chat_reward_auc.py)
L2 = 0.3
FOLDS = 5
PRIOR_SURFACE = "chat"


@dataclass(frozen=True)
class Reacted:
    """One generation with its in-window feedback events; `group` is its conversation (or session)."""

    generation: GenerationInfo
    events: tuple[FeedbackEvent, ...]
    group: str

    @property
    def label(self) -> int | None:
        """1 for a thumbs up, 0 for down (the latest vote wins, as in `features.thumbs`), None without one."""
        votes = [e for e in self.events if e.type == "thumbs" and str(e.properties.get("value", "")).lower() in
                 ("up", "down")]  # fmt: skip
        if not votes:
            return None
        last = max(votes, key=lambda e: (e.ts_us, e.event_id))
        return int(str(last.properties["value"]).lower() == "up")

    @property
    def followup(self) -> str | None:
        """The first follow-up message's text (what `features.followup` reads), or None."""
        fus = sorted((e for e in self.events if e.type == "followup"), key=lambda e: (e.ts_us, e.event_id))
        return str(fus[0].properties.get("text") or "") if fus else None

    def unreacted(self) -> list[FeedbackEvent]:
        """Its events without the explicit vote: what a generation nobody reacted to looks like."""
        return [e for e in self.events if e.type != "thumbs"]


def implicit_proba(definition: RewardDefinition, item: Reacted) -> float:
    """P(satisfied) the definition gives a generation from its implicit signals only: (reward + 1) / 2."""
    signals = definition.extract(item.generation, item.unreacted(), 2**62)
    return (definition.score_implicit(signals).reward + 1.0) / 2.0


@dataclass(frozen=True)
class ChatFit:
    definition: RewardDefinition  # text model + satisfaction model, over `text_only`
    text_only: RewardDefinition  # the base rules with the learned follow-up sentiment
    n_labels: int
    n_train: int
    n_test: int
    test_labels: np.ndarray
    test_proba: np.ndarray
    test_items: tuple[Reacted, ...]


def _folds(groups: Sequence[str], k: int) -> np.ndarray:
    """A stable fold per group (a hash of the group), so a conversation never straddles two folds."""
    return np.array([int(hashlib.sha256(f"fold:{g}".encode()).hexdigest()[:8], 16) % k for g in groups])


def fit_chat_reward(
    items: Sequence[Reacted],
    base: RewardDefinition,
    *,
    holdout_share: float = 0.2,
    hashing: Hashing = HASHING,
    l2: float = L2,
    prior: TextModel | None = None,
) -> ChatFit:
    """Fit the text and satisfaction models on the reacted `items` outside the held-out conversations.
    Raises ValueError with fewer than `MIN_FIT_LABELS` training reactions with a follow-up, or one kind only."""
    labelled = sorted((i for i in items if i.label is not None), key=lambda i: i.generation.generation_id)
    test = np.array([is_held_out(i.group, holdout_share) for i in labelled], dtype=bool)
    train = [i for i, t in zip(labelled, test, strict=True) if not t]
    texted = [i for i in train if i.followup is not None]
    y_text = np.array([i.label for i in texted], dtype=np.float64)
    if len(texted) < MIN_FIT_LABELS or len(np.unique(y_text)) < 2:
        raise ValueError(
            f"need at least {MIN_FIT_LABELS} training reactions with a follow-up, of both kinds; have {len(texted)}"
        )
    texts = [i.followup or "" for i in texted]
    model = TextModel.fit(texts, y_text, hashing, l2=l2, prior=prior)
    # Out-of-fold scores of the training follow-ups, so the satisfaction model calibrates unseen text.
    fold = _folds([i.group for i in texted], FOLDS)
    oof = np.zeros(len(texted))
    for k in range(FOLDS):
        inside = fold != k
        if (~inside).any():
            if len(np.unique(y_text[inside])) < 2:
                oof[~inside] = model.predict([t for t, o in zip(texts, inside, strict=True) if not o])
                continue
            m = TextModel.fit([t for t, i in zip(texts, inside, strict=True) if i], y_text[inside], hashing,
                              l2=l2, prior=prior)  # fmt: skip
            oof[~inside] = m.predict([t for t, o in zip(texts, inside, strict=True) if not o])
    oof_of = {i.generation.generation_id: 2.0 * p - 1.0 for i, p in zip(texted, oof, strict=True)}
    # over the plain rules: `rules_version` names them, so the next refit starts from them again
    text_only = replace(base, version=f"{base.version}-text", followup_model=model, satisfaction=None,
                        rules_version=base.version)  # fmt: skip
    signals = []
    for i in train:
        s = text_only.extract(i.generation, i.unreacted(), 2**62)
        if "followup_sentiment" in s:
            s["followup_sentiment"] = oof_of[i.generation.generation_id]
        signals.append(s)
    y_train = np.array([i.label for i in train], dtype=np.float64)
    satisfaction = LogisticModel.fit(feature_matrix(signals), y_train, FEATURES)
    digest = hashlib.sha256(
        json.dumps({"base": base.version, "text": model.to_json(), "sat": satisfaction.to_json()},
                   sort_keys=True).encode()  # fmt: skip
    ).hexdigest()[:8]
    version = f"text-{base.surface}-{len(labelled)}-{digest}"
    text_only = replace(
        text_only, version=f"{version}-rules",
        notes=f"{base.version} with a follow-up model learned from {len(texted)} {base.surface} reactions",
    )  # fmt: skip
    definition = text_only.with_satisfaction(
        satisfaction, version=version,
        notes=f"{base.version}'s follow-up sentiment learned from {len(texted)} {base.surface} reactions, "
        f"calibrated with the implicit signals of {len(train)}",
    )  # fmt: skip
    held = tuple(i for i, t in zip(labelled, test, strict=True) if t)
    proba = np.array([implicit_proba(definition, i) for i in held])
    return ChatFit(definition, text_only, len(labelled), len(train), len(held),
                   np.array([i.label for i in held], dtype=np.float64), proba, held)  # fmt: skip


@dataclass(frozen=True)
class ChatRefit:
    surface: str
    n_labels: int
    version: str | None = None
    activated: bool = False
    reason: str = ""
    comparison: Comparison | None = None
    active_version: str = ""  # the version it was compared with (still active unless `activated`)
    run_id: str | None = None


def decide(
    fit: ChatFit, active: RewardDefinition, config: SignalsConfig, *, activate: bool = True
) -> tuple[bool, str, Comparison]:
    """Whether `fit` may replace `active`, and why: on the held-out reactions, both scored without them."""
    active_proba = np.array([implicit_proba(active, i) for i in fit.test_items])
    cmp = compare_with_rules(
        fit.test_labels, fit.test_proba, active_proba, samples=config.bootstrap_samples, seed=config.seed
    )
    better, reason = cmp.beats(config.auc_margin)
    if fit.n_labels < config.min_labels:
        return False, f"{fit.n_labels} labels < min_labels {config.min_labels}; {active.version} stays", cmp
    if not better:
        return False, f"does not beat the active {active.version}: {reason}", cmp
    if not activate:
        return False, "activation not asked for", cmp
    return True, f"activated: beats the active {active.version} on {cmp.n_test} held-out reactions", cmp


def refit_chat(
    settings: Settings,
    config: SignalsConfig | None = None,
    *,
    surface: str = PRIOR_SURFACE,
    activate: bool = True,
    items: Sequence[Reacted] | None = None,
) -> ChatRefit:
    """Fit the surface's learned chat reward on its reactions so far (`items`, else the lake's), store it,
    and activate it only if it beats the surface's active version (see the module docstring)."""
    config = config or SignalsConfig()
    surface = surface_of(surface)
    store = DefinitionStore(settings, redis_client(settings))
    active = store.active(surface)
    if items is None:
        items = reactions_from_lake(settings, surface)
    n = sum(i.label is not None for i in items)
    base = store.get(active.rules_version) if active.satisfaction is not None and active.rules_version else active
    if base.followup_model is not None and base.rules_version:  # a learned version: refit over its plain rules
        base = store.get(base.rules_version)
    prior = None
    if surface != PRIOR_SURFACE:
        prior_def = store.active(PRIOR_SURFACE)
        prior = prior_def.followup_model
    try:
        fit = fit_chat_reward(items, replace(base, followup_model=None), prior=prior)
    except ValueError as exc:
        return ChatRefit(surface, n, reason=f"{exc}; {active.version} stays", active_version=active.version)
    store.put(fit.text_only)
    store.put(fit.definition)
    activated, reason, cmp = decide(fit, active, config, activate=activate)
    run_id = _log_to_mlflow(settings, config, fit, cmp, activated, reason, prior is not None)
    if activated:
        store.set_active(fit.definition.version)
    log.info("chat reward refit", extra={"surface": surface, "version": fit.definition.version,
                                         "activated": activated, "reason": reason})  # fmt: skip
    return ChatRefit(surface, n, fit.definition.version, activated, reason, cmp, active.version, run_id)


def refit_as_satisfaction(
    settings: Settings, config: SignalsConfig | None = None, *, surface: str, activate: bool = True
) -> RefitResult | None:
    """`refit_chat` as `signals.satisfaction.refit` reports a refit, or None when the surface's reactions with a
    follow-up are too few to fit a text model (the caller then fits its signals-only model, as before)."""
    result = refit_chat(settings, config, surface=surface, activate=activate)
    if result.version is None or result.comparison is None:
        return None
    c = result.comparison
    return RefitResult(
        result.n_labels, result.surface, result.version, result.activated, c.auc_model.value, c.ece_model.value,
        c.auc_rules.value, c.ece_rules.value, result.run_id, result.reason,
    )  # fmt: skip


def experiment_sycophancy(settings: Settings, *, experiment: str = "", surface: str = PRIOR_SURFACE) -> SycophancyCheck:
    """The sycophancy check (`flywheel.sycophancy`) of an experiment's challenger against its champion, from the
    lake: each arm's replies of `surface` and their votes (events), and their rewards of the surface's active
    version (the rewards table's current revisions)."""
    lf = EVENTS.scan(EVENTS.at(settings.lake_root))
    if lf is None:
        return sycophancy_check([], [])
    topic = pl.col("kafka_topic")
    events = (
        lf.filter((topic.is_null() | (topic == settings.events_topic)) & pl.col("type").is_in(["generation", "thumbs"]))
        .select("event_id", "type", "generation_id", "user_id", "ts", "properties")
        .collect()
        .unique("event_id", keep="first", maintain_order=True)
    )
    version = DefinitionStore(settings, redis_client(settings)).active_version(surface)
    rewards = read_rewards(REWARDS.at(settings.lake_root), latest_only=True)
    reward_of: dict[str, float] = {}
    if not rewards.is_empty():
        mine = rewards.filter(pl.col("reward_version") == version)
        reward_of = dict(zip(mine["generation_id"].to_list(), mine["reward"].to_list(), strict=True))
    arms = arm_replies(events, reward_of, surface=surface, experiment=experiment)
    return sycophancy_check(arms.get("champion", []), arms.get("challenger", []))


# The feedback a chat definition reads; the rest of a busy lake (code completion's retention checks) is not loaded.
_READ_TYPES = ("generation", "followup", "thumbs", "copied", "regenerated")


def reactions_from_lake(settings: Settings, surface: str) -> list[Reacted]:
    """The surface's generations in the lake (the rows the batch recompute reads: from the events topic, or
    written without one) with their feedback inside the surface's window, grouped by session (the generation
    itself when it has none)."""
    lf = EVENTS.scan(EVENTS.at(settings.lake_root))
    if lf is None:
        return []
    topic = pl.col("kafka_topic")
    frame = (
        lf.filter((topic.is_null() | (topic == settings.events_topic)) & pl.col("type").is_in(_READ_TYPES))
        .select("event_id", "type", "generation_id", "user_id", "session_id", "ts", "properties")
        .collect()
        .unique("event_id", keep="first", maintain_order=True)
    )
    named = pl.col("properties").str.json_path_match("$.surface").fill_null("").replace("", DEFAULT_SURFACE)
    gens = frame.filter((pl.col("type") == "generation") & (named == surface))
    frame = frame.filter(pl.col("generation_id").is_in(gens["generation_id"].implode()))
    return reactions_from_rows(frame.iter_rows(named=True), surface, settings.window_for(surface))


def reactions_from_rows(rows: Iterable[dict[str, object]], surface: str, window_s: float) -> list[Reacted]:
    gens: dict[str, tuple[GenerationInfo, str]] = {}
    feedback: dict[str, list[FeedbackEvent]] = {}
    for r in rows:
        props = json.loads(str(r["properties"] or "{}"))
        gid, ts = str(r["generation_id"]), to_us(r["ts"])  # type: ignore[arg-type]
        if r["type"] == "generation":
            if surface_of(str(props.get("surface") or "code-completion")) == surface:
                info = GenerationInfo.from_properties(gid, ts, str(r["user_id"]), props)
                gens[gid] = (info, str(r.get("session_id") or "") or gid)
        else:
            feedback.setdefault(gid, []).append(FeedbackEvent(str(r["event_id"]), str(r["type"]), ts, props))
    window_us = int(window_s * 1e6)
    out = []
    for gid in sorted(gens):
        info, group = gens[gid]
        evs = tuple(e for e in feedback.get(gid, []) if e.ts_us <= info.ts_us + window_us)
        out.append(Reacted(info, evs, group))
    return out


def _log_to_mlflow(
    settings: Settings, config: SignalsConfig, fit: ChatFit, cmp: Comparison, activated: bool, reason: str,
    with_prior: bool,
) -> str:  # fmt: skip
    import mlflow

    configure_mlflow(settings)
    if mlflow.get_experiment_by_name(config.mlflow_experiment) is None:
        mlflow.create_experiment(config.mlflow_experiment, artifact_location=experiment_artifact_location(settings))
    mlflow.set_experiment(config.mlflow_experiment)
    spec = fit.definition.to_spec()
    with mlflow.start_run(run_name=f"chat-reward-{spec['version']}") as run:
        mlflow.log_params({
            "reward_version": spec["version"], "surface": spec["surface"], "n_labels": fit.n_labels,
            "n_train": fit.n_train, "n_test": fit.n_test, "activated": activated, "with_prior": with_prior,
            "hashing": json.dumps(HASHING.to_json()), "l2": L2, "auc_margin": config.auc_margin,
        })  # fmt: skip
        mlflow.set_tag("decision", reason)
        mlflow.log_metrics({k: v for k, v in cmp.metrics().items() if np.isfinite(v)})
        mlflow.log_dict(spec, "reward_definition.json")
        return str(run.info.run_id)
