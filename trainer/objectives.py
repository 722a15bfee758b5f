"""Training objectives for single-sample, late, off-policy feedback; pure torch.

Shapes: `B` samples, `T` completion tokens (right-padded, `mask` 1.0 on real tokens).
Every function handles an all-padding batch (e.g. only declined, empty completions)
by returning a zero loss that still has a graph, so a step never produces NaN.
`pretraining_loss` reads (B, L) token log-probs of whole texts instead of completions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# log-ratios are clamped before exp so a sample from a very old version cannot overflow
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class LossStats:
    """Detached per-step statistics for logging (python floats, one sync per step)."""

    loss: float
    kl: float
    ratio_mean: float
    ratio_max: float
    clip_fraction: float
    tokens: int


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over positions where `mask` is 1; 0 (not NaN) when nothing is unmasked."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(per_token: Tensor, mask: Tensor, how: str) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    "token": mean over every real token of the batch (long completions weigh more; DAPO, Yu et al. 2025).
    "sequence": mean over tokens within each sample, then over samples (each sample weighs the same).
    """
    if how == "token":
        return masked_mean(per_token, mask)
    lengths = mask.sum(dim=1)  # (B,)
    per_sample = (per_token * mask).sum(dim=1) / lengths.clamp(min=1.0)  # (B,)
    has_tokens = (lengths > 0).float()  # (B,)
    return (per_sample * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def importance_ratios(logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token ratio pi_theta(y_t | x, y_<t) / mu(y_t | x, y_<t), exactly 1.0 on padding. (B, T)

    `behaviour_logprobs` are the log-probs serving logged when it sampled the token, so a
    sample keeps a correct ratio however old the version that served it.
    """
    log_ratio = (logprobs - behaviour_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO) * mask
    return torch.exp(log_ratio)


def advantages(rewards: Tensor, *, baseline: float | None, normalise: bool, eps: float = 1e-6) -> Tensor:
    """A = r - b per sample (B,); b is the batch mean when `baseline` is None.

    One rollout per prompt rules out a per-prompt group baseline (GRPO); a batch mean (or a
    running mean passed as `baseline`) is the variance-reducing baseline of REINFORCE
    (Williams 1992). Normalising by the std keeps the step size independent of the reward scale.
    """
    b = rewards.mean() if baseline is None else torch.as_tensor(baseline, dtype=rewards.dtype)
    adv = rewards - b
    if normalise and rewards.numel() > 1:
        adv = adv / (adv.std(unbiased=False) + eps)
    return adv


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate k3 = exp(q) - q - 1 with q = log pi_ref - log pi_theta.

    Non-negative, unbiased on tokens sampled from pi_theta, low variance (J. Schulman,
    "Approximating KL divergence", 2020; used by GRPO, Shao et al. 2024, eq. 4). (B, T)
    """
    q = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(q) - q - 1.0


def pretraining_loss(text_logprobs: Tensor, mask: Tensor) -> Tensor:
    """PPO-ptx's pretraining term as a loss: the mean negative log-likelihood per token of text the policy should
    keep modelling (Ouyang et al. 2022, "Training language models to follow instructions with human feedback",
    eq. 2: the RL objective plus gamma * E_{x ~ D_pretrain}[log pi_theta(x)]; the caller weighs it by gamma).

    `text_logprobs` (B, L): log pi_theta(x_t | x_<t) of each text's tokens, right-padded, `mask` (B, L) 1.0 on
    real tokens. Every token weighs the same, as the log-loss a language-model gate reads does. 0 with a graph
    when nothing is unmasked (no text, or one-token texts), never NaN.

    The KL penalty holds the policy to the champion only on the tokens it samples; this term holds the whole
    next-token distribution on real text, which the KL does not see, where RL's drift shows as perplexity.
    """
    return -masked_mean(text_logprobs, mask)


def policy_gradient_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    adv: Tensor,
    *,
    correction: str,
    clip_eps: float,
    is_cap: float,
    kl_coef: float,
    aggregation: str,
) -> tuple[Tensor, LossStats]:
    """Off-policy policy-gradient loss with a KL penalty to the reference (the starting champion).

    correction="ppo_clip": L = -min(rho * A, clip(rho, 1-eps, 1+eps) * A)   (Schulman et al. 2017, eq. 7)
    correction="tis":      L = -min(rho, C).detach() * A * log pi_theta      (truncated importance sampling:
        Espeholt et al. 2018 (IMPALA, V-trace truncation); Yao et al. 2025 for LLM RL)
    plus kl_coef * k3(pi_theta || pi_ref) per token. `rho` is the per-token importance ratio,
    `A` the sample's advantage broadcast over its tokens.
    """
    ratio = importance_ratios(logprobs, behaviour_logprobs, mask)  # (B, T)
    a = adv[:, None].to(logprobs.dtype)  # (B, 1)
    if correction == "ppo_clip":
        unclipped = ratio * a
        clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * a
        pg = -torch.minimum(unclipped, clipped)  # (B, T)
        clip_hit = (clipped < unclipped).float()  # the clip bound, not the ratio, set the token's loss
    elif correction == "tis":
        weight = ratio.clamp(max=is_cap).detach()
        pg = -weight * a * logprobs  # (B, T)
        clip_hit = (ratio > is_cap).float()
    else:
        raise ValueError(f"unknown correction {correction!r}; use 'ppo_clip' or 'tis'")
    kl = kl_k3(logprobs, ref_logprobs)  # (B, T)
    loss = aggregate(pg + kl_coef * kl, mask, aggregation)
    with torch.no_grad():
        n = int(mask.sum().item())
        real = mask > 0
        stats = LossStats(
            loss=float(loss.item()),
            kl=float(masked_mean(kl, mask).item()),
            ratio_mean=float(masked_mean(ratio, mask).item()),
            ratio_max=float(ratio[real].max().item()) if n else 1.0,
            clip_fraction=float(masked_mean(clip_hit, mask).item()),
            tokens=n,
        )
    return loss, stats


def reward_weighted_likelihood_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    adv: Tensor,
    *,
    beta: float,
    max_weight: float,
    kl_coef: float,
    aggregation: str,
) -> tuple[Tensor, LossStats]:
    """Advantage-weighted regression (Peng et al. 2019, "Advantage-Weighted Regression", eq. 7; reward-
    weighted regression, Peters & Schaal 2007): L = -w * log pi_theta(y_t | x, y_<t) + kl_coef * k3 per
    token, w = min(exp(A / beta), max_weight) per sample (not back-propagated).

    It needs no behaviour log-probs: weighted maximum likelihood on samples from any policy moves toward
    the better of them, which is what makes it valid for generations known only as text (a product's own
    model, re-tokenised). The cap bounds one sample's pull (AWR clips its weights the same way).
    """
    weight = torch.exp(adv / beta).clamp(max=max_weight).detach()[:, None].to(logprobs.dtype)  # (B, 1)
    kl = kl_k3(logprobs, ref_logprobs)  # (B, T)
    loss = aggregate(-weight * logprobs + kl_coef * kl, mask, aggregation)
    with torch.no_grad():
        n = int(mask.sum().item())
        stats = LossStats(
            loss=float(loss.item()),
            kl=float(masked_mean(kl, mask).item()),
            ratio_mean=1.0,
            ratio_max=1.0,
            clip_fraction=float((weight >= max_weight).float().mean().item()) if weight.numel() else 0.0,
            tokens=n,
        )
    return loss, stats


