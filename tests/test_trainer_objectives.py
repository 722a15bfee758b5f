"""The objectives' numerics against naive per-token reference implementations."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from flywheel.lm import Policy, load_policy
from flywheel.lm.corpus import held_out_files
from trainer.config import TrainerConfig
from trainer.data import Sample
from trainer.loop import abstain_loss, context_log_loss, decline_probabilities, score_samples, train_policy
from trainer.objectives import (
    advantages,
    importance_ratios,
    kl_k3,
    kto_loss,
    policy_gradient_loss,
    pretraining_loss,
)
from trainer.scoring import scorer_for


def _batch(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 1, 4]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(5)] for n in lengths])  # (4, 5)
    logprobs = -torch.rand(4, 5, generator=g) * 3 * mask
    behaviour = (logprobs + torch.randn(4, 5, generator=g) * 0.6) * mask
    ref = (logprobs + torch.randn(4, 5, generator=g) * 0.3) * mask
    adv = torch.tensor([1.5, -0.5, 0.25, -1.25])
    return logprobs, behaviour, ref, mask, adv


def _naive_pg(logprobs, behaviour, ref, mask, adv, correction, clip_eps, is_cap, kl_coef, aggregation):
    per_sample, all_tokens = [], []
    for i in range(logprobs.shape[0]):
        terms = []
        for t in range(logprobs.shape[1]):
            if mask[i, t] == 0:
                continue
            lp, mu, rf, a = float(logprobs[i, t]), float(behaviour[i, t]), float(ref[i, t]), float(adv[i])
            rho = math.exp(lp - mu)
            if correction == "ppo_clip":
                pg = -min(rho * a, min(max(rho, 1 - clip_eps), 1 + clip_eps) * a)
            else:
                pg = -min(rho, is_cap) * a * lp
            q = rf - lp
            terms.append(pg + kl_coef * (math.exp(q) - q - 1))
        all_tokens += terms
        if terms:
            per_sample.append(sum(terms) / len(terms))
    if aggregation == "token":
        return sum(all_tokens) / len(all_tokens)
    return sum(per_sample) / len(per_sample)


def test_importance_ratios_match_a_per_token_loop() -> None:
    logprobs, behaviour, _, mask, _ = _batch()
    ratios = importance_ratios(logprobs, behaviour, mask)
    for i in range(4):
        for t in range(5):
            want = math.exp(float(logprobs[i, t] - behaviour[i, t])) if mask[i, t] else 1.0
            assert float(ratios[i, t]) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("correction", ["ppo_clip", "tis"])
@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_policy_gradient_loss_matches_naive_reference(correction: str, aggregation: str) -> None:
    logprobs, behaviour, ref, mask, adv = _batch(seed=1)
    kwargs = dict(correction=correction, clip_eps=0.2, is_cap=1.5, kl_coef=0.1, aggregation=aggregation)
    loss, stats = policy_gradient_loss(logprobs, behaviour, ref, mask, adv, **kwargs)
    assert float(loss) == pytest.approx(_naive_pg(logprobs, behaviour, ref, mask, adv, **kwargs), rel=1e-5)
    assert stats.tokens == 13 and 0.0 <= stats.clip_fraction <= 1.0 and stats.clip_fraction > 0


@pytest.mark.parametrize("correction", ["ppo_clip", "tis"])
def test_policy_gradient_gradient_matches_naive_reference(correction: str) -> None:
    logprobs, behaviour, ref, mask, adv = _batch(seed=2)
    kwargs = dict(correction=correction, clip_eps=0.2, is_cap=1.5, kl_coef=0.1, aggregation="sequence")
    x = logprobs.clone().requires_grad_(True)
    policy_gradient_loss(x, behaviour, ref, mask, adv, **kwargs)[0].backward()
    # Finite differences of the naive implementation, token by token.
    eps = 1e-3
    for i, t in [(0, 0), (0, 4), (1, 2), (2, 0), (3, 3)]:
        up, down = logprobs.clone(), logprobs.clone()
        up[i, t] += eps
        down[i, t] -= eps
        numeric = (
            _naive_pg(up, behaviour, ref, mask, adv, **kwargs)
            - _naive_pg(down, behaviour, ref, mask, adv, **kwargs)
        ) / (2 * eps)
        if correction == "tis":  # the truncated weight is a constant (detached) in the estimator's gradient
            rho = min(math.exp(float(logprobs[i, t] - behaviour[i, t])), 1.5)
            q = float(ref[i, t] - logprobs[i, t])
            n = float(mask[i].sum())
            numeric = (-rho * float(adv[i]) + 0.1 * (1 - math.exp(q))) / n / 4
        assert float(x.grad[i, t]) == pytest.approx(numeric, rel=2e-3, abs=1e-6)
    assert float(x.grad[2, 3]) == 0.0  # padding gets no gradient


def test_padding_only_batch_gives_zero_loss_not_nan() -> None:
    z = torch.zeros(2, 3, requires_grad=True)
    loss, stats = policy_gradient_loss(
        z, z.detach(), z.detach(), torch.zeros(2, 3), torch.ones(2),
        correction="ppo_clip", clip_eps=0.2, is_cap=2.0, kl_coef=0.1, aggregation="token",
    )  # fmt: skip
    loss.backward()
    assert loss.item() == 0.0 and stats.tokens == 0 and not math.isnan(stats.kl)


def test_on_policy_ppo_equals_reinforce_with_baseline() -> None:
    # behaviour == current policy: ratio 1, and PPO's gradient is REINFORCE's, -A * grad log pi.
    logprobs, _, _, mask, adv = _batch(seed=3)
    x = logprobs.clone().requires_grad_(True)
    loss, stats = policy_gradient_loss(
        x, logprobs, logprobs, mask, adv,
        correction="ppo_clip", clip_eps=0.2, is_cap=2.0, kl_coef=0.0, aggregation="token",
    )  # fmt: skip
    loss.backward()
    assert torch.allclose(x.grad, -adv[:, None] * mask / mask.sum())
    assert stats.ratio_mean == pytest.approx(1.0) and stats.clip_fraction == 0.0


def test_k3_is_nonnegative_and_zero_only_at_equality() -> None:
    a = torch.linspace(-3, 0, 7)
    assert torch.all(kl_k3(a, a) == 0)
    assert torch.all(kl_k3(a, a.flip(0))[a != a.flip(0)] > 0)


def test_advantages_subtract_the_baseline_and_normalise() -> None:
    r = torch.tensor([1.0, 0.0, -1.0, 2.0])
    assert torch.allclose(advantages(r, baseline=None, normalise=False), r - 0.5)
    assert torch.allclose(advantages(r, baseline=1.0, normalise=False), r - 1.0)
    normed = advantages(r, baseline=None, normalise=True)
    assert float(normed.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(normed.std(unbiased=False)) == pytest.approx(1.0, rel=1e-4)


def test_kto_matches_the_paper_formula() -> None:
    logprobs, _, ref, mask, _ = _batch(seed=4)
    desirable = torch.tensor([1.0, 0.0, 1.0, 0.0])
    loss, _ = kto_loss(logprobs, ref, mask, desirable, beta=0.5, lambda_desirable=1.0, lambda_undesirable=2.0)
    r = [float(((logprobs[i] - ref[i]) * mask[i]).sum()) for i in range(4)]
    z0 = max(0.0, sum(r) / 4)
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    terms = [
        (1.0 - sig(0.5 * (r[i] - z0))) if desirable[i] else (2.0 - 2.0 * sig(0.5 * (z0 - r[i])))
        for i in range(4)
    ]
    assert float(loss) == pytest.approx(sum(terms) / 4, rel=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"objective": "dpo"}, "objective"),
        ({"clip_eps": 1.5}, "clip_eps"),
        ({"is_cap": 0.5}, "is_cap"),
        ({"kl_coef": -1}, "kl_coef"),
        ({"abstain_coef": -1}, "abstain_coef"),
        ({"device": "tpu"}, "device"),
        ({"replay_fraction": 2}, "replay_fraction"),
        ({"consent_property": " "}, "consent_property"),
        ({"own_cpu_budget_s": -1}, r"own_cpu_budget_s\s+Input should be greater than or equal to 0"),  # names the field
        ({"own_cpu_budget_s": 1e5}, "own_cpu_budget_s"),
        ({"own_cpu_budget_s": float("nan")}, "own_cpu_budget_s"),
        ({"kto_beta": 0}, "kto_beta"),  # the KTO part's bounds hold whatever the objective
        ({"text_generations": True}, "text_generations=True with objective='pg'"),  # a cross-field check
    ],
)
def test_trainer_config_refuses_bad_input_and_says_how_to_fix_it(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**kwargs)
    assert TrainerConfig.from_dict(TrainerConfig(objective="kto").to_dict()).objective == "kto"
    with pytest.raises(ValueError, match="unknown TrainerConfig fields"):
        TrainerConfig.from_dict({"lr": 1})


def test_the_abstain_term_moves_declining_toward_what_declining_would_have_earned(tiny_model_dir: Path) -> None:
    """A shown suggestion rejected (reward below declining's 0) makes declining in its context more likely; an
    accepted one less likely; a declined sample adds nothing (its reward is declining's)."""
    policy = load_policy(tiny_model_dir)
    prompt = policy.encode_prompt("# the next line explains why\n# ", max_tokens=8)
    stop = policy.stop_ids

    def p_decline() -> float:
        with torch.no_grad():
            return float(decline_probabilities(policy.model, [prompt], stop, policy.pad_id)[0])

    def sample(reward: float, completion: list[int]) -> Sample:
        return Sample("g", "u", prompt, completion, [0.0] * len(completion), reward, "1", datetime.now(UTC))

    declined = sample(0.5, [stop[0]])
    assert float(abstain_loss(policy.model, [declined], stop, policy.pad_id, 0.0)) == 0.0
    start = {k: v.clone() for k, v in policy.model.state_dict().items()}
    moved = {}
    for reward in (-0.25, 0.75):
        policy.model.load_state_dict(start)
        before = p_decline()
        optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
        for _ in range(3):
            optimizer.zero_grad()
            abstain_loss(policy.model, [sample(reward, [5, 6])], stop, policy.pad_id, 0.0).backward()
            optimizer.step()
        moved[reward] = p_decline() - before
    assert moved[-0.25] > 0 > moved[0.75], moved
    policy.model.load_state_dict(start)
    p0 = p_decline()
    stats = train_policy(policy.model, [sample(-0.25, [5, 6])], [[0.0, 0.0]],
                         TrainerConfig(abstain_coef=1.0, batch_size=1), scorer_for(False), policy.pad_id,
                         stop_ids=stop).history  # fmt: skip
    assert stats[0].abstain == pytest.approx(-0.25 * p0, rel=1e-4)  # logged beside the loss, before its coef
    with pytest.raises(ValueError, match="stop_ids"):  # asked for, never silently left out
        train_policy(policy.model, [sample(-0.25, [5, 6])], [[0.0, 0.0]], TrainerConfig(abstain_coef=1.0),
                     scorer_for(False), policy.pad_id)  # fmt: skip


def test_the_pretraining_term_is_the_mean_token_log_loss_and_zero_on_no_text() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-4.0, 0.0, 0.0]], requires_grad=True)  # (B, L)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(pretraining_loss(logprobs, mask)) == pytest.approx((1 + 2 + 4) / 3)  # per token, not per text
    empty = pretraining_loss(logprobs, torch.zeros_like(mask))
    assert float(empty) == 0.0 and not torch.isnan(empty)
    empty.backward()  # a graph even with nothing to score
    assert logprobs.grad is not None and float(logprobs.grad.abs().sum()) == 0.0


