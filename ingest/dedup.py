"""De-duplication by `event_id` across batches, workers and restarts (Redis).

Each accepted event claims its id in Redis *before* the lake write, with the Kafka
position of the record that carries it as the value (`SET NX EX`, one Lua call per
batch). A later claim of the same id answers:

- `NEW`: first time seen, write it;
- `REDELIVERED`: claimed by this very record before (a crash or a rebalance replayed
  it): it is in the lake only if the write finished, so the caller checks the lake;
- `DUPLICATE`: another record carried this id: drop it.

Claiming first and checking the lake for redeliveries is what makes the lake exactly
once: a crash between the claim and the write cannot lose the event, and a crash
after the write cannot duplicate it. Claims expire after `ttl_s`: duplicates further
apart than that are not recognised.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import redis

_CLAIM = """
local ttl = ARGV[1]
local out = {}
for i, key in ipairs(KEYS) do
  local position = ARGV[i + 1]
  if redis.call('SET', key, position, 'NX', 'EX', ttl) then
    out[i] = 0
  elseif redis.call('GET', key) == position then
    out[i] = 1
  else
    out[i] = 2
  end
end
return out
"""


class Claim(IntEnum):
    NEW = 0
    REDELIVERED = 1
    DUPLICATE = 2


class EventIdLedger:
    """`claim([(event_id, position), ...]) -> [Claim, ...]`, one round trip per call."""

    def __init__(self, client: redis.Redis, prefix: str, ttl_s: int = 7 * 24 * 3600) -> None:
        self._client = client
        self._prefix = f"{prefix}ingest:event:"
        self._ttl_s = ttl_s
        self._script = client.register_script(_CLAIM)

    def claim(self, items: Sequence[tuple[str, str]], chunk: int = 10_000) -> list[Claim]:
        out: list[Claim] = []
        for start in range(0, len(items), chunk):
            part = items[start : start + chunk]
            keys = [self._prefix + event_id for event_id, _ in part]
            answers = self._script(keys=keys, args=[self._ttl_s, *(pos for _, pos in part)])
            out.extend(Claim(int(a)) for a in answers)
        return out
