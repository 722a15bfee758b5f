"""Settings of the signals component that no other component needs.

Read from the environment with the `FLYWHEEL_SIGNALS_` prefix; the window and
lateness themselves are shared (`Settings.reward_window_s`, `allowed_lateness_s`).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SignalsConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_SIGNALS_", extra="forbid")

    group_id: str = Field(default="", description="Consumer group; empty: 'flywheel-signals.<events_topic>'.")
    poll_max_records: int = Field(default=2000, ge=1)
    poll_timeout_s: float = Field(default=0.2, gt=0)
    idle_after_s: float = Field(
        default=1.0,
        ge=0,
        description="Advance watermarks with the wall clock only after the stream has been empty this long.",
    )
    idle_grace_s: float = Field(
        default=0.5,
        ge=0,
        description="Wall-clock watermark = now - allowed_lateness - this covers produce delay.",
    )
    state_ttl_s: float = Field(
        default=86_400.0,
        gt=0,
        description="How long a generation's state (so late-event handling) lasts after its last event.",
    )
    min_labels: int = Field(
        default=200, ge=10, description="Explicit labels needed before the satisfaction model is used."
    )
    refit_every_s: float = Field(
        default=900.0,
        ge=0,
        description="The worker refits the satisfaction model on the labels so far this often; 0: never.",
    )
    mlflow_experiment: str = "flywheel-signals"
