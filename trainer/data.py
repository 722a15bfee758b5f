"""What a cycle trains on: rewards since the watermark joined with their generation records.

Read with polars from the lake (`flywheel.lake.tables`), one version of each table, named in the
window (`DataWindow.lake_versions`, so the candidate's lineage says which rows it learnt from and a
cycle given those versions selects the same samples): `rewards` (latest revision per generation
of the active reward version of each surface, `flywheel.reward_versions`, or `config.reward_version`)
joined on generation_id with the `generation` events of `events`,
whose `properties` JSON is the `GenerationRecord` (token ids, behaviour log-probs, model version).
Eligibility is applied here, before anything reaches the model:
- consent: only users whose latest event carrying `config.consent_property` set it true, latest by
  arrival (a client's clock cannot outrank a revocation; see `_consenting_users`);
- quarantine: nothing served by a version the gate quarantined;
- provenance: only generations serving signed (flywheel.signing) are learned from off-policy; a
  generation anyone else posted (a product's own model, or a forgery through the collector with a
  write key) may still be scored by signals, but its token ids and log-probs never reach an
  objective. When several generation events share an id, the first one that verifies is used, so
  an unsigned copy posted first cannot hide serving's own;
- text: a text-only generation (no token ids or log-probs: a product's own model) and an unsigned
  one are left out with their reason, unless `config.text_generations` is on (which needs an
  objective without behaviour log-probs, "kto" or "rwl"): their prompt and completion text are then
  tokenised by the current policy (trainer/retokenize.py) and the sample has no behaviour log-probs.
  A generation whose signature fails is never used, not even as text: it claims to be serving's;
- scrubbing: a completion containing secrets or personal data is dropped (we must not teach the
  policy to emit it; its tokens cannot be edited without voiding the behaviour log-probs); a prompt
  containing them is redacted and re-tokenised, and left out of the mismatch report.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import cast

import polars as pl

from flywheel.contract import DataWindow, GenerationRecord
from flywheel.holdout import in_holdout
from flywheel.lake.tables import EVENTS, REWARDS, generation_events
from flywheel.reward_versions import describe as describe_versions
from flywheel.reward_versions import versions_to_read
from flywheel.settings import Settings
from flywheel.signing import Untrusted, check_generation
from model_registry import ModelRegistry
from trainer.config import TrainerConfig
from trainer.retokenize import TextEncoder
from trainer.scrub import scrub

_TRUE = ("true", "1", "yes")
# Why a generation known only as text is left out (a `Selection.dropped` reason).
TEXT_ONLY = "text only (no token ids or log-probs): no off-policy ratio without serving's log-probs"
TEXT_KEPT = "text generations tokenised by the policy (kept, no behaviour log-probs)"


@dataclass(frozen=True)
class Sample:
    """One logged generation with its reward, ready for a training step."""

    generation_id: str
    user_id: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    behaviour_logprobs: list[float] | None  # None: known only as text; never given an importance ratio
    reward: float
    model_version: str
    emitted_at: datetime
    replay: bool = False
    prompt_redacted: bool = False

    @property
    def text_only(self) -> bool:
        """Tokenised from text by the trainer: usable only by objectives that need no behaviour log-probs."""
        return self.behaviour_logprobs is None


@dataclass
class Selection:
    """The samples of one cycle, the window they cover, and why other rows were left out."""

    samples: list[Sample]
    window: DataWindow | None
    reward_rows: int = 0
    dropped: Counter[str] = field(default_factory=Counter)

    def describe_drops(self) -> str:
        return ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items())) or "none"

    def drop_metrics(self) -> dict[str, float]:
        """One metric per reason rows were left out, e.g. `left_out_unsigned_not_logged_by_serving`."""
        return {f"left_out_{_slug(why)}": float(n) for why, n in self.dropped.items()}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def over_cap_reason(config: TrainerConfig) -> str:
    """The `Selection.dropped` reason of samples left out by the `max_samples` cap: says the rule."""
    return f"over max_samples={config.max_samples}, left out by seeded reservoir sampling (uniform, seed {config.seed})"


def quarantined_versions(registry: ModelRegistry) -> set[str]:
    """Versions whose served data is never trained on: quarantined by the gate when rolled back."""
    return {v.version for v in registry.versions() if v.gate_state == "quarantined"}


def load_selection(
    settings: Settings,
    config: TrainerConfig,
    *,
    watermark: datetime | None,
    quarantined: set[str],
    encode_prompt: Callable[[str], list[int]],
    encode_text: TextEncoder | None = None,
    lake_versions: dict[str, int] | None = None,
) -> Selection:
    """Eligible samples whose reward was emitted after `watermark` (plus an optional replay share), read from
    `lake_versions` ({"rewards": v, "events": v}; default: each table's newest version).

    `encode_text` tokenises text-only and unsigned generations; needed when `config.text_generations` is on."""
    if config.text_generations and encode_text is None:
        raise ValueError("config.text_generations needs encode_text (trainer.retokenize.text_encoder)")
    lake = settings.lake_root
    pinned = dict(lake_versions or {})
    for table in (REWARDS, EVENTS):
        version = pinned.get(table.name, table.version(table.at(lake)))
        if version is None:
            return Selection(samples=[], window=None)
        pinned[table.name] = version
    rewards = REWARDS.scan(REWARDS.at(lake), pinned[REWARDS.name])
    if rewards is None:
        return Selection(samples=[], window=None)
    versions = [config.reward_version] if config.reward_version else versions_to_read(settings.lake_root, rewards)
    if not versions:
        return Selection(samples=[], window=None)
    reward_version = describe_versions(versions)  # said in the data window, so in the lineage
    latest = (
        REWARDS.latest(rewards.filter(pl.col("reward_version").is_in(versions)))
        .select("generation_id", "reward", "user_id", "emitted_at")
        .collect()
    )
    is_new = pl.lit(True) if watermark is None else pl.col("emitted_at") > watermark
    new = latest.filter(is_new)
    if new.is_empty():
        return Selection(samples=[], window=None)
    end = cast(datetime, new["emitted_at"].max())  # a Datetime column, and `new` is not empty
    old = latest.filter(~is_new)
    rows = new.with_columns(pl.lit(False).alias("replay"))
    if config.replay_fraction > 0 and not old.is_empty():
        k = min(old.height, int(round(config.replay_fraction * new.height)))
        picked = sorted(random.Random(config.seed).sample(range(old.height), k))
        rows = pl.concat([rows, old[picked].with_columns(pl.lit(True).alias("replay"))])

    selection = Selection(samples=[], window=None, reward_rows=new.height)
    events_at, events_version = EVENTS.at(lake), pinned[EVENTS.name]
    generations = generation_events(events_at, rows["generation_id"].to_list(), events_version)
    consenting = _consenting_users(events_at, events_version, config) if config.require_consent else None
    key = settings.serving_key.get_secret_value()
    samples = []
    held_out: set[str] = set()  # generation ids whose prompt is in the off-policy holdout (flywheel.holdout)
    for row in rows.sort("emitted_at").iter_rows(named=True):
        found = _trusted_generation(row["generation_id"], generations.get(row["generation_id"], []), key)
        if isinstance(found, str):
            selection.dropped[found] += 1
            continue
        record, event_user, trusted = found
        if not trusted and not config.text_generations:
            selection.dropped[TEXT_ONLY if record.text_only else Untrusted.UNSIGNED.value] += 1
            continue
        sample = _eligible(row, record, event_user, config, quarantined, consenting, encode_prompt,
                           selection.dropped, None if trusted else encode_text)  # fmt: skip
        if sample is not None:
            samples.append(sample)
            if in_holdout(record.prompt, config.ope_holdout_share):
                held_out.add(sample.generation_id)
    if held_out:
        kept = [s for s in samples if s.generation_id not in held_out]
        if len(kept) < len(samples):
            why = f"held out for the offline gate's estimate (share {config.ope_holdout_share:g} by prompt hash)"
            selection.dropped[why] += len(samples) - len(kept)
        samples = kept
    if config.max_samples and len(samples) > config.max_samples:
        # Uniform over the window, not the newest N: every user and every hour of it keeps its share.
        selection.dropped[over_cap_reason(config)] += len(samples) - config.max_samples
        samples = random.Random(config.seed).sample(samples, config.max_samples)
    samples.sort(key=lambda s: s.generation_id)  # same order on every process and every run
    ids = "\n".join(s.generation_id for s in samples).encode()
    selection.samples = samples
    selection.window = DataWindow(
        start=watermark,
        end=end,
        reward_version=reward_version,
        generation_ids_sha256=hashlib.sha256(ids).hexdigest(),
        lake_versions=pinned,
    )
    return selection






def _trusted_generation(
    generation_id: str, candidates: list[tuple[str, str]], key: str
) -> tuple[GenerationRecord, str, bool] | str:
    """(record, user, True) for the first candidate serving signed; else (record, user, False) for the first
    unsigned one (text only, or token ids nobody vouches for: usable only as text); else why the generation
    is left out."""
    if not candidates:
        return "without a generation event"
    reasons = []
    unsigned: tuple[GenerationRecord, str, bool] | None = None
    for properties, user in candidates:
        try:
            record = GenerationRecord.model_validate_json(properties)
        except ValueError:
            reasons.append("with an unreadable generation record")
            continue
        untrusted = check_generation(key, generation_id, user, record)
        if untrusted is None:
            return record, user, True
        if untrusted == Untrusted.UNSIGNED and unsigned is None:
            unsigned = (record, user, False)
        reasons.append(untrusted.value)
    # A copy whose signature fails says more (tampering) than one that was never signed.
    worst = [r for r in reasons if r != Untrusted.UNSIGNED]
    if worst:
        return worst[0]
    return unsigned if unsigned is not None else reasons[0]


# How far ahead of its arrival a grant's own time may be and still count (clock skew; a grant dated later was
# not stated when it claims, and a future date is how one would try to outrank a later revocation).
CONSENT_CLOCK_SKEW = timedelta(minutes=5)


def _consenting_users(table: str, version: int, config: TrainerConfig) -> set[str]:
    """Users whose latest statement of `consent_property` (any event type) is true, ordered by arrival
    (`received_at`, the collector's clock, never a client's `ts`); at the same arrival a revocation wins; a
    grant dated more than `CONSENT_CLOCK_SKEW` after its arrival does not count, a revocation always does."""
    events = EVENTS.scan(table, version)
    if events is None:
        return set()
    # A JSONPath key in brackets: property names may contain dots or dashes.
    path = f"$['{config.consent_property}']"
    grant = pl.col("consent").str.strip_chars().str.to_lowercase().is_in(list(_TRUE))
    latest = (
        events.select(
            "user_id", "ts", "received_at", pl.col("properties").str.json_path_match(path).alias("consent")
        )
        .filter(pl.col("consent").is_not_null())
        .with_columns(grant.alias("grant"))
        .filter(~pl.col("grant") | (pl.col("ts") <= pl.col("received_at") + CONSENT_CLOCK_SKEW))
        # last by arrival; at one arrival a revocation (grant false) sorts last, so it wins
        .sort("received_at", pl.col("grant").not_())
        .group_by("user_id")
        .last()
        .collect()
    )
    return {u for u, g in zip(latest["user_id"], latest["grant"], strict=True) if g}


def _eligible(
    row: dict,
    record: GenerationRecord,
    event_user: str,
    config: TrainerConfig,
    quarantined: set[str],
    consenting: set[str] | None,
    encode_prompt: Callable[[str], list[int]],
    dropped: Counter[str],
    encode_text: TextEncoder | None,
) -> Sample | None:
    """The sample of one reward row, or None (counted in `dropped`); `encode_text` given: the record is
    used as text only, tokenised by the policy, without behaviour log-probs."""
    user = event_user or row["user_id"] or ""
    if consenting is not None and user not in consenting:
        dropped["without consent"] += 1
        return None
    if record.model_version in quarantined:
        dropped["from quarantined versions"] += 1
        return None
    if encode_text is None and record.temperature != 1.0:
        # Serving logs log-probs of the untempered policy; a sample drawn at another temperature
        # came from a different behaviour distribution, so its importance ratio would be wrong.
        dropped["sampled at a temperature other than 1"] += 1
        return None
    if scrub(record.completion)[1]:
        dropped["with secrets or personal data in the completion"] += 1
        return None
    clean_prompt, found = scrub(record.prompt)
    if encode_text is not None or record.completion_token_ids is None or record.prompt_token_ids is None:
        if encode_text is None:  # unreachable by construction (text-only records are never trusted)
            dropped[TEXT_ONLY] += 1
            return None
        encoded = encode_text(clean_prompt, record.completion, record.finish_reason, record.surface)
        if encoded is None:
            dropped["text generations longer than the policy's context"] += 1
            return None
        prompt_ids, completion_ids = encoded
        behaviour: list[float] | None = None
        dropped[TEXT_KEPT] += 1
    else:
        prompt_ids, completion_ids = record.prompt_token_ids, record.completion_token_ids
        behaviour = record.behaviour_logprobs
        if found:
            prompt_ids = encode_prompt(clean_prompt)
    if found:
        dropped["prompts redacted (kept)"] += 1
    if not prompt_ids:
        dropped["with an empty prompt"] += 1
        return None
    return Sample(
        generation_id=row["generation_id"],
        user_id=user,
        prompt_token_ids=prompt_ids,
        completion_token_ids=completion_ids,
        behaviour_logprobs=behaviour,
        reward=float(row["reward"]),
        model_version=record.model_version,
        emitted_at=row["emitted_at"],
        replay=bool(row["replay"]),
        prompt_redacted=bool(found),
    )
