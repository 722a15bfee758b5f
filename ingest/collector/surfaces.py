"""A cap on the distinct surfaces each write key names, so no key can flood the loop with new surface names.

A `generation` event's `surface` picks its reward definition; each new name costs the signals worker a place in
the active-version pointer that every reader follows (signals/definitions.py). The collector lets each write key
name at most `limit` distinct surfaces per `window_s`: a generation naming one more is refused with the reason
(dead-lettered, replayable once the window has passed). The signals worker caps new names again, over all keys
(`SignalsConfig.max_new_surfaces`). In memory, per process: at most `limit` names a key, for the keys configured.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from flywheel.contract import EventType
from flywheel.reward_versions import surface_of
from ingest.collector.intake import Intake, Refusal


@dataclass
class _Window:
    started: float
    names: set[str] = field(default_factory=set)


class SurfaceCap:
    """`bound(intake, key)`: `intake` with each generation past its key's cap moved to the refusals.

    >>> cap = SurfaceCap(limit=1)
    >>> from flywheel.contract import Event
    >>> gens = [Event(type="generation", generation_id=f"g{i}", user_id="u", properties={"prompt": "p",
    ...         "completion": "c", "model_version": "m", "surface": s}) for i, s in enumerate(["a", "a", "b"])]
    >>> out = cap.bound(Intake(accepted=gens), "key")
    >>> [e.generation_id for e in out.accepted], [r.event_id for r in out.refused] == [gens[2].event_id]
    (['g0', 'g1'], True)
    """

    def __init__(self, limit: int = 64, window_s: float = 3600.0) -> None:
        self.limit = limit
        self.window_s = window_s
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def bound(self, intake: Intake, key: str | None) -> Intake:
        gens = [e for e in intake.accepted if e.type == EventType.GENERATION]
        if not gens:
            return intake
        now = time.monotonic()
        out = Intake(refused=list(intake.refused))
        # each accepted event's index in its request, as `ingest.collector.arrival.bound_by_arrival` finds it
        refused_at = {r.index for r in intake.refused}
        indices = [i for i in range(len(intake.accepted) + len(intake.refused)) if i not in refused_at]
        with self._lock:
            window = self._windows.get(key or "")
            if window is None or now - window.started >= self.window_s:
                window = self._windows[key or ""] = _Window(now)
            for index, event in zip(indices, intake.accepted, strict=True):
                if event.type != EventType.GENERATION:
                    out.accepted.append(event)
                    continue
                try:
                    surface = surface_of(event.properties.get("surface"))
                except ValueError:  # the contract checked it; should it not have, the name as sent counts
                    surface = str(event.properties.get("surface"))[:64]
                if surface in window.names or len(window.names) < self.limit:
                    window.names.add(surface)
                    out.accepted.append(event)
                    continue
                reason = (f"surface {surface!r}: this write key named {self.limit} surfaces in the last "
                          f"{self.window_s:g} s, the most it may "
                          "(FLYWHEEL_COLLECTOR_MAX_SURFACES_PER_KEY)")  # fmt: skip
                out.refused.append(Refusal(index, event.event_id, reason, event.to_bytes()))
        out.refused.sort(key=lambda r: r.index)
        return out
