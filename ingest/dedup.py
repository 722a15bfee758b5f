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

# The batch travels as three strings rather than 2n arguments: redis-py packs and parses
# every argument and reply element in Python (~20 us an event), a few long strings cost
# next to nothing. ARGV: ttl, key prefix, the event ids concatenated (UTF-8), their byte
# lengths ("3,12,..."), the positions joined by newlines (topic names hold no newline).
# The answer is one string, one digit (a `Claim`) per event. The keys are built inside
# the script, which standalone Redis allows (a cluster would refuse cross-slot batches anyway).
_CLAIM = """
local ttl, prefix, ids = ARGV[1], ARGV[2], ARGV[3]
local positions = {}
for position in string.gmatch(ARGV[5], "[^\\n]+") do
  positions[#positions + 1] = position
end
local out, start, i = {}, 1, 0
for len in string.gmatch(ARGV[4], "%d+") do
  i = i + 1
  local stop = start + tonumber(len)
  local key = prefix .. string.sub(ids, start, stop - 1)
  start = stop
  local position = positions[i]
  if redis.call('SET', key, position, 'NX', 'EX', ttl) then
    out[i] = '0'
  elseif redis.call('GET', key) == position then
    out[i] = '1'
  else
    out[i] = '2'
  end
end
return table.concat(out)
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

    def claim(self, items: Sequence[tuple[str, str]], chunk: int = 50_000) -> list[Claim]:
        out: list[Claim] = []
        for start in range(0, len(items), chunk):
            part = items[start : start + chunk]
            ids = [event_id.encode() for event_id, _ in part]
            answer = self._script(
                keys=[],
                args=[
                    self._ttl_s,
                    self._prefix,
                    b"".join(ids),
                    ",".join([str(len(i)) for i in ids]),
                    "\n".join([position for _, position in part]),
                ],
            )
            out.extend([_CLAIMS[digit] for digit in answer])
        return out


# One reply character -> Claim, whether the client decodes replies (str) or not (bytes).
_CLAIMS: dict[int | str, Claim] = {**{str(int(c)): c for c in Claim}, **{ord(str(int(c))): c for c in Claim}}
