"""The training loop of one cycle: reference log-probs, mismatch report, optimizer steps.

Kept free of MLflow, the lake and the registry so it can be benchmarked and tested alone;
`trainer.cycle` wires it to those.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.config import TrainerConfig
from trainer.data import Sample
from trainer.objectives import (
    advantages,
    kl_k3,
    kto_loss,
    policy_gradient_loss,
    pretraining_loss,
    reward_weighted_likelihood_loss,
)
from trainer.scoring import Scorer, batched_token_logprobs


@dataclass(frozen=True)
class StepStats:
    step: int
    loss: float
    kl: float
    ratio_mean: float
    ratio_max: float
    clip_fraction: float
    tokens: int
    mean_reward: float
    abstain: float = 0.0  # the abstain term's value before its coefficient (0 when off); not in `loss`
    ptx: float = 0.0  # the pretraining-mix term's log-loss before its coefficient (0 when off); not in `loss`

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items() if k != "step"}


@dataclass(frozen=True)
class MismatchReport:
    """How far the trainer's log-probs of logged tokens are from serving's (same weights)."""

    tokens: int
    mean_abs: float
    max_abs: float
    share_over_threshold: float
    threshold: float

    def metrics(self) -> dict[str, float]:
        return {
            "mismatch_tokens": float(self.tokens),
            "mismatch_mean_abs": self.mean_abs,
            "mismatch_max_abs": self.max_abs,
            "mismatch_share_over_threshold": self.share_over_threshold,
        }


def _pad(rows: Sequence[Sequence[float]], width: int, device: torch.device) -> Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32, device=device)  # (B, T)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.float32, device=device)
    return out


@torch.no_grad()
def score_samples(
    model: torch.nn.Module, samples: Sequence[Sample], scorer: Scorer, pad_id: int, batch_size: int
) -> list[list[float]]:
    """Log-probs of each sample's completion tokens under `model` (no gradient)."""
    out: list[list[float]] = []
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        lp, _ = scorer(
            model, [s.prompt_token_ids for s in chunk], [s.completion_token_ids for s in chunk], pad_id
        )
        out.extend(lp[j, : len(s.completion_token_ids)].tolist() for j, s in enumerate(chunk))
    return out


def mismatch_report(
    samples: Sequence[Sample], recomputed: Sequence[Sequence[float]], served_by: str, threshold: float
) -> MismatchReport:
    """Compare recomputed log-probs with serving's, on samples the starting version served itself.

    Samples from older versions differ because the weights differ (that is what the importance
    ratio corrects); redacted prompts differ because the context changed. Neither is mismatch.
    """
    diffs: list[float] = []
    for s, lp in zip(samples, recomputed, strict=True):
        if s.behaviour_logprobs is not None and s.model_version == served_by and not s.prompt_redacted:
            diffs.extend(abs(a - b) for a, b in zip(lp, s.behaviour_logprobs, strict=True))
    if not diffs:
        return MismatchReport(0, math.nan, math.nan, math.nan, threshold)
    return MismatchReport(
        tokens=len(diffs),
        mean_abs=sum(diffs) / len(diffs),
        max_abs=max(diffs),
        share_over_threshold=sum(d > threshold for d in diffs) / len(diffs),
        threshold=threshold,
    )


KL_STOP_STEPS = 4
"""Steps whose batch KL `TrainerConfig.target_kl` compares, averaged: one batch's estimate is noisy."""


@dataclass(frozen=True)
class Training:
    """What `train_policy` did: its steps, how many distinct samples they visited, and why it stopped before the
    end of its epochs ("" when it did not)."""

    history: list[StepStats]
    samples_reached: int
    stopped_at: Literal["", "max_steps", "deadline", "target_kl"] = ""


def recent_kl(history: Sequence[StepStats]) -> float:
    """Mean per-token KL to the champion over the last `KL_STOP_STEPS` steps (each measured before its update)."""
    last = history[-KL_STOP_STEPS:]
    return sum(s.kl for s in last) / len(last) if last else 0.0


def _order(n: int, config: TrainerConfig, epoch: int, world: int) -> list[int]:
    g = torch.Generator().manual_seed(config.seed * 1000 + epoch)
    order = torch.randperm(n, generator=g).tolist()
    # Every process must take the same number of steps: wrap around to a multiple of the world size.
    short = (-len(order)) % world
    return order + order[:short]


