"""`TrainerConfig`: the whole configuration of one training cycle, validated up front.

One typed field per setting, as every other settings object (pydantic-settings): its type, default, bounds and
help live on the field, `docs/configuration.md` is generated from them, and each is also read from the
environment as `FLYWHEEL_TRAINER_<NAME>`. A JSON file of fields (`flywheel trainer schedule --config FILE`,
`TrainerConfig.from_dict`) takes precedence over the environment, which takes precedence over the defaults.

The fields are grouped by what uses them (each field's `group`, `GROUPS`): the base of every cycle (the
objective's shared terms, the update, the optimisation, the data), then the parts of the three objectives alone:
`pg`, `kto` and `rwl`. A field of one objective's part is ignored under another objective.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# What each group of fields is for, in the order the reference lists them.
GROUPS: dict[str, str] = {
    "objective": "what every objective shares: the choice of objective and the terms added to any of them",
    "pg": 'objective "pg" alone: off-policy policy gradient on serving\'s behaviour log-probs',
    "kto": 'objective "kto" alone: unpaired good / bad labels (Ethayarajh et al. 2024)',
    "rwl": 'objective "rwl" alone: reward-weighted likelihood (advantage-weighted regression)',
    "update": "what a cycle trains and registers: every weight, or a LoRA adapter",
    "optimisation": "the optimizer, the precision and the train / inference check",
    "data": "what a cycle trains on, and the limits of one cycle",
    "own samples": "training on the champion's own samples, scored by a reward model fitted on the logged rewards",
}


def _in(group: str, default: Any, description: str, **bounds: Any) -> Any:
    """A field of `group` (one of `GROUPS`)."""
    return Field(default, description=description, json_schema_extra={"group": group}, **bounds)


class TrainerConfig(BaseSettings):
    """How a cycle selects data and updates the policy (every field's description says what it does)."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_TRAINER_", extra="forbid", allow_inf_nan=False,
                                      validate_assignment=True)  # fmt: skip
    GROUPS: ClassVar[dict[str, str]] = GROUPS  # for the reference's sections

    # --- objective: shared by every objective --------------------------------------------------------------------
    objective: Literal["pg", "kto", "rwl"] = _in(
        "objective", "pg",
        '"pg" (off-policy policy gradient, one logged sample per prompt; needs serving\'s behaviour log-probs), '
        '"kto" (unpaired good / bad labels, e.g. thumbs) or "rwl" (reward-weighted likelihood: advantage-weighted '
        'regression). "kto" and "rwl" need no behaviour log-probs, so they alone can learn from text-only '
        "generations.",
    )
    kl_coef: float = _in("objective", 0.05, 'Weight of the per-token KL penalty to the champion the cycle started '
                         'from ("pg" and "rwl").', ge=0)  # fmt: skip
    baseline: Literal["batch_mean"] | float = _in(
        "objective", "batch_mean",
        '"batch_mean" or a fixed number subtracted from the rewards to make advantages ("pg" and "rwl").',
    )
    normalise_advantages: bool = _in("objective", True, 'Divide the advantages by the batch\'s standard deviation '
                                     '("pg" and "rwl").')  # fmt: skip
    loss_aggregation: Literal["sequence", "token"] = _in(
        "objective", "sequence", '"sequence" (every sample weighs the same) or "token" (every token does).'
    )
    abstain_coef: float = _in(
        "objective", 0.0,
        "Declining (end-of-text first) earns a known reward (`abstain_reward`) in every context, so each shown "
        "sample also says what declining would have earned instead. Above 0 the loss adds abstain_coef x "
        "mean((r - abstain_reward) x p(decline | prompt)) over shown samples: the exact gradient of the expected "
        "reward through the decline choice. Where suggestions are rejected it raises declining, where they are "
        "accepted it lowers it. 0 leaves it out.", ge=0,
    )  # fmt: skip
    abstain_reward: float = _in("objective", 0.0, "The reward of declining (0 under Cursor's scheme).")
    ptx_coef: float = _in(
        "objective", 0.0,
        "Weight gamma of a pretraining-mix term (InstructGPT's PPO-ptx, Ouyang et al. 2022, eq. 2): gamma x the "
        "mean next-token log-loss of each batch's logged contexts (the last `trainer.loop.PTX_WINDOW` tokens of "
        "each distinct prompt) is added to the loss, so the policy keeps modelling the product's text while it "
        "moves toward what users accept. One more forward and backward pass a step. 0 leaves it out; beyond 10 the "
        "language-model term drowns the reward (values near 0.1-1 weigh it against a normalised advantage).",
        ge=0, le=10,
    )  # fmt: skip
    text_generations: bool = _in(
        "objective", False,
        "Also learn from generations known only as text (a product's own model, or unsigned): tokenised by the "
        'current policy, trained without behaviour log-probs. Needs objective "kto" or "rwl"; off, they are left '
        "out with their reason.",
    )

    # --- pg: objective "pg" alone ---------------------------------------------------------------------------------
    correction: Literal["ppo_clip", "tis"] = _in(
        "pg", "ppo_clip", '"ppo_clip" (clip the per-token ratio to [1-clip_eps, 1+clip_eps]) or "tis" (truncated '
        "importance sampling, the ratio capped at is_cap).",
    )  # fmt: skip
    clip_eps: float = _in("pg", 0.2, "PPO's clip range of the per-token ratio; 0.2 is the usual value.", gt=0, lt=1)
    is_cap: float = _in("pg", 2.0, 'The cap on the ratio under "tis" (a cap below 1 would down-weight on-policy '
                        "tokens).", ge=1)  # fmt: skip

    # --- kto: objective "kto" alone -------------------------------------------------------------------------------
    kto_beta: float = _in("kto", 0.1, "KTO's beta: how sharply the loss saturates in the implied reward.", gt=0)
    kto_lambda_desirable: float = _in("kto", 1.0, "KTO's weight of the desirable samples.", gt=0)
    kto_lambda_undesirable: float = _in("kto", 1.0, "KTO's weight of the undesirable samples.", gt=0)
    kto_threshold: float = _in("kto", 0.0, "The reward above which a sample counts as desirable.")

    # --- rwl: objective "rwl" alone -------------------------------------------------------------------------------
    rwl_beta: float = _in("rwl", 1.0, "Each sample's log-likelihood is weighed by exp(advantage / rwl_beta).", gt=0)
    rwl_max_weight: float = _in("rwl", 20.0, "The cap on that weight.", gt=0)

    # --- update ---------------------------------------------------------------------------------------------------
    update: Literal["full", "lora"] = _in(
        "update", "full",
        '"full": every weight, registered as a lossless delta against the champion (right for the small embedded '
        'model). "lora": a LoRA adapter (peft) on a frozen base, registered as a standard peft directory naming its '
        "base (`ModelRegistry.register_adapter`): megabytes for a model of billions of parameters, champion and "
        "challenger served as two adapters on one copy of the base. A full-weights champion becomes the new "
        "adapter's base; an adapter champion is continued (its rank, alpha and modules kept) on the same base. "
        '"full" from an adapter champion merges it first. LoRA wants a higher learning_rate (1e-4 to 1e-3).',
    )
    lora_rank: int = _in("update", 16, "A fresh adapter's rank r.", ge=1)
    lora_alpha: int = _in("update", 32, "A fresh adapter's scale alpha (the update is alpha / r x B A).", gt=0)
    lora_dropout: float = _in("update", 0.0, "Dropout on a fresh adapter's input.", ge=0, lt=1)
    lora_target_modules: str = _in(
        "update", "all-linear",
        'The modules that get an adapter: "all-linear" (every linear layer of the transformer blocks, the output '
        'head left out) or a comma-separated list of module-name suffixes ("q_proj,v_proj" for Llama, Qwen2 and '
        'Mistral, "c_attn" for GPT-2, "qkv_proj" for Phi-3).',
    )

    # --- optimisation ---------------------------------------------------------------------------------------------
    learning_rate: float = _in("optimisation", 1e-5, "AdamW's learning rate.", gt=0)
    weight_decay: float = _in("optimisation", 0.0, "AdamW's weight decay.", ge=0)
    batch_size: int = _in("optimisation", 8, "Samples per optimizer step, per process.", ge=1)
    epochs: int = _in("optimisation", 1, "Passes over the cycle's samples.", ge=1)
    max_steps: int = _in("optimisation", 0, "At most this many optimizer steps (0 = no cap).", ge=0)
    grad_clip: float = _in("optimisation", 1.0, "Gradient-norm clipping (0 = off).", ge=0)
    seed: int = _in("optimisation", 0, "Seeds the sample order, sampling and the stochastic rounding.")
    device: str = _in("optimisation", "cpu", '"cpu", "cuda" or "cuda:N".')
    dtype: Literal["float32", "bfloat16"] = _in(
        "optimisation", "float32", "What training computes in; the champion is loaded in it (a bfloat16 one upcast "
        "exactly).",
    )  # fmt: skip
    save_dtype: Literal["bfloat16", "float32"] = _in(
        "optimisation", "bfloat16",
        'What the candidate is stored in. "bfloat16" keeps the registry\'s delta against a bfloat16 parent small '
        "(8x under the full file for a default cycle of the embedded model, where float32 gives 1.8x): float32 "
        "weights are rounded to bfloat16 stochastically (`flywheel.lm.precision`), seeded by `seed`, the champion "
        "and the data, so an update smaller than half a bfloat16 step still moves a weight with probability "
        '|update| / step. Serving and the trainer both compute on these values upcast. "float32" stores every bit.',
    )
    exact_logprobs: bool = _in(
        "optimisation", False,
        "Train with per-sample forward passes, bit-identical to serving's behaviour log-probs (ratio exactly 1 on "
        "unchanged weights) but ~5x slower on CPU; off, each batch is scored in one padded pass (~1e-6 apart from "
        "serving in fp32, reported).",
    )
    exact_check_samples: int = _in(
        "optimisation", 64, "Samples served by the champion re-scored one by one before training, to check serving "
        "and the trainer agree exactly (`exact_mismatch_*` metrics; 0 skips the check).", ge=0,
    )  # fmt: skip
    mismatch_threshold: float = _in("optimisation", 1e-3, "A |trainer - serving| log-prob difference counted as a "
                                    "mismatch.", gt=0)  # fmt: skip

    # --- data -----------------------------------------------------------------------------------------------------
    reward_version: str = _in("data", "", 'Train on this reward definition ("" = the active one of each surface).')
    min_samples: int | None = _in("data", None, "Skip the cycle below this many eligible samples (None: "
                                  "`Settings.min_train_samples`).", ge=1)  # fmt: skip
    max_samples: int = _in(
        "data", 0, "At most this many samples a cycle (0 = all eligible since the parent's window). When more are "
        "eligible, a seeded uniform sample of them is kept (reservoir sampling) and the cycle reports how many it "
        "left out and by that rule (`left_out_*` metrics, the log, a skip's reason).", ge=0,
    )  # fmt: skip
    time_budget_s: float = _in(
        "data", 0.0, "Wall-clock seconds the optimisation may take, from its first step (0 = no budget); the scoring "
        "and sampling before it are reported apart (`prepare_seconds`). Samples are visited in a seeded random "
        "order, so a cycle that runs out has trained on a uniform sample, and reports those it did not reach.",
        ge=0,
    )  # fmt: skip
    target_kl: float = _in(
        "data", 0.0, "Stop once the mean per-token KL to the champion over the last `KL_STOP_STEPS` steps passes "
        "this many nats (0 = never): PPO's early stop. Measured on the logged tokens, where the offline gate's "
        "`max_kl` reads the candidate's own completions, which read higher: set it well under `max_kl`. Samples "
        "not reached are reported, as the time budget's.", ge=0,
    )  # fmt: skip
    ope_holdout_share: float = _in(
        "data", 0.0, "Share of eligible generations (by a hash of their id, `flywheel.holdout`) left out of "
        "training, so the offline gate estimates the candidate on champion traffic it never saw (0 = none: the "
        "gate then says its estimate is in-sample).", ge=0, lt=1,
    )  # fmt: skip
    replay_fraction: float = _in("data", 0.0, "Add up to this fraction of older (already trained on) samples.",
                                 ge=0, le=1)  # fmt: skip
    require_consent: bool = _in("data", True, "Train only on users whose latest event carrying `consent_property` "
                                "set it true.")  # fmt: skip
    consent_property: str = _in("data", "training_consent", "The event property that carries consent.")

    # --- own samples ----------------------------------------------------------------------------------------------
    own_samples: int = _in(
        "own samples", 0,
        "Train on this many of the champion's own completions of each logged prompt instead of the logged samples "
        "(0 = off): a reward model is fitted on the cycle's logged rewards (`trainer.reward_model`: ridge "
        "regression on text features, its penalty cross-validated) and scores them; each sample's reward is its "
        "score minus its prompt group's mean. On-policy, so pg's ratio starts at 1.", ge=0,
    )  # fmt: skip
    own_max_tokens: int = _in("own samples", 16, "Tokens per own completion, at most.", ge=1)
    own_max_prompts: int = _in(
        "own samples", 512, "Sample own completions of at most this many distinct logged prompts, a seeded uniform "
        "choice (0 = every prompt), so a cycle's sampling costs the same however much traffic it had.", ge=0,
    )  # fmt: skip
    own_cpu_budget_s: float = _in(
        "own samples", 0.0,
        "CPU-seconds of this process (`time.process_time`, not wall time, which on a loaded machine counts "
        "everyone's work) that preparing own samples may take, from the cycle's first scoring of its logged "
        "samples (0 = no budget). Prompts are visited in a seeded uniform order and none starts once it is spent "
        "(the first always runs); the reason and metrics (`own_prompts_covered`, `own_prompts_total`, "
        "`own_cpu_seconds`) say how many. A cycle meant to run every few minutes wants tens of seconds.",
        ge=0, le=3600,
    )  # fmt: skip
    reward_model_min_z: float = _in(
        "own samples", 2.0, "How many standard errors from zero the reward model's cross-validated correlation "
        "with the logged rewards must be (r x sqrt(rows)) to train on own samples; under it, the cycle trains on "
        "the logged samples and says so.", ge=0,
    )  # fmt: skip

    @field_validator("device")
    @classmethod
    def _a_visible_device(cls, device: str) -> str:
        if not (device == "cpu" or device.startswith("cuda")):
            raise ValueError(f"device={device!r}: use 'cpu', 'cuda' or 'cuda:N'")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but no CUDA device is visible; use device='cpu'")
        return device

    @field_validator("lora_target_modules")
    @classmethod
    def _some_modules(cls, targets: str) -> str:
        if not targets.strip():
            raise ValueError("lora_target_modules is empty: use 'all-linear' or module names such as 'q_proj,v_proj'")
        return targets

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.text_generations and self.objective == "pg":
            raise ValueError(
                "text_generations=True with objective='pg': text-only generations have no behaviour log-probs,"
                " so no importance ratio; use objective 'kto' or 'rwl'"
            )
        if self.require_consent and not self.consent_property.strip():
            raise ValueError("consent_property is empty; name the event property that carries consent")
        return self

    @classmethod
    def group_of(cls, name: str) -> str:
        """The group (`GROUPS`) field `name` belongs to."""
        extra = cls.model_fields[name].json_schema_extra
        return str(extra["group"]) if isinstance(extra, dict) else ""

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainerConfig:
        """The fields in `values` (a JSON file's), over the environment's `FLYWHEEL_TRAINER_*`, over the defaults."""
        unknown = sorted(set(values) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"unknown TrainerConfig fields {unknown}; known: {sorted(cls.model_fields)}")
        return cls(**values)

    def replace(self, **changes: Any) -> TrainerConfig:
        """A copy with `changes`, validated as a new one is."""
        return self.from_dict({**self.to_dict(), **changes})

    def lora_config(self) -> Any:
        """A fresh adapter's `peft.LoraConfig` from the lora_* settings."""
        from peft import LoraConfig

        targets = self.lora_target_modules.strip()
        modules: str | list[str] = (
            "all-linear" if targets == "all-linear" else [m.strip() for m in targets.split(",") if m.strip()]
        )
        return LoraConfig(r=self.lora_rank, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=modules, task_type="CAUSAL_LM")  # fmt: skip

