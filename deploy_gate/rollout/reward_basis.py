"""The reward versions a running experiment decides on: fixed per surface when it starts, never switched silently.

What must hold: a `flywheel signals recompute` backfill of a version nobody activated changes neither the
analysis nor the decision of a running experiment, and an activation during it is said, not switched in.

- At its start the experiment records what every consumer reads (`flywheel.reward_versions.versions_by_surface`:
  the active version of each surface), as `decides_on`. On a lake whose signals never wrote the pointer and
  that holds no reward yet, there is nothing to record; the first look that finds rewards records them, and
  says so on the timeline.
- Every look asks the same reader again. A backfill of an inactive version is never in its answer, so it
  cannot reach the analysis (`deploy_gate/rollout/data.py` reads only the versions named).
- A surface whose active version changed keeps the recorded one until the experiment ends: a mid-experiment
  switch would compare the arms on a reward half one definition and half another. The change is said once on
  the timeline (the dashboard's experiment view) when first seen, and in every decision's reason while it
  lasts. The next experiment starts on the new version.
- A surface that had no version at the start (a product's new surface, adopted by signals on its first
  generation) joins with its version: nothing is switched, and its generations would otherwise count with no
  reward. Said on the timeline.

Several surfaces served at once: each generation is scored by its own surface's recorded version (a definition
scores only its own surface), and each user's rewards are pooled over the surfaces they used; the analysis
does not stratify by surface (its strata are the ramp's steps). The split randomises users, not surfaces, so
both arms meet the same mix of surfaces in expectation.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from flywheel.reward_versions import ANY_SURFACE


def _named(versions: dict[str, str]) -> str:
    """`rules-v1 (code-completion), chat-rules-v1 (chat)`; the unpointed fallback has no surface to name.

    >>> _named({"code-completion": "rules-v1", "chat": "chat-rules-v1"})
    'chat-rules-v1 (chat), rules-v1 (code-completion)'
    """
    return ", ".join(v if s == ANY_SURFACE else f"{v} ({s})" for s, v in sorted(versions.items()))


class RewardBasis(BaseModel):
    """`decides_on`: {surface: version} the experiment's analysis reads; `active`: the reader's last answer."""

    model_config = ConfigDict(extra="forbid")

    decides_on: dict[str, str] = Field(default_factory=dict)
    active: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def at_start(cls, active: dict[str, str]) -> RewardBasis:
        return cls(decides_on=dict(active), active=dict(active))

    def versions(self) -> list[str]:
        """The versions to read, one per surface."""
        return sorted(set(self.decides_on.values()))

    def describe(self) -> str:
        return _named(self.decides_on) if self.decides_on else "none yet (the first rewards found fix it)"

    def look(self, active: dict[str, str]) -> list[str]:
        """Take the reader's answer now; returns what changed since the last look, in words for the timeline.

        >>> b = RewardBasis.at_start({"code-completion": "rules-v1"})
        >>> b.look({"code-completion": "rules-v2", "docs": "docs-rules-v1"})  # doctest: +NORMALIZE_WHITESPACE
        ['reward rules-v2 activated for code-completion: this experiment keeps deciding on rules-v1,
          its version at the start; rules-v2 counts from the next experiment',
         'reward docs-rules-v1 (docs) joins: a surface this experiment had no version for']
        >>> b.look({"code-completion": "rules-v2", "docs": "docs-rules-v1"}), b.versions()
        ([], ['docs-rules-v1', 'rules-v1'])
        """
        said: list[str] = []
        if not self.decides_on:
            if active:
                self.decides_on = dict(active)
                said.append(f"deciding on reward {_named(active)}")
            self.active = dict(active)
            return said
        pointed = ANY_SURFACE not in self.decides_on
        for surface, version in sorted(active.items()):
            if pointed and surface != ANY_SURFACE and surface not in self.decides_on:
                self.decides_on[surface] = version
                said.append(f"reward {_named({surface: version})} joins: a surface this experiment had no version for")
            elif self.active.get(surface) == version:
                continue
            elif version == self.decides_on.get(surface):
                said.append(f"reward {version} is active again for {surface}: the version this experiment decides on")
            else:
                kept = self.decides_on.get(surface) or _named(self.decides_on)
                where = "" if surface == ANY_SURFACE else f" for {surface}"
                said.append(f"reward {version} activated{where}: this experiment keeps deciding on {kept}, "
                            f"its version at the start; {version} counts from the next experiment")  # fmt: skip
        self.active = dict(active)
        return said

    def unused(self) -> str | None:
        """For the decision's reason: the active versions this experiment does not decide on, or None.

        >>> b = RewardBasis.at_start({"*": "sim-v1"})  # a lake signals had not pointed yet
        >>> b.unused() is None, len(b.look({"code-completion": "rules-v1"})), b.versions()
        (True, 1, ['sim-v1'])
        >>> b.unused()  # doctest: +NORMALIZE_WHITESPACE
        "decided on reward sim-v1, as at the experiment's start; activated since and not used until the next
         experiment: rules-v1 (code-completion)"
        """
        if ANY_SURFACE in self.decides_on:  # decided on the version written last: any pointer is a change
            pending = {s: v for s, v in self.active.items() if v != self.decides_on[ANY_SURFACE]}
        else:
            pending = {s: v for s, v in self.active.items() if s in self.decides_on and v != self.decides_on[s]}
        if not pending:
            return None
        return (f"decided on reward {self.describe()}, as at the experiment's start; activated since and not used "
                f"until the next experiment: {_named(pending)}")  # fmt: skip
