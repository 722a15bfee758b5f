"""What the offline gates read from the lake: the champion's signed, rewarded traffic and recent prompts.

Only generations serving signed (`flywheel.signing`) count, as for training: their token ids and
behaviour log-probs are what the champion really did, so the importance weights of the off-policy
estimate are about the champion and nobody's forgery. A generation is used when its signature
verifies, it was served by the champion, and it was sampled at temperature 1 (the logged
log-probs are the untempered policy's).
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from flywheel.contract import GenerationRecord
from flywheel.holdout import in_holdout
from flywheel.lake.tables import EVENTS, REWARDS, generation_events
from flywheel.reward_versions import describe, versions_to_read
from flywheel.settings import Settings
from flywheel.signing import check_generation


@dataclass(frozen=True)
class LoggedSample:
    """One signed generation of the champion with its current reward."""

    generation_id: str
    record: GenerationRecord
    reward: float


@dataclass(frozen=True)
class LoggedTraffic:
    samples: list[LoggedSample]
    reward_version: str | None
    untrusted: int  # rewarded generations left out: unsigned, forged, or not the champion's


def champion_traffic(settings: Settings, champion: str, reward_version: str, limit: int) -> LoggedTraffic:
    """The newest `limit` rewarded generations the champion served, signed, at temperature 1."""
    rewards = REWARDS.scan(REWARDS.at(settings.lake_root))
    if rewards is None:
        return LoggedTraffic([], None, 0)
    versions = [reward_version] if reward_version else versions_to_read(settings.lake_root, rewards)
    if not versions:
        return LoggedTraffic([], None, 0)
    version = describe(versions)
    latest = (
        REWARDS.latest(
            rewards.filter(pl.col("reward_version").is_in(versions) & (pl.col("model_version") == champion))
        )
        .sort("emitted_at", descending=True)
        .head(limit)
        .select("generation_id", "reward")
        .collect()
    )
    reward_of = dict(zip(latest["generation_id"], latest["reward"], strict=True))
    records = _signed_generations(settings, list(reward_of))
    samples = [
        LoggedSample(gid, rec, float(reward_of[gid]))
        for gid, rec in sorted(records.items())
        if rec.model_version == champion and rec.temperature == 1.0 and rec.completion_token_ids
    ]
    return LoggedTraffic(samples, version, len(reward_of) - len(samples))


def recent_prompts(settings: Settings, limit: int) -> list[str]:
    """Up to `limit` distinct prompts of the most recent signed generations (newest first)."""
    if limit == 0:
        return []
    events = EVENTS.scan(EVENTS.at(settings.lake_root))
    if events is None:
        return []
    recent = (
        events.filter(pl.col("type") == "generation")
        .sort("ts", descending=True)
        .head(limit * 4)  # room for unsigned ones and repeats
        .select("generation_id", "user_id", "properties")
        .collect()
    )
    key = settings.serving_key.get_secret_value()
    prompts: list[str] = []
    for gid, user, properties in recent.iter_rows():
        record = _parse(properties)
        if record is None or check_generation(key, gid, user or "", record) is not None:
            continue
        if record.prompt.strip() and record.prompt not in prompts:
            prompts.append(record.prompt)
        if len(prompts) == limit:
            break
    return prompts



def product_texts(settings: Settings, limit: int, holdout_share: float | None) -> list[str]:
    """Up to `limit` distinct texts of the product's own signed, rewarded traffic (newest first) for the
    language-model gate: the prompt context, followed by the completion where its user kept it (reward > 0).

    Only prompts the candidate never trained on: with `holdout_share` > 0, those in the trainer's holdout
    (`flywheel.holdout.in_holdout`, the same rule as the off-policy estimate's); None for a candidate that
    trained on no traffic (all of it is unseen); 0 (a trained candidate whose trainer held nothing out): none,
    since a training term on logged contexts would make its loss there optimistic."""
    if limit == 0 or holdout_share == 0:
        return []
    rewards = REWARDS.scan(REWARDS.at(settings.lake_root))
    if rewards is None:
        return []
    versions = versions_to_read(settings.lake_root, rewards)
    if not versions:
        return []
    latest = (
        REWARDS.latest(rewards.filter(pl.col("reward_version").is_in(versions)))
        .sort("emitted_at", descending=True)
        .head(limit * 8 if holdout_share is None else int(limit * 8 / max(holdout_share, 0.05)))  # room for the holdout
        .select("generation_id", "reward")
        .collect()
    )
    reward_of = dict(zip(latest["generation_id"], latest["reward"], strict=True))
    key = settings.serving_key.get_secret_value()
    logged = generation_events(EVENTS.at(settings.lake_root), list(reward_of))
    texts: list[str] = []
    for gid in latest["generation_id"]:  # newest first
        for properties, user in logged.get(gid, []):
            record = _parse(properties)
            if record is None or check_generation(key, gid, user or "", record) is not None:
                continue
            if holdout_share is not None and not in_holdout(record.prompt, holdout_share):
                break
            kept = float(reward_of[gid]) > 0 and record.completion.strip()
            text = record.prompt + (record.completion if kept else "")
            if text.strip() and text not in texts:
                texts.append(text)
            break
        if len(texts) == limit:
            break
    return texts


def _signed_generations(settings: Settings, generation_ids: list[str]) -> dict[str, GenerationRecord]:
    """generation id -> the first logged record of it whose signature verifies."""
    key = settings.serving_key.get_secret_value()
    found: dict[str, GenerationRecord] = {}
    for gid, logged in generation_events(EVENTS.at(settings.lake_root), generation_ids).items():
        for properties, user in logged:
            record = _parse(properties)
            # Text-only records (a product's own model) carry no behaviour log-probs to weigh by.
            if record is not None and not record.text_only and check_generation(key, gid, user or "", record) is None:
                found[gid] = record
                break
    return found


def _parse(properties: str) -> GenerationRecord | None:
    try:
        return GenerationRecord.model_validate_json(properties)
    except ValueError:
        return None