def train_policy(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    reference: Sequence[Sequence[float]],
    config: TrainerConfig,
    scorer: Scorer,
    pad_id: int,
    *,
    rank: int = 0,
    world: int = 1,
    on_step: Callable[[StepStats], None] | None = None,
    stop_ids: Sequence[int] = (),
    deadline: float | None = None,
) -> Training:
    """Optimise `model` on `samples` against `reference` log-probs (the starting champion's).

    `deadline` (a `time.monotonic()` value): no step starts after it (the first always runs), so the
    samples trained on are the first steps' share of a seeded random order: a uniform sample. Nor does
    one start once `recent_kl` has passed `config.target_kl` (when set): the same uniform share.

    The baseline and advantage normalisation use the whole cycle's rewards, so every process
    of a distributed run computes the same advantages. The model stays in eval mode: dropout
    would make the recomputed log-probs (and so the importance ratios) differ from serving's.
    """
    if not samples:
        raise ValueError("no samples to train on")
    if config.abstain_coef and not stop_ids:
        raise ValueError("abstain_coef needs the policy's end-of-text ids (stop_ids) to know what declining is")
    text_only = sum(s.behaviour_logprobs is None for s in samples)
    if text_only and config.objective == "pg":
        # trainer.data never selects them for "pg"; this keeps any other caller from computing a ratio.
        raise ValueError(
            f"{text_only} samples have no behaviour log-probs (text-only generations): the off-policy"
            " objective 'pg' cannot use them; use objective 'kto' or 'rwl'"
        )
    device = next(model.parameters()).device
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # (N,)
    baseline = None if config.baseline == "batch_mean" else float(config.baseline)
    adv_all = advantages(rewards, baseline=baseline, normalise=config.normalise_advantages)  # (N,)
    global_batch = config.batch_size * world
    history: list[StepStats] = []
    step = 0
    # an epoch's order is the samples wrapped around to a multiple of the world size (`_order`)
    steps_per_epoch = math.ceil((len(samples) + (-len(samples)) % world) / global_batch)

    def done(stopped_at: Literal["", "max_steps", "deadline", "target_kl"] = "") -> Training:
        reached = len(samples) if step >= steps_per_epoch else step * global_batch
        return Training(history, reached, stopped_at)

    for epoch in range(config.epochs):
        order = _order(len(samples), config, epoch, world)
        for start in range(0, len(order), global_batch):
            if step and deadline is not None and _past(deadline, world, device):
                return done("deadline")
            if config.target_kl and history and _over_kl(recent_kl(history), config.target_kl, world, device):
                return done("target_kl")
            idx = order[start : start + global_batch][rank::world]
            batch = [samples[i] for i in idx]
            width = max(len(s.completion_token_ids) for s in batch)
            logprobs, mask = scorer(
                model, [s.prompt_token_ids for s in batch], [s.completion_token_ids for s in batch], pad_id
            )  # (B, T) each
            ref = _pad([reference[i] for i in idx], width, device)  # (B, T)
            if config.objective == "pg":
                behaviour = _pad([s.behaviour_logprobs or [] for s in batch], width, device)  # (B, T)
                loss, stats = policy_gradient_loss(
                    logprobs, behaviour, ref, mask, adv_all[idx].to(device),
                    correction=config.correction, clip_eps=config.clip_eps,
                    is_cap=config.is_cap, kl_coef=config.kl_coef, aggregation=config.loss_aggregation,
                )  # fmt: skip
            elif config.objective == "rwl":
                loss, stats = reward_weighted_likelihood_loss(
                    logprobs, ref, mask, adv_all[idx].to(device), beta=config.rwl_beta,
                    max_weight=config.rwl_max_weight, kl_coef=config.kl_coef, aggregation=config.loss_aggregation,
                )  # fmt: skip
            else:
                desirable = (rewards[idx] > config.kto_threshold).to(device)
                loss, stats = kto_loss(
                    logprobs, ref, mask, desirable, beta=config.kto_beta,
                    lambda_desirable=config.kto_lambda_desirable,
                    lambda_undesirable=config.kto_lambda_undesirable,
                )  # fmt: skip
            abstain = torch.zeros(())
            if config.abstain_coef and stop_ids:
                abstain = abstain_loss(model, batch, stop_ids, pad_id, config.abstain_reward)
                loss = loss + config.abstain_coef * abstain
            ptx = torch.zeros(())
            if config.ptx_coef:
                ptx = context_log_loss(model, batch, pad_id)
                loss = loss + config.ptx_coef * ptx
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if world > 1 and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
                _all_reduce_grads(params, world)
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            optimizer.step()
            step += 1
            record = StepStats(
                step=step, loss=stats.loss, kl=stats.kl, ratio_mean=stats.ratio_mean,
                ratio_max=stats.ratio_max, clip_fraction=stats.clip_fraction, tokens=stats.tokens,
                mean_reward=float(rewards[idx].mean()), abstain=float(abstain.detach()), ptx=float(ptx.detach()),
            )  # fmt: skip
            history.append(record)
            if on_step is not None:
                on_step(record)
            if config.max_steps and step >= config.max_steps:
                return done("max_steps" if step < steps_per_epoch * config.epochs else "")
    return done()


