"""Where reward definitions live: every version ever used, and which one is active per surface.

Redis holds the definitions for the workers (hash `<prefix>signals:definitions`); each is also written as
JSON beside the lake's tables, on the same store (`<lake root>/reward_definitions/<version>.json`, a folder
or object storage: `flywheel.lake.files`) so a recompute can find a version after Redis is gone. Which
version is active for each product surface is the lake's pointer file (`flywheel.reward_versions`), the one
place the trainer and the deploy gate read too: activating a version is the only thing that changes what
they read. The built-in rules of every surface (`rules-v1` for code completion, `chat-rules-v1`, and
`<surface>-rules-v1` for any surface a product names itself) always exist, stored or not; a surface with no
pointer yet uses its built-in rules, and the worker adds it to the pointer (`adopt_all`: a micro-batch's new
surfaces in one write, before its records go out) the first time one of its generations comes, so every reader
counts its rewards from the first record on.
"""

from __future__ import annotations

import json
from typing import cast

import redis

from flywheel.lake import files
from flywheel.lake.tables import REWARD_DEFINITIONS_PATH
from flywheel.reward_versions import read_active, surface_of, write_active
from flywheel.settings import Settings
from signals.reward import (
    BUILTIN_SURFACES,
    DEFAULT_DEFINITION,
    RewardDefinition,
    builtin_definition,
    builtin_for_version,
)


class UnknownRewardVersion(KeyError):
    def __str__(self) -> str:
        return f"no reward definition {self.args[0]!r}; list them with `flywheel signals definitions`"


class DefinitionStore:
    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self._r = client
        self._lake = settings.lake_root
        self._hash = f"{settings.redis_prefix}signals:definitions"
        builtins = [builtin_definition(s) for s in BUILTIN_SURFACES]
        self._cache: dict[str, RewardDefinition] = {d.version: d for d in builtins}

    def put(self, definition: RewardDefinition) -> None:
        """Store a new version. A version is immutable: storing a different spec under it is refused."""
        spec = json.dumps(definition.to_spec(), sort_keys=True)
        builtin = builtin_definition(definition.surface)
        if definition.version == builtin.version and definition != builtin:
            raise ValueError(f"{definition.version} is built in; give your definition a new version")
        if definition.version == DEFAULT_DEFINITION.version and definition != DEFAULT_DEFINITION:
            raise ValueError(f"{definition.version} is built in; give your definition a new version")
        # The client is made without decode_responses, so replies are bytes (the stubs say bytes | str).
        existing = cast(bytes | None, self._r.hget(self._hash, definition.version))
        if existing is not None and existing.decode() != spec:
            raise ValueError(
                f"reward version {definition.version} already exists with another spec; pick a new version"
            )
        files.write_bytes(self._lake, REWARD_DEFINITIONS_PATH, f"{definition.version}.json", data=spec.encode())
        self._r.hset(self._hash, definition.version, spec)
        self._cache[definition.version] = definition

    def get(self, version: str) -> RewardDefinition:
        if version in self._cache:
            return self._cache[version]
        builtin = builtin_for_version(version)
        if builtin is not None:
            self._cache[version] = builtin
            return builtin
        raw = self._r.hget(self._hash, version)
        if raw is None:
            raw = files.read_bytes(self._lake, REWARD_DEFINITIONS_PATH, f"{version}.json")
        if raw is None:
            raise UnknownRewardVersion(version)
        definition = RewardDefinition.from_spec(json.loads(raw))
        self._cache[version] = definition
        return definition

    def versions(self) -> list[str]:
        stored = {k.decode() for k in cast(list[bytes], self._r.hkeys(self._hash))}
        stored |= {n.removesuffix(".json") for n in files.names(self._lake, REWARD_DEFINITIONS_PATH, suffix=".json")}
        stored.discard("active")
        active = self.active_map()  # the built-in surfaces and every surface in the pointer
        return sorted(stored | set(active.values()) | {builtin_definition(s).version for s in active})

    def active_map(self) -> dict[str, str]:
        """`{surface: active version}` for every surface with a pointer or a built-in."""
        active = {s: builtin_definition(s).version for s in BUILTIN_SURFACES}
        active.update(read_active(self._lake) or {})
        return active

    def ensure_pointer(self) -> None:
        """Write the pointer if this lake has none yet, so readers follow it from the first record on
        (rather than falling back to the version written last, which a backfill could change)."""
        if read_active(self._lake) is None:
            write_active(self._lake, self.active_map())

    def adopt(self, surface: str) -> str:
        """Pin `surface`'s built-in rules in the pointer if it has no active version yet; returns its version.
        (Read-modify-write of the pointer: two workers adopting two new surfaces at once may lose one write;
        the loser adopts again at its next generation of that surface, as its re-read shows the gap.)"""
        surface = surface_of(surface)
        active = read_active(self._lake) or self.active_map()
        if surface not in active:
            active[surface] = builtin_definition(surface).version
            write_active(self._lake, active)
        return active[surface]

    def adopt_all(self, surfaces: dict[str, str]) -> None:
        """`adopt` for several surfaces `{surface: version}` at once: one read and at most one write of the pointer
        (the worker adopts a micro-batch's new surfaces together). A surface the pointer already names keeps its
        version."""
        active = read_active(self._lake) or self.active_map()
        missing = {s: v for s, v in surfaces.items() if s not in active}
        if missing:
            write_active(self._lake, {**active, **missing})

    def active_version(self, surface: str) -> str:
        return self.active_map().get(surface_of(surface)) or builtin_definition(surface).version

    def active(self, surface: str) -> RewardDefinition:
        version = self.active_version(surface)
        if version == builtin_definition(surface).version:
            return builtin_definition(surface)
        return self.get(version)

    def set_active(self, version: str) -> str:
        """Make `version` active for its own surface; returns that surface."""
        definition = self.get(version)  # refuse unknown versions
        active = self.active_map()
        active[definition.surface] = version
        write_active(self._lake, active)
        return definition.surface
