"""`TrainerConfig`: the whole configuration of one training cycle, validated up front."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch


@dataclass
class TrainerConfig:
    """How a cycle selects data and updates the policy.

    Objective
        objective: "pg" (off-policy policy gradient, one logged sample per prompt; needs serving's
            behaviour log-probs), "kto" (unpaired good / bad labels, e.g. thumbs) or "rwl"
            (reward-weighted likelihood: advantage-weighted regression). "kto" and "rwl" need no
            behaviour log-probs, so they alone can learn from text-only generations.
        correction: for "pg": "ppo_clip" (clip the per-token ratio to [1-clip_eps, 1+clip_eps]) or
            "tis" (truncated importance sampling, ratio capped at is_cap).
        kl_coef: weight of the per-token KL penalty to the champion the cycle started from.
        baseline: "batch_mean" or a fixed number subtracted from rewards; normalise_advantages
            divides by the batch std.
        loss_aggregation: "sequence" (every sample weighs the same) or "token" (every token does).
        abstain_coef, abstain_reward: declining (end-of-text first) earns a known reward
            (`abstain_reward`, 0 under Cursor's scheme) in every context, so each shown sample also
            says what declining would have earned instead. With `abstain_coef` > 0 the loss adds
            abstain_coef x mean((r - abstain_reward) x p(decline | prompt)) over shown samples: the
            exact gradient of the expected reward through the decline choice, with the shown
            suggestion's reward as its value. Where suggestions are rejected it raises declining,
            where they are accepted it lowers it. 0 (default) leaves it out.
        ptx_coef: weight gamma of a pretraining-mix term (InstructGPT's PPO-ptx, Ouyang et al. 2022, eq. 2):
            gamma x the mean next-token log-loss of each batch's logged contexts (its samples' distinct prompts,
            the text the product served; the last `trainer.loop.PTX_WINDOW` tokens of each) is added to the loss,
            so the policy keeps modelling the product's text while it moves toward what users accept; the KL term
            holds only the tokens it samples. Costs one more forward and backward pass over those windows a step.
            0 (default) leaves it out; at most 10 (beyond, the language-model term drowns the reward).
        kto_beta, kto_lambda_desirable, kto_lambda_undesirable, kto_threshold: KTO's beta, class
            weights, and the reward above which a sample counts as desirable.
        rwl_beta, rwl_max_weight: "rwl" weighs each sample's log-likelihood by exp(advantage / rwl_beta),
            capped at rwl_max_weight.
        text_generations: also learn from generations known only as text (a product's own model, or
            unsigned): tokenised by the current policy, trained without behaviour log-probs. Needs
            objective "kto" or "rwl"; off (the default), they are left out with their reason.
    Update
        update: what a cycle trains and registers. "full" (default): every weight, registered as a lossless delta
            against the champion; right for the small embedded model (a delta of a few MB, one copy served per
            version). "lora": a LoRA adapter (peft) on a frozen base, registered as a standard peft directory with
            its base's version and content hash (`ModelRegistry.register_adapter`): megabytes for a model of
            billions of parameters, and champion and challenger served as two adapters on one copy of the base
            (serving's HF back end through peft, vLLM through its runtime LoRA API). Use it for large models
            and for many arms. A champion that is full weights becomes the new adapter's base; a champion that
            is an adapter is continued (its rank, alpha and target modules kept, the lora_* settings below
            apply to a fresh adapter only) on the same base. "full" from an adapter champion merges it first.
            LoRA learns with a higher learning_rate than full weights (1e-4 to 1e-3 is usual, against 1e-5).
        lora_rank, lora_alpha, lora_dropout: a fresh adapter's rank r, scale alpha (the update is
            alpha / r x B A) and dropout on its input.
        lora_target_modules: the modules that get an adapter: "all-linear" (default: every linear layer of
            the transformer blocks, the output head left out; peft finds them in any architecture) or a
            comma-separated list of module-name suffixes ("q_proj,v_proj" for Llama, Qwen2 and Mistral,
            "c_attn" for GPT-2, "qkv_proj" for Phi-3).
    Optimisation
        learning_rate, weight_decay, batch_size (per process), epochs, max_steps (0 = no cap),
        grad_clip (0 = off), seed, device ("cpu", "cuda", "cuda:1"), dtype ("float32", "bfloat16": what
        training computes in; the champion is loaded in it, a bfloat16 one upcast exactly).
        save_dtype: what the candidate is stored in. "bfloat16" (the default) keeps the registry's delta
            against a bfloat16 parent small (a default cycle of the embedded model: 8x under the full
            file, where float32 gives 1.8x, every value's low bits changing; README, Benchmarks):
            float32 weights are rounded to bfloat16 stochastically (`flywheel.lm.precision`), so an
            update smaller than half a bfloat16 step still moves a weight, with probability
            |update| / step, instead of being lost; seeded by `seed`, the champion and the data (a
            cycle is reproducible, the next one draws afresh). Serving and the trainer both compute
            on these values upcast to float32, so they still agree bit for bit. "float32" stores
            every bit of the trained weights.
        exact_logprobs: train with per-sample forward passes, bit-identical to serving's behaviour
            log-probs (ratio exactly 1 on unchanged weights) but ~5x slower on CPU; the default
            scores each batch in one padded pass (~1e-6 apart from serving in fp32, reported).
        exact_check_samples: samples (served by the champion) re-scored per sample before training
            to check serving and trainer agree exactly (`exact_mismatch_*` metrics; 0 = skip).
    Data
        reward_version: train on this reward definition ("" = the active one of each surface).
        min_samples: skip the cycle below this many eligible samples (None = settings.min_train_samples).
        max_samples: at most this many samples a cycle (0 = all eligible since the parent's window).
            When more are eligible, a seeded uniform sample of them is kept (reservoir sampling:
            every eligible sample equally likely, old or new) and the cycle reports how many were
            left out and by that rule (`left_out_*` metrics, the log, a skip's reason).
        ope_holdout_share: share of eligible generations (by a hash of their id, `flywheel.holdout`) left
            out of training, and reported, so the offline gate estimates the candidate on champion
            traffic it never saw (0 = none: the gate then says its estimate is in-sample).
        time_budget_s: wall-clock seconds the optimisation may take (0 = no budget), counted from its first
            step: the scoring (and with `own_samples`, sampling) before it is reported apart
            (`prepare_seconds`). Samples are visited in a seeded random order, so a cycle that runs out stops
            after the step past the budget having trained on a uniform sample, and reports the samples it did
            not reach.
        target_kl: stop the cycle once the mean per-token KL to the champion over its last
            `KL_STOP_STEPS` steps passes this many nats (0 = never): PPO's early stop (Schulman et al.
            2017; OpenAI Baselines' `target_kl`). It is measured on the logged tokens of each batch,
            the champion's, while the offline gate's `max_kl` reads the candidate's own completions,
            which read higher: set it well under `max_kl` (README, "Does it make users happier?").
            Samples not reached are reported, like the time budget's.
        replay_fraction: add up to this fraction of older (already trained on) samples.
        own_samples: train on the champion's own samples instead of the logged ones (0 = off): a reward model
            is fitted on the cycle's logged rewards (`trainer.reward_model`: ridge regression on text features,
            its penalty cross-validated), then `own_samples` fresh completions (at most `own_max_tokens`
            tokens) of each logged prompt are sampled from the champion and scored by it; each sample's
            reward is its score minus its prompt group's mean. On-policy, so `pg`'s ratio starts at 1.
        own_max_prompts: sample own completions of at most this many distinct logged prompts, a seeded uniform
            choice of them (0 = every prompt), so a cycle's sampling costs the same however much traffic it
            had; every logged reward still fits the reward model, and the note says how many were sampled.
        own_cpu_budget_s: CPU-seconds of this process (every thread: `time.process_time`, not wall time, which
            on a loaded machine measures everyone else's work too) that preparing own samples may take, counted
            from the cycle's first scoring of its logged samples (0 = no budget; at most 3600). The prompts are
            visited in a seeded uniform order, a group of them at a time, and none starts once the budget is
            spent (the first always runs), so those covered are a uniform sample; the cycle's reason and metrics
            (`own_prompts_covered`, `own_prompts_total`, `own_cpu_seconds`) say how many. Ignored without
            `own_samples`.
        reward_model_min_z: how many standard errors from zero the reward model's cross-validated correlation
            with the logged rewards must be (r x sqrt(rows): about 1 when the text says nothing of the reward)
            for the cycle to train on own samples; under it, it trains on the logged samples and says so.
        require_consent / consent_property: train only on users whose latest event carrying
            `consent_property` set it true.
        mismatch_threshold: |trainer - serving| log-prob difference counted as a mismatch.
    """

    objective: Literal["pg", "kto", "rwl"] = "pg"
    correction: Literal["ppo_clip", "tis"] = "ppo_clip"
    clip_eps: float = 0.2
    is_cap: float = 2.0
    kl_coef: float = 0.05
    baseline: Literal["batch_mean"] | float = "batch_mean"
    normalise_advantages: bool = True
    loss_aggregation: Literal["sequence", "token"] = "sequence"
    abstain_coef: float = 0.0
    abstain_reward: float = 0.0
    ptx_coef: float = 0.0
    kto_beta: float = 0.1
    kto_lambda_desirable: float = 1.0
    kto_lambda_undesirable: float = 1.0
    kto_threshold: float = 0.0
    rwl_beta: float = 1.0
    rwl_max_weight: float = 20.0
    text_generations: bool = False

    update: Literal["full", "lora"] = "full"
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"

    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    batch_size: int = 8
    epochs: int = 1
    max_steps: int = 0
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    save_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    exact_logprobs: bool = False
    exact_check_samples: int = 64

    reward_version: str = ""
    min_samples: int | None = None
    max_samples: int = 0
    time_budget_s: float = 0.0
    target_kl: float = 0.0
    ope_holdout_share: float = 0.0
    replay_fraction: float = 0.0
    own_samples: int = 0
    own_max_tokens: int = 16
    own_max_prompts: int = 512
    own_cpu_budget_s: float = 0.0
    reward_model_min_z: float = 2.0
    require_consent: bool = True
    consent_property: str = "training_consent"
    mismatch_threshold: float = 1e-3

    def __post_init__(self) -> None:
        errors = []
        if self.objective not in ("pg", "kto", "rwl"):
            errors.append(
                f"objective={self.objective!r}: use 'pg' (policy gradient), 'kto' or 'rwl' (reward-weighted likelihood)"
            )
        if self.text_generations and self.objective == "pg":
            errors.append(
                "text_generations=True with objective='pg': text-only generations have no behaviour log-probs,"
                " so no importance ratio; use objective 'kto' or 'rwl'"
            )
        if self.rwl_beta <= 0 or self.rwl_max_weight <= 0:
            errors.append("rwl_beta and rwl_max_weight must be > 0")
        if self.correction not in ("ppo_clip", "tis"):
            errors.append(f"correction={self.correction!r}: use 'ppo_clip' or 'tis'")
        if not 0.0 < self.clip_eps < 1.0:
            errors.append(f"clip_eps={self.clip_eps}: must be in (0, 1); 0.2 is the usual value")
        if self.is_cap < 1.0:
            errors.append(f"is_cap={self.is_cap}: must be >= 1 (a cap below 1 down-weights on-policy tokens)")
        if self.abstain_coef < 0:
            errors.append(f"abstain_coef={self.abstain_coef}: must be >= 0")
        if not 0 <= self.ptx_coef <= 10:
            errors.append(
                f"ptx_coef={self.ptx_coef}: must be in [0, 10] (0 = no pretraining-mix term; InstructGPT used"
                " 27.8 on a loss summed differently, here values near 0.1-1 weigh it against a normalised advantage)"
            )
        if self.kl_coef < 0:
            errors.append(f"kl_coef={self.kl_coef}: must be >= 0")
        if not (self.baseline == "batch_mean" or isinstance(self.baseline, int | float)):
            errors.append(f"baseline={self.baseline!r}: use 'batch_mean' or a number")
        if self.loss_aggregation not in ("sequence", "token"):
            errors.append(f"loss_aggregation={self.loss_aggregation!r}: use 'sequence' or 'token'")
        if self.kto_beta <= 0:
            errors.append(f"kto_beta={self.kto_beta}: must be > 0")
        if self.kto_lambda_desirable <= 0 or self.kto_lambda_undesirable <= 0:
            errors.append("kto_lambda_desirable and kto_lambda_undesirable must be > 0")
        if self.update not in ("full", "lora"):
            errors.append(f"update={self.update!r}: use 'full' (every weight) or 'lora' (a LoRA adapter)")
        if self.lora_rank < 1 or self.lora_alpha <= 0:
            errors.append(f"lora_rank={self.lora_rank}, lora_alpha={self.lora_alpha}: rank must be >= 1, alpha > 0")
        if not 0.0 <= self.lora_dropout < 1.0:
            errors.append(f"lora_dropout={self.lora_dropout}: must be in [0, 1)")
        if not self.lora_target_modules.strip():
            errors.append("lora_target_modules is empty: use 'all-linear' or module names such as 'q_proj,v_proj'")
        if self.learning_rate <= 0:
            errors.append(f"learning_rate={self.learning_rate}: must be > 0")
        if self.batch_size < 1 or self.epochs < 1 or self.max_steps < 0:
            errors.append("batch_size and epochs must be >= 1 and max_steps >= 0")
        if self.grad_clip < 0:
            errors.append(f"grad_clip={self.grad_clip}: must be >= 0 (0 turns clipping off)")
        if self.dtype not in ("float32", "bfloat16"):
            errors.append(f"dtype={self.dtype!r}: use 'float32' or 'bfloat16'")
        if self.save_dtype not in ("bfloat16", "float32"):
            errors.append(f"save_dtype={self.save_dtype!r}: use 'bfloat16' (small deltas) or 'float32'")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            errors.append(f"device={self.device!r}: use 'cpu', 'cuda' or 'cuda:N'")
        elif self.device.startswith("cuda") and not torch.cuda.is_available():
            errors.append(f"device={self.device!r} but no CUDA device is visible; use device='cpu'")
        if self.min_samples is not None and self.min_samples < 1:
            errors.append(
                f"min_samples={self.min_samples}: must be >= 1 (or None for settings.min_train_samples)"
            )
        if self.max_samples < 0:
            errors.append(f"max_samples={self.max_samples}: must be >= 0 (0 = all)")
        if not 0.0 <= self.ope_holdout_share < 1.0:
            errors.append(f"ope_holdout_share={self.ope_holdout_share}: must be in [0, 1) (0 = hold nothing out)")
        if self.time_budget_s < 0:
            errors.append(f"time_budget_s={self.time_budget_s}: must be >= 0 seconds (0 = no budget)")
        if self.target_kl < 0:
            errors.append(f"target_kl={self.target_kl}: must be >= 0 nats (0 = no early stop)")
        if not 0.0 <= self.replay_fraction <= 1.0:
            errors.append(f"replay_fraction={self.replay_fraction}: must be in [0, 1]")
        if self.own_samples < 0 or self.own_max_tokens < 1 or self.own_max_prompts < 0:
            errors.append("own_samples and own_max_prompts must be >= 0 (0 = off / all) and own_max_tokens >= 1")
        if not 0 <= self.own_cpu_budget_s <= 3600:
            errors.append(
                f"own_cpu_budget_s={self.own_cpu_budget_s}: must be 0 (no budget) or up to 3600 CPU-seconds; a"
                " cycle meant to run every few minutes wants tens of seconds"
            )
        if self.reward_model_min_z < 0:
            errors.append(f"reward_model_min_z={self.reward_model_min_z}: must be >= 0 standard errors")
        if self.require_consent and not self.consent_property.strip():
            errors.append("consent_property is empty; name the event property that carries consent")
        if self.exact_check_samples < 0:
            errors.append(f"exact_check_samples={self.exact_check_samples}: must be >= 0 (0 skips the check)")
        if self.mismatch_threshold <= 0:
            errors.append(f"mismatch_threshold={self.mismatch_threshold}: must be > 0")
        if errors:
            raise ValueError("invalid TrainerConfig: " + "; ".join(errors))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown TrainerConfig fields {unknown}; known: {sorted(known)}")
        return cls(**values)

    def lora_config(self) -> Any:
        """A fresh adapter's `peft.LoraConfig` from the lora_* settings."""
        from peft import LoraConfig

        targets = self.lora_target_modules.strip()
        modules: str | list[str] = (
            "all-linear" if targets == "all-linear" else [m.strip() for m in targets.split(",") if m.strip()]
        )
        return LoraConfig(r=self.lora_rank, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=modules, task_type="CAUSAL_LM")  # fmt: skip
