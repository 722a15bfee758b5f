"""`OfflineGateConfig`: every bound the offline gates hold a candidate to, validated up front."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class OfflineGateConfig:
    """What the offline gates measure, on what, and the bounds a candidate must stay within.

    Held-out data (chosen deterministically from `seed`)
        n_prompts: held-out prompts cut from standard-library files the model was not trained on
            (`flywheel.lm.corpus.held_out_files`); logged_prompts: up to this many of the most
            recent prompts served (signed generations in the lake) are added to them.
        n_text_windows: general held-out text windows (standard-library files) for the language-model gate.
        logged_texts: up to this many more from the product's own signed traffic, newest first, on prompts
            the candidate's trainer held out (`flywheel.holdout`): the prompt context, then the completion
            where its user kept it (reward > 0).
        text_window_tokens: tokens per text window (its last ones, where a logged completion is).
        max_tokens: completion length per generation (serving's one-line completions).
    Sanity
        max_empty_rate: share of generations not declined yet with no visible text above which the
            candidate fails; max_truncated_rate: share cut at max_tokens above which it fails;
        max_declined_rate: share of declined generations (end-of-text first) above which it fails:
            a flood of declines. Declining is a legitimate action (the reward prices it at 0, a
            reject below it), and offline there are no users to say where it was right, so this
            bound, and the rise below, are loose; the rollout's accepted-rate guardrail decides.
    KL to the champion
        max_kl: mean per-token KL(candidate || champion), in nats, over the candidate's own
            completions of the held-out prompts (the quantity the trainer's KL penalty keeps small).
    Language model (`deploy_gate.offline.lm`: a paired t-interval of the per-window difference in mean token
    log-loss, candidate - champion, on the same tokens)
        lm_margin: the non-inferiority margin against the champion, in nats per token: a margin of m is a
            perplexity rise of exp(m) - 1, so 0.05 allows 5.1% per candidate. Passed when the interval's upper
            end is below it, failed when its lower end is above it, otherwise "undecided" (shown, does not
            block: the A/B test decides).
        lm_reference_margin: the same against the reference (the lineage's first champion, the base model),
            so drift across promotions is bounded, not only each step: 0.10 nats/token is a 10.5% rise in all.
        lm_min_windows: fewer windows scored than this (a tiny budget) is "undecided".
        lm_cpu_budget_s: CPU-seconds for scoring windows (every policy on each), in a seeded random order:
            what fits is a uniform sample, and the reason says how many of how many were scored. In (0, 3600].
            The default scores all 512 windows of the default model with three policies (~12 ms a forward on
            one core: ~18 s); with `ope_cpu_budget_s` it keeps one candidate's check within a few minutes on
            two busy cores.
    Against the champion (on the same prompts and seeds)
        max_empty_rate_increase: absolute rise in the empty-output rate (reward hacking: a blank
            output dodges a reject without declining);
        max_declined_rate_increase: absolute rise in the decline rate (loose, as above);
        length_ratio_range: (low, high) bounds on mean suggestion length / the champion's.
    Off-policy estimate (from the champion's signed, rewarded traffic)
        reward_version: the reward definition to use ("" = the active one of each surface,
            `flywheel.reward_versions.versions_to_read`).
        ope_max_samples: newest logged generations used; ope_min_samples and ope_min_ess: below
            either, the verdict is "insufficient evidence" (shown, does not block).
        ope_margin, ope_refuse_margin: on d = DR estimate - the champion's logged mean reward
            (paired bootstrap interval): failed when d's upper end < -refuse_margin (significantly
            worse than the champion), passed when its lower end >= -margin, otherwise "insufficient
            evidence". Chosen on the tuning populations (`bench/ope_calibration.py`).
        ope_clip: cap on each importance ratio (inf: none); ope_ratio: "per_token" (the geometric mean
            of a completion's token ratios: biased, far less variance; it predicted the ground truth
            best on the tuning populations, r 0.91 against 0.85 for clipped sequence ratios) or
            "sequence" (their product); ope_ridge: the reward model's ridge.
        ope_dm_prompts: at most this many logged samples (a seeded uniform sample of them) are estimated on:
            the candidate completes each prompt for the direct-method term of DR, paired with the logged term.
        ope_cpu_budget_s: CPU-seconds for those completions and importance ratios, batch by batch in the same
            seeded order; the estimate uses the samples covered, and its detail says how many of how many.
            Fewer than ope_min_samples covered is "insufficient evidence". In (0, 3600].
        bootstrap_samples, confidence: the seeded percentile bootstrap of both estimates.
    seed: every sample, prompt choice and bootstrap draw; the same seed gives the same results.
    num_threads: torch intra-op threads while the gates run. None: 1 for a champion under
        `small_model_params` parameters (hand-off between threads costs more than such a model's
        matmuls: ~3x slower on two threads, ~50x on a busy machine, measured), else torch's default.
    """

    n_prompts: int = 24
    logged_prompts: int = 16
    n_text_windows: int = 256
    logged_texts: int = 256
    text_window_tokens: int = 96
    max_tokens: int = 24

    max_empty_rate: float = 0.5
    max_truncated_rate: float = 0.5
    max_declined_rate: float = 0.5

    max_kl: float = 0.1

    lm_margin: float = 0.05
    lm_reference_margin: float = 0.10
    lm_min_windows: int = 30
    lm_cpu_budget_s: float = 30.0

    max_empty_rate_increase: float = 0.1
    max_declined_rate_increase: float = 0.3
    length_ratio_range: tuple[float, float] = (0.5, 2.0)

    reward_version: str = ""
    ope_max_samples: int = 2000
    ope_min_samples: int = 50
    ope_min_ess: float = 30.0
    ope_margin: float = 0.0
    ope_refuse_margin: float = 0.0
    ope_clip: float = 20.0
    ope_ratio: Literal["sequence", "per_token"] = "per_token"
    ope_ridge: float = 1.0
    ope_dm_prompts: int = 2000
    ope_cpu_budget_s: float = 60.0
    bootstrap_samples: int = 500
    confidence: float = 0.95

    seed: int = 0
    num_threads: int | None = None
    small_model_params: int = 20_000_000

    def __post_init__(self) -> None:
        errors = []
        for name in ("n_prompts", "n_text_windows", "max_tokens", "bootstrap_samples", "ope_max_samples"):
            if getattr(self, name) < 1:
                errors.append(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("logged_prompts", "logged_texts", "ope_min_samples", "ope_dm_prompts", "lm_min_windows"):
            if getattr(self, name) < 0:
                errors.append(f"{name}={getattr(self, name)}: must be >= 0")
        if self.text_window_tokens < 2:
            errors.append(f"text_window_tokens={self.text_window_tokens}: must be >= 2 (one token predicts the next)")
        shares = ("max_empty_rate", "max_truncated_rate", "max_declined_rate", "max_empty_rate_increase",
                  "max_declined_rate_increase")  # fmt: skip
        for name in shares:
            if not 0.0 <= getattr(self, name) <= 1.0:
                errors.append(f"{name}={getattr(self, name)}: a share, must be in [0, 1]")
        if self.max_kl <= 0:
            errors.append(f"max_kl={self.max_kl}: must be > 0 (nats per token)")
        for name in ("lm_margin", "lm_reference_margin"):
            if not 0.0 < getattr(self, name) <= 1.0:
                errors.append(f"{name}={getattr(self, name)}: nats per token, in (0, 1] (0.05 = 5.1% perplexity)")
        if self.lm_reference_margin < self.lm_margin:
            errors.append(f"lm_reference_margin={self.lm_reference_margin}: must be >= lm_margin={self.lm_margin} "
                          "(drift since the reference includes this step)")  # fmt: skip
        for name in ("lm_cpu_budget_s", "ope_cpu_budget_s"):
            if not 0.0 < getattr(self, name) <= 3600.0:
                errors.append(f"{name}={getattr(self, name)}: CPU-seconds, must be in (0, 3600]")
        low, high = self.length_ratio_range
        if not 0.0 < low <= 1.0 <= high:
            errors.append(f"length_ratio_range={self.length_ratio_range}: need 0 < low <= 1 <= high")
        if self.ope_min_ess < 1:
            errors.append(f"ope_min_ess={self.ope_min_ess}: must be >= 1")
        if self.ope_margin < 0 or self.ope_refuse_margin < 0:
            errors.append(f"ope_margin={self.ope_margin}, ope_refuse_margin={self.ope_refuse_margin}: must be >= 0")
        if not self.ope_clip >= 1.0:
            errors.append(f"ope_clip={self.ope_clip}: must be >= 1 (a cap on importance ratios; inf for none)")
        if self.ope_ratio not in ("sequence", "per_token"):
            errors.append(f"ope_ratio={self.ope_ratio!r}: use 'sequence' or 'per_token'")
        if self.ope_ridge <= 0:
            errors.append(f"ope_ridge={self.ope_ridge}: must be > 0")
        if not 0.5 <= self.confidence < 1.0:
            errors.append(f"confidence={self.confidence}: must be in [0.5, 1)")
        if self.num_threads is not None and self.num_threads < 1:
            errors.append(f"num_threads={self.num_threads}: must be >= 1 (or None for torch's default)")
        if errors:
            raise ValueError("invalid OfflineGateConfig: " + "; ".join(errors))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> OfflineGateConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown OfflineGateConfig fields {unknown}; known: {sorted(known)}")
        if "length_ratio_range" in values:
            values = {**values, "length_ratio_range": tuple(values["length_ratio_range"])}
        return cls(**values)
