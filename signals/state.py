"""Per-generation state in Redis, and the one atomic write that commits a batch.

Keys (all under `settings.redis_prefix`):
- `signals:gen:<generation_id>`: JSON of `GenState` (the generation, its feedback so far,
  the event ids seen, the last revision emitted), expiring `state_ttl_s` after its last change;
- `signals:open:<topic>:<partition>` (live lane) and `signals:openh:<topic>:<partition>` (historical
  lane): sorted sets of open windows scored by window end (µs);
- `signals:pending:<topic>:<partition>[h]`: generation ids that have feedback but no `generation`
  event yet, scored by the watermark at which their feedback becomes orphan;
- `signals:wm:<topic>`: hash `<partition>` (live) and `h<partition>` (historical) -> watermark (µs);
- `signals:emitted:<version>:<generation_id>:<revision>`: the emitted marker;
- `signals:outbox:<topic>:<partition>`: records committed but not yet on Kafka and in the lake.

`commit` writes states, windows, watermarks, markers and outbox in one Lua script (its argument MessagePack:
Redis unpacks a batch's plan in about 60% of the time it parses it as JSON, where each state is escaped text),
so a crash leaves either all of a batch's effects or none. A record enters the
outbox only if its marker was not already set: a record is never emitted twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import redis

from flywheel.compact_json import compact_json_encoder
from signals.events import FeedbackEvent, GenerationInfo

NOT_EMITTED = -1
# msgspec writes and reads the JSON `json` would (properties hold JSON values only), several times faster.
_encode = compact_json_encoder(msgspec.to_builtins)  # Structs, where `json.dumps` writes the text
_pack = msgspec.msgpack.Encoder().encode


@dataclass
class GenState:
    partition: int
    gen: GenerationInfo | None = None
    window_end_us: int | None = None
    events: list[FeedbackEvent] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    revision: int = NOT_EMITTED
    late: int = 0
    version: str | None = None
    lane: int = 0  # 0: live, 1: historical (its generation event arrived long after its time)
    orphaned: bool = False  # its feedback outlived any window its generation could have had
    feedback: int = 0  # distinct feedback events taken (capped at `SignalsConfig.max_feedback_per_generation`)

    def to_json(self) -> str:
        # Its generation and events are Structs msgspec writes as `GenerationInfo.to_json` and
        # `FeedbackEvent.to_json` would (same keys, same order), without building those per state.
        return _encode(
            {
                "p": self.partition,
                "g": self.gen,
                "end": self.window_end_us,
                "ev": self.events,
                "seen": sorted(self.seen),
                "rev": self.revision,
                "late": self.late,
                "ver": self.version,
                "lane": self.lane,
                "orph": self.orphaned,
                "nf": self.feedback,
            }
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> GenState:
        d = _decode_state(raw)
        return cls(
            partition=d.p,
            gen=d.g,
            window_end_us=d.end,
            events=d.ev,
            seen=set(d.seen),
            revision=d.rev,
            late=d.late,
            version=d.ver,
            lane=d.lane,
            orphaned=d.orph,
            feedback=len(d.ev) if d.nf is None else d.nf,
        )


class _Stored(msgspec.Struct, gc=False):
    """`GenState.to_json`'s object as read back (typed: its generation and events decode straight into their
    Structs); `lane`, `orph` and `nf` came later, so a state written before them reads with their defaults."""

    p: int
    g: GenerationInfo | None
    end: int | None
    ev: list[FeedbackEvent]
    seen: list[str]
    rev: int
    late: int
    ver: str | None
    lane: int = 0
    orph: bool = False
    nf: int | None = None


_decode_state = msgspec.json.Decoder(_Stored).decode


class Keys:
    def __init__(self, prefix: str, topic: str) -> None:
        self.prefix = f"{prefix}signals:"
        self.topic = topic
        self.wm = f"{self.prefix}wm:{topic}"

    def gen(self, generation_id: str) -> str:
        return f"{self.prefix}gen:{generation_id}"

    def open(self, partition: int, lane: int = 0) -> str:
        return f"{self.prefix}open{'h' if lane else ''}:{self.topic}:{partition}"

    def pending(self, partition: int, lane: int = 0) -> str:
        return f"{self.prefix}pending:{self.topic}:{partition}{'h' if lane else ''}"

    def marker(self, version: str, generation_id: str, revision: int) -> str:
        return f"{self.prefix}emitted:{version}:{generation_id}:{revision}"

    def outbox(self, partition: int) -> str:
        return f"{self.prefix}outbox:{self.topic}:{partition}"


# The plan's lists come flat (`CommitPlan.payload`): a table per state or record cost Redis more to unpack than
# the text it holds.
_COMMIT_LUA = """
local p = cmsgpack.unpack(ARGV[1])
local s, z = p.states, p.zadd
for i = 1, #s, 3 do redis.call('SET', s[i], s[i + 1], 'EX', s[i + 2]) end
for i = 1, #z, 3 do redis.call('ZADD', z[i], z[i + 2], z[i + 1]) end
z = p.zrem
for i = 1, #z, 2 do redis.call('ZREM', z[i], z[i + 1]) end
local w = p.wm
for i = 1, #w, 3 do
  local cur = redis.call('HGET', w[i], w[i + 1])
  if (not cur) or tonumber(cur) < tonumber(w[i + 2]) then redis.call('HSET', w[i], w[i + 1], w[i + 2]) end