def test_the_pretraining_mix_holds_held_out_log_loss_while_the_policy_still_moves(tiny_model_dir: Path) -> None:
    """PPO-ptx (`ptx_coef`): the same seeded cycle on logged code contexts, with and without the term. Without
    it, the policy gradient's steps raise the next-token log-loss of code from other files; with it, the rise
    is smaller, and the weights still move."""
    torch.manual_seed(0)
    files = (f.read_text(errors="replace") for f in held_out_files(40, 0)[::7])
    texts = [t[len(t) // 2 : len(t) // 2 + 300] for t in files]  # code the tiny model never trained on
    texts = [t for t in texts if len(t) == 300]
    contexts, held_out = texts[:24], texts[24:32]
    assert len(held_out) == 8
    at = datetime.now(UTC)

    def log_loss(policy: Policy) -> float:
        rows = [Sample("h", "u", policy.encode_prompt(t, max_tokens=1), [1], [0.0], 0.0, "1", at) for t in held_out]
        with torch.no_grad():
            return float(context_log_loss(policy.model, rows, policy.pad_id, window=None))

    rise, moved, ptx = {}, {}, {}
    for coef in (0.0, 1.0):
        policy = load_policy(tiny_model_dir)
        start = [p.detach().clone() for p in policy.model.parameters()]
        samples = []
        for i in range(48):
            g = policy.generate(contexts[i % 24], max_tokens=8, seed=i)
            reward = 1.0 if g.finish_reason != "length" else -1.0
            samples.append(Sample(f"g{i}", "u", g.prompt_token_ids, g.completion_token_ids, g.logprobs, reward, "1",
                                  at))  # fmt: skip
        reference = score_samples(policy.model, samples, scorer_for(False), policy.pad_id, 8)
        before = log_loss(policy)
        config = TrainerConfig(learning_rate=3e-3, batch_size=8, epochs=2, ptx_coef=coef)
        history = train_policy(policy.model, samples, reference, config, scorer_for(False), policy.pad_id).history
        rise[coef] = log_loss(policy) - before
        moved[coef] = max(float((p - s).abs().max()) for p, s in zip(policy.model.parameters(), start, strict=True))
        ptx[coef] = history[0].ptx
    assert rise[0.0] > 0.05 and rise[1.0] < rise[0.0] - 0.05, rise
    assert moved[1.0] > 0.5 * moved[0.0] > 0, moved
    assert ptx[0.0] == 0.0 and 2.0 < ptx[1.0] < 10.0  # logged before its coefficient: a log-loss in nats
