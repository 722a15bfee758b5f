"""Settings of the signals component that no other component needs.

Read from the environment with the `FLYWHEEL_SIGNALS_` prefix; the default window and the
lateness are shared (`Settings.reward_window_s`, `allowed_lateness_s`); a reward definition
may name its own surface's window (`RewardDefinition.window_s`).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SignalsConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_SIGNALS_", extra="forbid")

    group_id: str = Field(default="", description="Consumer group; empty: 'flywheel-signals.<events_topic>'.")
    poll_max_records: int = Field(
        default=10_000,
        ge=1,
        description="Largest batch: a poll, then more polls while the broker already holds more (never waiting for "
        "new events, so a live stream's batch is what has arrived). A batch pays fixed costs once (the Redis "
        "commit, Kafka's flush, a lake commit); at 2,000 the worker read about 0.7 of what it reads at 10,000, "
        "the ingest worker's batch (bench/signals_stream_throughput.py).",
    )
    poll_timeout_s: float = Field(default=0.2, gt=0, description="Seconds a poll waits for events when none are there.")
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
        default=200, ge=10, description="Explicit labels of a surface needed before its satisfaction model is used."
    )
    auc_margin: float = Field(
        default=0.02,
        ge=0,
        le=1,
        description="A refit is activated only if its held-out AUC beats the rules' by this much, the lower "
        "end of the bootstrap interval of the difference is above 0, and its ECE is no worse than the rules'.",
    )
    bootstrap_samples: int = Field(default=400, ge=50, description="Resamples for the AUC and ECE intervals.")
    seed: int = Field(default=0, description="Seed of the bootstrap (a refit of the same data repeats exactly).")
    backfill_after_s: float = Field(
        default=3600.0,
        gt=0,
        description="An event received more than this long after its time is history being replayed: its "
        "generation's window closes by event time (one final record), not on arrival.",
    )
    refit_every_s: float = Field(
        default=900.0,
        ge=0,
        description="The worker refits the satisfaction model on the labels so far this often; 0: never.",
    )
    mlflow_experiment: str = Field(
        default="flywheel-signals", description="MLflow experiment where satisfaction refits are logged."
    )
    # Per-generation bounds: one generation's flood of feedback must not grow its state, its revisions or the
    # time its partition's other generations wait (signals/worker.py, "Bounds").
    max_feedback_per_generation: int = Field(
        default=64,
        ge=1,
        description="Distinct feedback events kept per generation (a real one has a few dozen at most); "
        "later ones are dead-lettered and counted as `capped`.",
    )
    max_new_surfaces: int = Field(
        default=32,
        ge=0,
        description="New surface names a worker adopts per `new_surfaces_window_s` (each gets its built-in rules "
        "and a place in the pointer every reader follows); a generation naming one more is dead-lettered and "
        "counted as `capped`, and is scored when replayed once the window has passed.",
    )
    new_surfaces_window_s: float = Field(
        default=3600.0, gt=0, description="The window, in seconds, over which max_new_surfaces is counted."
    )
    max_feedback_bytes: int = Field(
        default=16_384,
        ge=1024,
        description="Largest properties JSON of a feedback event kept in a generation's state (every declared "
        "property fits: texts are at most 8192 characters); a larger one is dead-lettered and counted as `capped`.",
    )
