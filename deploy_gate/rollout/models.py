"""The `GET /api/experiment` and `/api/experiment/series` answers (the contract with the dashboard).

Field names and shapes are the contract: change them only together with the dashboard.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict

ExperimentState = Literal["ramping", "holding", "promoted", "rolled_back", "frozen", "idle"]
DecisionAction = Literal["continue", "ramp", "promote", "rollback", "freeze"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RampView(_Model):
    share: float
    min_users: int
    min_seconds: float
    entered_at: datetime | None = None
    left_at: datetime | None = None


class ArmView(_Model):
    users: int
    generations: int
    mean: float | None
    ci: tuple[float, float] | None


class DifferenceView(_Model):
    estimate: float
    ci: tuple[float, float]
    sequential_ci: tuple[float, float]
    alpha: float
    method: str
    p_value: float | None = None


class SrmView(_Model):
    observed: list[int]
    expected_shares: list[float]
    p_value: float
    alarm: bool


class GuardrailView(_Model):
    """One check of the challenger against the champion. Kind "info" is a rate shown for information
    (shown, declined): its `ok` is always true and it never decides anything."""

    name: str
    champion: float | None
    challenger: float | None
    bound: str
    ok: bool
    kind: Literal["guardrail", "reward_hacking", "info"] = "guardrail"


class DecisionView(_Model):
    action: DecisionAction
    reason: str
    at: datetime


class AnalysisView(_Model):
    unit: Literal["user"] = "user"
    metric: str = "satisfaction"
    reward_version: str | None
    arms: dict[str, ArmView]
    difference: DifferenceView | None
    srm: SrmView
    guardrails: list[GuardrailView]
    decision: DecisionView
    # Visible warnings that are not (yet) a rollback, e.g. "reward_up_explicit_down".
    flags: list[str] = []


class TimelineEntry(_Model):
    at: datetime
    event: str
    by: str


class EffectView(_Model):
    estimate: float
    ci: tuple[float, float]


class HoldoutView(_Model):
    share: float
    version: str
    users: int
    mean: float | None
    cumulative_effect: EffectView | None


class ExperimentView(_Model):
    experiment: str
    state: ExperimentState
    champion: str | None
    challenger: str | None
    holdout_version: str | None
    share: float
    ramp: list[RampView]
    step: int
    analysis: AnalysisView | None
    timeline: list[TimelineEntry]
    holdout: HoldoutView | None


class SeriesBucket(_Model):
    start: datetime
    arm: str
    users: int
    mean: float | None
    ci: tuple[float, float] | None


class SeriesView(_Model):
    buckets: list[SeriesBucket]
