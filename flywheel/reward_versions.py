"""Which reward definition version is active, per product surface: the one pointer every reader shares.

Signals owns the definitions (`signals/definitions.py`); the trainer and the deploy gate only need to
know which versions count. The pointer is a small JSON file beside the lake's tables, on the same store
(`<lake root>/reward_definitions/active.json`, `{surface: version}`; `flywheel.lake.files`), replaced
whole, so every reader sees one whole mapping and a backfill of another version changes nothing until someone
activates it. A lake without the file has never been touched by signals (a simulator wrote its
rewards); readers then fall back to the version written last, as before surfaces existed.

Every consumer of rewards (the trainer, the gate's metrics, the offline gates, the rollout controller and its
chart, the gaming watch) asks `versions_by_surface`, or `versions_to_read` for just the versions, and nothing
else: what counts changes in one place, and only when a version is activated.

A surface is named by the `surface` property of a `generation` event (`DEFAULT_SURFACE` when it
is empty): lower-case letters, digits, `.`, `_` and `-`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import polars as pl

from flywheel.lake import files
from flywheel.lake.tables import REWARD_DEFINITIONS_PATH

DEFAULT_SURFACE = "code-completion"
SURFACE_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
_SURFACE = re.compile(SURFACE_PATTERN)
ACTIVE_FILE = "active.json"
ANY_SURFACE = "*"  # the key of the version written last, on a lake whose signals never wrote the pointer


def surface_of(value: object) -> str:
    """The surface a generation's `surface` property names; empty or missing: `DEFAULT_SURFACE`.

    >>> surface_of(""), surface_of("chat")
    ('code-completion', 'chat')
    """
    text = str(value or "")
    if not text:
        return DEFAULT_SURFACE
    if not _SURFACE.match(text):
        raise ValueError(f"surface {text!r} must match {SURFACE_PATTERN}")
    return text


def read_active(lake: str | Path) -> dict[str, str] | None:
    """`{surface: active version}` in the lake rooted at `lake` (a folder or a URI, `Settings.lake_root`), or
    None when signals never wrote the pointer for this lake."""
    raw = files.read_bytes(lake, REWARD_DEFINITIONS_PATH, ACTIVE_FILE)
    if raw is None:
        return None
    return {str(k): str(v) for k, v in json.loads(raw).items()}


def write_active(lake: str | Path, active: dict[str, str]) -> None:
    """Replace the pointer whole (a reader never sees half a file)."""
    data = json.dumps(dict(sorted(active.items()))).encode()
    files.write_bytes(lake, REWARD_DEFINITIONS_PATH, ACTIVE_FILE, data=data)


def describe(versions: Iterable[str]) -> str:
    """How a reader names the versions it read: sorted and comma-joined (one per surface).

    >>> describe({"rules-v1", "chat-rules-v1"})
    'chat-rules-v1,rules-v1'
    """
    return ",".join(sorted(versions))


def versions_by_surface(lake: str | Path, rewards: pl.LazyFrame | None) -> dict[str, str]:
    """`{surface: reward version}` that a consumer of `rewards` (the lake's rewards table; None: no table yet)
    follows: the active one of each surface, so a backfill of another version changes nothing until it is
    activated; on a lake whose signals never wrote the pointer, the version written last, under `ANY_SURFACE`.

    A definition scores only generations of its own surface (`signals/worker.py`), so reading the rows of these
    versions gives each generation one reward, from its own surface's active definition.
    """
    active = read_active(lake)
    if active:
        return active
    if rewards is None:
        return {}
    newest = rewards.select(pl.col("reward_version").get(pl.col("emitted_at").arg_max())).collect()
    return {} if newest.is_empty() or newest.item() is None else {ANY_SURFACE: str(newest.item())}


def versions_to_read(lake: str | Path, rewards: pl.LazyFrame | None) -> list[str]:
    """The versions of `versions_by_surface`, sorted: what a consumer filters the rewards table on."""
    return sorted(set(versions_by_surface(lake, rewards).values()))
