"""Where reward definitions live: every version ever used, and which one is active.

Redis holds them for the workers (hash `<prefix>signals:definitions`, key
`<prefix>signals:active`); each is also written as JSON beside the lake
(`<lake>/reward_definitions/<version>.json`) so a recompute can find a version
after Redis is gone. The built-in `rules-v1` always exists.
"""

from __future__ import annotations

import json
from typing import cast

import redis

from flywheel.lake.tables import REWARD_DEFINITIONS_PATH
from flywheel.settings import Settings
from signals.reward import DEFAULT_DEFINITION, RewardDefinition


class UnknownRewardVersion(KeyError):
    def __str__(self) -> str:
        return f"no reward definition {self.args[0]!r}; list them with `flywheel signals definitions`"


class DefinitionStore:
    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self._r = client
        self._hash = f"{settings.redis_prefix}signals:definitions"
        self._active = f"{settings.redis_prefix}signals:active"
        self._dir = settings.lake_dir / REWARD_DEFINITIONS_PATH
        self._cache: dict[str, RewardDefinition] = {DEFAULT_DEFINITION.version: DEFAULT_DEFINITION}

    def put(self, definition: RewardDefinition) -> None:
        """Store a new version. A version is immutable: storing a different spec under it is refused."""
        spec = json.dumps(definition.to_spec(), sort_keys=True)
        # The client is made without decode_responses, so replies are bytes (the stubs say bytes | str).
        existing = cast(bytes | None, self._r.hget(self._hash, definition.version))
        if definition.version == DEFAULT_DEFINITION.version and definition != DEFAULT_DEFINITION:
            raise ValueError(f"{definition.version} is built in; give your definition a new version")
        if existing is not None and existing.decode() != spec:
            raise ValueError(
                f"reward version {definition.version} already exists with another spec; pick a new version"
            )
        self._dir.mkdir(parents=True, exist_ok=True)
        (self._dir / f"{definition.version}.json").write_text(spec)
        self._r.hset(self._hash, definition.version, spec)
        self._cache[definition.version] = definition

    def get(self, version: str) -> RewardDefinition:
        if version in self._cache:
            return self._cache[version]
        raw = self._r.hget(self._hash, version)
        path = self._dir / f"{version}.json"
        if raw is None and path.exists():
            raw = path.read_bytes()
        if raw is None:
            raise UnknownRewardVersion(version)
        definition = RewardDefinition.from_spec(json.loads(raw))
        self._cache[version] = definition
        return definition

    def versions(self) -> list[str]:
        stored = {k.decode() for k in cast(list[bytes], self._r.hkeys(self._hash))}
        if self._dir.exists():
            stored |= {p.stem for p in self._dir.glob("*.json")}
        return sorted(stored | {DEFAULT_DEFINITION.version})

    def active_version(self) -> str:
        raw = cast(bytes | None, self._r.get(self._active))
        return raw.decode() if raw else DEFAULT_DEFINITION.version

    def active(self) -> RewardDefinition:
        return self.get(self.active_version())

    def set_active(self, version: str) -> None:
        self.get(version)  # refuse unknown versions
        self._r.set(self._active, version)
