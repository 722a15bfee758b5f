"""`OfflineGateConfig`: every bound the offline gates hold a candidate to, validated up front.

One typed field per setting, as every other settings object (pydantic-settings): read from the environment as
`FLYWHEEL_OFFLINE_<NAME>` by the process that runs the gates (the deploy gate), or given in code; each field's
description is its help in `docs/configuration.md`. Field bounds check each value; `_consistent` checks the
values against each other.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class OfflineGateConfig(BaseSettings):
    """What the offline gates measure, on what, and the bounds a candidate must stay within.

    Held-out data is chosen deterministically from `seed`. The language-model gate (`deploy_gate.offline.lm`) is
    a paired t-interval of the per-window difference in mean token log-loss, candidate - champion, on the same
    tokens. The off-policy estimate is from the champion's signed, rewarded traffic.
    """

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_OFFLINE_", extra="forbid", frozen=True,
                                      allow_inf_nan=False)  # fmt: skip

    # --- held-out data --------------------------------------------------------------------------------------------
    n_prompts: int = Field(default=24, ge=1, description="Held-out prompts cut from standard-library files the "
                           "model was not trained on (`flywheel.lm.corpus.held_out_files`).")  # fmt: skip
    logged_prompts: int = Field(default=16, ge=0, description="Up to this many of the most recent prompts served "
                                "(signed generations in the lake) are added to them.")  # fmt: skip
    n_text_windows: int = Field(default=256, ge=1, description="General held-out text windows (standard-library "
                                "files) for the language-model gate.")  # fmt: skip
    logged_texts: int = Field(
        default=256, ge=0, description="Up to this many more from the product's own signed traffic, newest first, "
        "on prompts the candidate's trainer held out (`flywheel.holdout`): the prompt context, then the completion "
        "where its user kept it (reward > 0).",
    )  # fmt: skip
    text_window_tokens: int = Field(default=96, ge=2, description="Tokens per text window (its last ones, where a "
                                    "logged completion is); one token predicts the next.")  # fmt: skip
    max_tokens: int = Field(default=24, ge=1, description="Completion length per generation (serving's one-line "
                            "completions).")  # fmt: skip

    # --- sanity ---------------------------------------------------------------------------------------------------
    max_empty_rate: float = Field(default=0.5, ge=0, le=1, description="Share of generations not declined yet with "
                                  "no visible text above which the candidate fails.")  # fmt: skip
    max_truncated_rate: float = Field(default=0.5, ge=0, le=1, description="Share cut at max_tokens above which it "
                                      "fails.")  # fmt: skip
    max_declined_rate: float = Field(
        default=0.5, ge=0, le=1, description="Share of declined generations (end-of-text first) above which it "
        "fails: a flood of declines. Declining is legitimate (the reward prices it at 0, a reject below it) and "
        "offline no users say where it was right, so this bound is loose; the rollout's guardrail decides.",
    )  # fmt: skip

    # --- KL to the champion ---------------------------------------------------------------------------------------
    max_kl: float = Field(
        default=0.1, gt=0, description="Mean per-token KL(candidate || champion), in nats, over the candidate's own "
        "completions of the held-out prompts (what the trainer's KL penalty keeps small).",
    )  # fmt: skip

    # --- language model -------------------------------------------------------------------------------------------
    lm_margin: float = Field(
        default=0.05, gt=0, le=1, description="Non-inferiority margin against the champion, in nats per token (m is "
        "a perplexity rise of exp(m) - 1: 0.05 allows 5.1%). Passed when the interval's upper end is below it, "
        "failed when its lower end is above it, otherwise undecided (shown, does not block).",
    )  # fmt: skip
    lm_reference_margin: float = Field(
        default=0.10, gt=0, le=1, description="The same against the reference (the lineage's first champion), so "
        "drift across promotions is bounded: 0.10 nats/token is a 10.5% rise in all. At least lm_margin.",
    )  # fmt: skip
    lm_min_windows: int = Field(default=30, ge=0, description="Fewer windows scored than this is undecided.")
    lm_cpu_budget_s: float = Field(
        default=30.0, gt=0, le=3600, description="CPU-seconds for scoring windows (every policy on each), in a "
        "seeded random order: what fits is a uniform sample, and the reason says how many were scored. The default "
        "scores all 512 windows of the default model with three policies (~18 s on one core).",
    )  # fmt: skip

    # --- against the champion -------------------------------------------------------------------------------------
    max_empty_rate_increase: float = Field(
        default=0.1, ge=0, le=1, description="Absolute rise in the empty-output rate allowed (reward hacking: a "
        "blank output dodges a reject without declining).",
    )  # fmt: skip
    max_declined_rate_increase: float = Field(default=0.3, ge=0, le=1, description="Absolute rise in the decline "
                                              "rate allowed (loose, as max_declined_rate).")  # fmt: skip
    length_ratio_range: tuple[float, float] = Field(
        default=(0.5, 2.0), description="(low, high) bounds on mean suggestion length / the champion's; "
        "0 < low <= 1 <= high.",
    )  # fmt: skip

    # --- off-policy estimate --------------------------------------------------------------------------------------
    reward_version: str = Field(default="", description='The reward definition to use ("" = the active one of each '
                                "surface, `flywheel.reward_versions.versions_to_read`).")  # fmt: skip
    ope_max_samples: int = Field(default=2000, ge=1, description="Newest logged generations used.")
    ope_min_samples: int = Field(default=50, ge=0, description="Fewer samples covered than this is \"insufficient "
                                 'evidence" (shown, does not block).')  # fmt: skip
    ope_min_ess: float = Field(default=30.0, ge=1, description='An effective sample size under this is '
                               '"insufficient evidence".')  # fmt: skip
    ope_margin: float = Field(
        default=0.0, ge=0, description="On d = DR estimate - the champion's logged mean reward (paired bootstrap "
        "interval): passed when d's lower end >= -ope_margin. Chosen on the tuning populations "
        "(`bench/ope_calibration.py`).",
    )  # fmt: skip
    ope_refuse_margin: float = Field(default=0.0, ge=0, description="Failed when d's upper end < -ope_refuse_margin "
                                     "(significantly worse than the champion).")  # fmt: skip
    ope_clip: float = Field(default=20.0, ge=1, allow_inf_nan=True, description="Cap on each importance ratio (inf: "
                            "none).")  # fmt: skip
    ope_ratio: Literal["sequence", "per_token"] = Field(
        default="per_token", description='"per_token" (the geometric mean of a completion\'s token ratios: biased, '
        "far less variance; it predicted the ground truth best on the tuning populations, r 0.91 against 0.85 for "
        'clipped sequence ratios) or "sequence" (their product).',
    )  # fmt: skip
    ope_ridge: float = Field(default=1.0, gt=0, description="The direct method's reward model's ridge penalty.")
    ope_dm_prompts: int = Field(
        default=2000, ge=0, description="At most this many logged samples (a seeded uniform sample) are estimated "
        "on: the candidate completes each prompt for the direct-method term of DR.",
    )  # fmt: skip
    ope_cpu_budget_s: float = Field(
        default=60.0, gt=0, le=3600, description="CPU-seconds for those completions and importance ratios, batch by "
        "batch in the same seeded order; the estimate uses the samples covered and says how many.",
    )  # fmt: skip
    bootstrap_samples: int = Field(default=500, ge=1, description="Draws of the seeded percentile bootstrap of "
                                   "both estimates.")  # fmt: skip
    confidence: float = Field(default=0.95, ge=0.5, lt=1, description="The bootstrap intervals' confidence.")

    # --- the run --------------------------------------------------------------------------------------------------
    seed: int = Field(default=0, description="Every sample, prompt choice and bootstrap draw; the same seed gives "
                      "the same results.")  # fmt: skip
    num_threads: int | None = Field(
        default=None, ge=1, description="torch intra-op threads while the gates run. None: 1 for a champion under "
        "`small_model_params` parameters (hand-off between threads costs more than such a model's matmuls: ~3x "
        "slower on two threads, measured), else torch's default.",
    )  # fmt: skip
    small_model_params: int = Field(default=20_000_000, ge=0, description="See num_threads.")

    @field_validator("length_ratio_range")
    @classmethod
    def _around_one(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not 0.0 < low <= 1.0 <= high:
            raise ValueError(f"length_ratio_range={value}: need 0 < low <= 1 <= high")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> OfflineGateConfig:
        if self.lm_reference_margin < self.lm_margin:
            raise ValueError(f"lm_reference_margin={self.lm_reference_margin}: must be >= lm_margin={self.lm_margin} "
                             "(drift since the reference includes this step)")  # fmt: skip
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> OfflineGateConfig:
        """The fields in `values`, over the environment's `FLYWHEEL_OFFLINE_*`, over the defaults."""
        unknown = sorted(set(values) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"unknown OfflineGateConfig fields {unknown}; known: {sorted(cls.model_fields)}")
        return cls(**values)

    def replace(self, **changes: Any) -> OfflineGateConfig:
        """A copy with `changes`, validated as a new one is."""
        return self.from_dict({**self.to_dict(), **changes})