def kto_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    desirable: Tensor,
    *,
    beta: float,
    lambda_desirable: float,
    lambda_undesirable: float,
) -> tuple[Tensor, LossStats]:
    """KTO for unpaired good / bad labels (Ethayarajh et al. 2024, "KTO: Model Alignment as
    Prospect Theoretic Optimization", eq. 8).

    r = log pi_theta(y|x) - log pi_ref(y|x) summed over the completion; z0 is the reference
    point KL(pi_theta || pi_ref), not back-propagated. The paper estimates z0 on mismatched
    (x, y') pairs; with one logged sample per prompt we estimate it on the batch's own
    samples (clamped at 0), which is what it measures when the samples are on-policy.
    v = lambda_D * sigmoid(beta (r - z0)) for desirable, lambda_U * sigmoid(beta (z0 - r)) otherwise;
    L = mean(lambda_y - v).
    """
    r = ((logprobs - ref_logprobs) * mask).sum(dim=1)  # (B,)
    has_tokens = (mask.sum(dim=1) > 0).float()  # (B,)
    n = has_tokens.sum().clamp(min=1.0)
    z0 = ((r * has_tokens).sum() / n).clamp(min=0.0).detach()
    good = desirable.to(r.dtype)
    value = good * lambda_desirable * torch.sigmoid(beta * (r - z0)) + (1.0 - good) * lambda_undesirable * (
        torch.sigmoid(beta * (z0 - r))
    )
    lam = good * lambda_desirable + (1.0 - good) * lambda_undesirable
    loss = ((lam - value) * has_tokens).sum() / n
    with torch.no_grad():
        kl = kl_k3(logprobs, ref_logprobs)
        stats = LossStats(
            loss=float(loss.item()),
            kl=float(masked_mean(kl, mask).item()),
            ratio_mean=1.0,
            ratio_max=1.0,
            clip_fraction=0.0,
            tokens=int(mask.sum().item()),
        )
    return loss, stats