end
local pushed = 0
for _, o in ipairs(p.outbox) do
  local recs, e = {}, o[4]
  for i = 1, #e, 2 do
    if redis.call('SET', e[i], '1', 'NX', 'EX', o[3]) then table.insert(recs, e[i + 1]) end
  end
  if #recs > 0 then
    redis.call('RPUSH', o[1], o[2] .. '\\n' .. table.concat(recs, '\\n'))
    pushed = pushed + #recs
  end
end
return pushed
"""


@dataclass
class CommitPlan:
    """Everything one batch changes in Redis."""

    states: list[tuple[str, str, int]] = field(default_factory=list)  # key, json, ttl
    zadd: list[tuple[str, str, str]] = field(default_factory=list)  # key, member, score
    zrem: list[tuple[str, str]] = field(default_factory=list)
    wm: list[tuple[str, str, str]] = field(default_factory=list)  # hash, partition, value
    # outbox key, entry id, marker ttl, [(marker key, record json)]
    outbox: list[tuple[str, str, int, list[tuple[str, str]]]] = field(default_factory=list)

    def payload(self) -> bytes:
        # A window opened and closed in the same batch: its ZADD is left out (the script runs every ZADD before
        # any ZREM, so the member ends absent either way).
        removed = set(self.zrem)
        d: dict[str, Any] = {
            "states": [x for state in self.states for x in state],
            "zadd": [x for z in self.zadd if (z[0], z[1]) not in removed for x in z],
            "zrem": [x for z in self.zrem for x in z],
            "wm": [x for w in self.wm for x in w],
            "outbox": [(key, entry, ttl, [x for p in pairs for x in p]) for key, entry, ttl, pairs in self.outbox],
        }
        return _pack(d)


class StateStore:
    def __init__(self, client: redis.Redis) -> None:
        self._r = client
        self._commit = client.register_script(_COMMIT_LUA)

    def commit(self, plan: CommitPlan) -> int:
        """Apply `plan` atomically; returns how many records entered the outbox."""
        return int(self._commit(args=[plan.payload()]))

    def load(
        self, keys: Keys, bounds: dict[tuple[int, int], int], generation_ids: set[str]
    ) -> tuple[
        dict[tuple[int, int], int],
        dict[tuple[int, int], list[tuple[int, int, str]]],
        dict[str, GenState],
    ]:
        """Watermarks per (partition, lane), what is due at or before each bound (window ends, kind 0,
        and orphan deadlines, kind 1, as (score, kind, generation id)), and the states involved."""
        pipe = self._r.pipeline(transaction=False)
        pipe.hgetall(keys.wm)
        lanes = sorted(bounds)
        for p, lane in lanes:
            pipe.zrangebyscore(keys.open(p, lane), "-inf", bounds[(p, lane)], withscores=True)
            pipe.zrangebyscore(keys.pending(p, lane), "-inf", bounds[(p, lane)], withscores=True)
        res = pipe.execute()
        wms: dict[tuple[int, int], int] = {}
        for k, v in res[0].items():
            name = k.decode()
            wms[(int(name[1:]), 1) if name.startswith("h") else (int(name), 0)] = int(v)
        due: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
        for i, key in enumerate(lanes):
            windows, pending = res[1 + 2 * i], res[2 + 2 * i]
            due[key] = [(int(s), 0, m.decode()) for m, s in windows] + [(int(s), 1, m.decode()) for m, s in pending]
        ids = sorted(generation_ids | {g for rows in due.values() for _, _, g in rows})
        states: dict[str, GenState] = {}
        if ids:
            for gid, raw in zip(ids, self._r.mget([keys.gen(g) for g in ids]), strict=True):
                if raw is not None:
                    states[gid] = GenState.from_json(raw)
        return wms, due, states

    def lower_watermarks(self, keys: Keys, ceiling_us: int) -> list[str]:
        """Lower every watermark above `ceiling_us` to it (the repair of one moved by an event's own clock);
        returns the lanes lowered. Run at start, before this worker commits anything."""
        high = {k.decode(): int(v) for k, v in cast(dict[bytes, bytes], self._r.hgetall(keys.wm)).items()}
        lowered = sorted(k for k, v in high.items() if v > ceiling_us)
        if lowered:
            self._r.hset(keys.wm, mapping={k: str(ceiling_us) for k in lowered})
        return lowered

    def outbox_entries(self, keys: Keys, partitions: Sequence[int]) -> dict[int, list[bytes]]:
        """The outbox entries of each of `partitions` that has any, oldest first (one round trip)."""
        pipe = self._r.pipeline(transaction=False)
        for p in partitions:
            pipe.lrange(keys.outbox(p), 0, -1)
        # Replies are bytes (no decode_responses); the stubs say bytes | str.
        found = zip(partitions, cast(list[list[bytes]], pipe.execute()), strict=True)
        return {p: entries for p, entries in found if entries}

    def pop_outbox(self, keys: Keys, counts: Mapping[int, int]) -> None:
        """Drop the first `counts[p]` entries of each partition's outbox, all at once (MULTI)."""
        # LTRIM, not LPOP: the entries (a batch's records) need not come back over the wire
        pipe = self._r.pipeline(transaction=True)
        for p, n in counts.items():
            pipe.ltrim(keys.outbox(p), n, -1)
        pipe.execute()
