"""The traffic split in Redis: the deploy gate writes it, serving reads it.

Every change is also published on `channel`, so serving swaps at once instead of at its next poll.
"""

from __future__ import annotations

import redis

from flywheel.contract import TrafficSplit
from flywheel.settings import Settings


class TrafficSplitStore:
    """Current split under one key, with every change appended to a history list."""

    def __init__(self, client: redis.Redis, settings: Settings, experiment: str = "default") -> None:
        self._r = client
        self._key = f"{settings.redis_prefix}traffic_split:{experiment}"
        self._history = f"{self._key}:history"
        self.channel = f"{self._key}:changed"

    def get(self) -> TrafficSplit | None:
        raw = self._r.get(self._key)
        return TrafficSplit.model_validate_json(raw) if raw else None

    def put(self, split: TrafficSplit) -> None:
        data = split.model_dump_json()
        pipe = self._r.pipeline(transaction=True)
        pipe.set(self._key, data)
        pipe.lpush(self._history, data)
        pipe.ltrim(self._history, 0, 999)
        pipe.publish(self.channel, data)
        pipe.execute()

    def history(self, limit: int = 100) -> list[TrafficSplit]:
        return [TrafficSplit.model_validate_json(x) for x in self._r.lrange(self._history, 0, limit - 1)]