def _past(deadline: float, world: int, device: torch.device) -> bool:
    """Whether `deadline` has passed on any process (all stop at the same step, or DDP would hang)."""
    late = torch.tensor([float(time.monotonic() > deadline)], device=device)
    if world > 1:
        dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


def _over_kl(kl: float, target: float, world: int, device: torch.device) -> bool:
    """Whether any process's recent KL passed `target` (all stop at the same step, or DDP would hang)."""
    over = torch.tensor([float(kl > target)], device=device)
    if world > 1:
        dist.all_reduce(over, op=dist.ReduceOp.MAX)
    return bool(over.item())


def decline_probabilities(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], stop_ids: Sequence[int], pad_id: int
) -> Tensor:
    """p(end-of-text first | prompt) per prompt (B,): how likely the policy is to decline there (differentiable)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)  # (B, L)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)  # (B, L)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        mask[i, : len(p)] = 1
    last = torch.tensor([len(p) - 1 for p in prompts], device=device)  # (B,)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (B, L, V)
    first = torch.log_softmax(logits[torch.arange(len(prompts), device=device), last].float(), dim=-1)  # (B, V)
    return first[:, list(stop_ids)].exp().sum(-1)


def abstain_loss(
    model: torch.nn.Module, batch: Sequence[Sample], stop_ids: Sequence[int], pad_id: int, abstain_reward: float
) -> Tensor:
    """mean((r - abstain_reward) x p(end-of-text first | prompt)) over the batch's shown samples (0 when none).

    Minimised, it moves probability to declining where the suggestion shown earned less than declining
    would have, and away from it where it earned more (`TrainerConfig.abstain_coef`).
    """
    shown = [s for s in batch if not (len(s.completion_token_ids) == 1 and s.completion_token_ids[0] in stop_ids)]
    device = next(model.parameters()).device
    if not shown:
        return torch.zeros((), device=device)
    p_decline = decline_probabilities(model, [s.prompt_token_ids for s in shown], stop_ids, pad_id)  # (B,)
    gain = torch.tensor([s.reward - abstain_reward for s in shown], dtype=torch.float32, device=device)  # (B,)
    return (gain * p_decline).mean()


PTX_WINDOW = 128
"""Tokens of each logged context the pretraining-mix term reads: its last ones, the bootstrap's training window
(`flywheel.lm.PRESETS["default"].seq_len`). The term's cost grows with them; a window keeps it under the policy
loss's own pass, which reads the whole prompt."""


def context_log_loss(
    model: torch.nn.Module, batch: Sequence[Sample], pad_id: int, window: int | None = PTX_WINDOW
) -> Tensor:
    """Mean next-token log-loss of the batch's distinct logged contexts (prompts; the last `window` tokens of
    each, None = all) under `model`, differentiable: `pretraining_loss` on the product's own text
    (`TrainerConfig.ptx_coef`). 0 with a graph when none has two tokens. Scored in one padded pass: this term
    need not match serving's log-probs, only be their gradient."""
    distinct = dict.fromkeys(tuple(s.prompt_token_ids[-window:] if window else s.prompt_token_ids) for s in batch)
    contexts = [list(p) for p in distinct if len(p) > 1]
    device = next(model.parameters()).device
    if not contexts:
        return torch.zeros((), device=device, requires_grad=True)
    # each context's first token predicts the rest: (B, L-1) log-probs and mask
    logprobs, mask = batched_token_logprobs(model, [c[:1] for c in contexts], [c[1:] for c in contexts], pad_id)
    return pretraining_loss(logprobs, mask)


def _all_reduce_grads(params: Sequence[torch.nn.Parameter], world: int) -> None:
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world)


@torch.no_grad()
def kl_to_reference(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    reference: Sequence[Sequence[float]],
    scorer: Scorer,
    pad_id: int,
    batch_size: int,
) -> float:
    """Mean per-token k3 KL(model || reference) on the cycle's logged tokens."""
    now = score_samples(model, samples, scorer, pad_id, batch_size)
    total, count = 0.0, 0
    for a, b in zip(now, reference, strict=True):
        if a:
            total += float(kl_k3(torch.tensor(a), torch.tensor(b)).sum())
            count += len(a)
    return total / max(count, 1)
