"""Simulated users for rollout tests: routed by the real split, their generations and rewards in the lake.

Each batch brings new users (each with a few generations) at the controller's clock time; the
split in Redis decides each user's arm (`TrafficSplit.arm_for`, as serving routes), and a
behaviour per arm decides the rewards and signals.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import polars as pl

from flywheel.contract import TrafficSplit
from flywheel.lake.tables import EVENTS, REWARDS
from flywheel.settings import Settings


@dataclass(frozen=True)
class Behaviour:
    """How an arm's users fare: P(a shown suggestion is accepted), and the implicit signals around it.

    Rewards follow the rules definition's Cursor Tab weights: +0.75 for an accept, -0.25 for a
    reject, 0 for what was not shown, so declining where users would reject raises the reward.
    """

    p_good: float = 0.5  # P(a shown suggestion is accepted)
    shown: float = 1.0  # P(the suggestion is shown); not shown -> declined, reward 0
    blank: bool = False  # what is not shown is a blank output (finish_reason "stop") instead of a decline
    undo: float = 0.05  # P(an accept is undone)
    thumbs: float = 0.2  # P(a user votes explicitly)
    latency_ms: float = 50.0


Drop = Callable[[str, str], bool]  # (arm, user) -> drop this user's rows (a broken logging path)


def write_batch(
    settings: Settings,
    split: TrafficSplit,
    behaviours: dict[str, Behaviour],
    *,
    users: int,
    at: datetime,
    rng: random.Random,
    generations: int = 3,
    drop: Drop | None = None,
    user_ids: list[str] | None = None,
) -> dict[str, int]:
    """Write `users` new users' generations and rewards; returns users per arm."""
    events, rewards, counts = [], [], {"champion": 0, "challenger": 0, "holdout": 0}
    # Every id is drawn from `rng`, so a seeded test writes the same users, generations and files each run
    # (the users' arms, a hash of their ids, with them).
    ids = user_ids or [f"u-{rng.getrandbits(40):010x}" for _ in range(users)]
    for user in ids:
        arm = split.arm_for(user)
        if drop is not None and drop(arm, user):
            continue
        counts[arm] += 1
        b = behaviours[arm]
        version = split.version_for(arm)
        for g in range(generations):
            ts = at + timedelta(seconds=g)
            gid = f"gen-{rng.getrandbits(128):032x}"
            shown = rng.random() < b.shown
            good = rng.random() < b.p_good
            signals: dict[str, float] = {}
            if shown:
                signals["shown"] = 1.0
                signals["accepted" if good else "rejected"] = 1.0
                reward = 0.75 if good else -0.25
                if good and rng.random() < b.undo:
                    signals["undone"] = 1.0
                    reward = -0.1
                label = "implicit"
                if rng.random() < b.thumbs:
                    signals["thumbs"] = 1.0 if good else -1.0
                    reward, label = signals["thumbs"], "explicit"
            else:
                reward, label = 0.0, "default"
            props = {"arm": arm, "model_version": version, "latency_ms": b.latency_ms * (0.8 + 0.4 * rng.random()),
                     "completion": " x = 1\n" if shown else "",
                     "finish_reason": "stop" if shown or b.blank else "declined"}
            events.append({"event_id": gid + "-e", "type": "generation", "schema_version": 1, "generation_id": gid,
                           "user_id": user, "session_id": "", "ts": ts, "received_at": ts, "source": "serving",
                           "properties": json.dumps(props), "kafka_topic": "t", "kafka_partition": 0,
                           "kafka_offset": 0})
            rewards.append({"generation_id": gid, "reward_version": "rules-v1", "revision": 0, "reward": reward,
                            "confidence": 1.0, "label_source": label, "signals": json.dumps(signals, sort_keys=True),
                            "user_id": user, "model_version": version, "arm": arm, "experiment": split.experiment,
                            "window_start": ts, "window_end": ts, "late_events": 0, "emitted_at": ts})
    name = f"sim-{rng.getrandbits(32):08x}"
    if events:
        EVENTS.write(EVENTS.at(settings.lake_root), pl.DataFrame(events, schema=EVENTS.schema), name)
        REWARDS.write(REWARDS.at(settings.lake_root), pl.DataFrame(rewards, schema=REWARDS.schema), name)
    return counts
