"""The offline gates: each turns a measurement of the candidate (against the champion) into a verdict.

Gates, in order (names as recorded on the version and shown by `GET /api/versions/{v}`):
- `sanity`: the candidate loads, generates on every held-out prompt, no NaN in its log-probs or
  perplexity, empty outputs, declines and outputs cut at max_tokens under their bounds;
- `kl_to_champion`: mean per-token KL(candidate || champion) on its own held-out completions;
- `perplexity_regression`: held-out-text perplexity over the champion's;
- `empty_rate_vs_champion`, `mean_length_vs_champion`: reward-hacking checks (a model that learns
  to answer blank instead of declining, or to pad or clip its suggestions, to please its reward);
- `declined_rate_vs_champion`: a loose bound on the rise in declines. Declining is a legitimate
  action (the reward prices a decline at 0 and a reject below it), but offline no user says where
  it was right: only a flood is stopped here, and the rollout's accepted-rate guardrail decides;
- `ope_satisfaction`: the off-policy estimate of the candidate's mean reward from the champion's
  signed, rewarded traffic (`deploy_gate.offline.offpolicy`: clipped importance ratios and a reward
  model fitted on that traffic), judged on d = DR - the champion's logged mean (the recorded value),
  with a paired
  bootstrap interval: failed when its upper end is < -ope_refuse_margin (significantly worse than
  the champion: the candidate never reaches users, on its estimate alone), passed when its lower
  end is >= -ope_margin, otherwise "insufficient evidence". Fewer than `ope_min_samples` samples,
  or an ESS under `ope_min_ess` without a significant harm, is "insufficient evidence" too. That
  verdict is recorded and shown, and never blocks (a new deployment has no traffic yet; a
  candidate far from the champion has a small ESS): the rollout decides.
A candidate that does not load fails `sanity` and every other gate says it was not run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from deploy_gate.offline import offpolicy
from deploy_gate.offline.config import OfflineGateConfig
from deploy_gate.offline.logged import LoggedTraffic
from deploy_gate.offline.measure import Sampled, mean_kl, perplexity, sample
from flywheel.lm import CheckpointError, Policy, load_policy
from model_registry import OfflineGateResult

GATES = (
    "sanity",
    "kl_to_champion",
    "perplexity_regression",
    "empty_rate_vs_champion",
    "declined_rate_vs_champion",
    "mean_length_vs_champion",
    "ope_satisfaction",
)
VERSUS_CHAMPION = ("empty_rate_vs_champion", "declined_rate_vs_champion", "mean_length_vs_champion")


def _result(name: str, ok: bool, value: float | None, bound: str, detail: str) -> OfflineGateResult:
    finite = value if value is None or math.isfinite(value) else None
    return OfflineGateResult(name, "passed" if ok else "failed", finite, bound, detail)


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_gates(
    candidate_dir: Path,
    champion: Policy,
    prompts: list[str],
    texts: list[str],
    traffic: LoggedTraffic,
    config: OfflineGateConfig,
    *,
    in_sample: bool = False,
) -> list[OfflineGateResult]:
    """Every gate's verdict on the checkpoint at `candidate_dir` against the loaded `champion`.

    `in_sample`: the candidate was trained on `traffic` (its trainer held none out), so the off-policy
    estimate is optimistic: it may still refuse, never pass."""
    threads = config.num_threads
    if threads is None and sum(p.numel() for p in champion.model.parameters()) < config.small_model_params:
        threads = 1
    with _threads(threads):
        return _run_gates(candidate_dir, champion, prompts, texts, traffic, config, in_sample)


def _run_gates(
    candidate_dir: Path,
    champion: Policy,
    prompts: list[str],
    texts: list[str],
    traffic: LoggedTraffic,
    config: OfflineGateConfig,
    in_sample: bool,
) -> list[OfflineGateResult]:
    try:
        candidate = load_policy(candidate_dir)
    except (CheckpointError, ValueError, OSError) as exc:
        why = f"the candidate does not load: {exc}"
        return [_result("sanity", False, None, "loads and generates", why)] + [
            OfflineGateResult(name, "failed", None, "-", "not run: the candidate does not load") for name in GATES[1:]
        ]
    seed = config.seed
    cand = _sample(candidate, prompts, config, seed)
    champ = _sample(champion, prompts, config, seed)
    if isinstance(cand, str):
        return [_result("sanity", False, None, "loads and generates", cand)] + [
            OfflineGateResult(name, "failed", None, "-", "not run: the candidate cannot generate") for name in GATES[1:]
        ]
    ppl_cand = perplexity(candidate, texts, config.text_window_tokens)
    ppl_champ = perplexity(champion, texts, config.text_window_tokens)
    results = [_sanity(cand, ppl_cand, config)]
    results.append(_kl(candidate, champion, cand, config))
    results.append(_regression(ppl_cand, ppl_champ, len(texts), config))
    if isinstance(champ, str):  # the champion itself cannot generate: nothing to compare with
        results += [OfflineGateResult(n, "failed", None, "-", f"champion: {champ}") for n in VERSUS_CHAMPION]
    else:
        results += _versus_champion(cand, champ, config)
    results.append(_ope(candidate, traffic, config, in_sample))
    return results


def _sample(policy: Policy, prompts: list[str], config: OfflineGateConfig, seed: int) -> Sampled | str:
    try:
        return sample(policy, prompts, config.max_tokens, seed)
    except (RuntimeError, ValueError, IndexError) as exc:  # NaN probabilities, bad ids, shapes
        return f"generation failed: {type(exc).__name__}: {exc}"


def _sanity(cand: Sampled, ppl: float, config: OfflineGateConfig) -> OfflineGateResult:
    problems = []
    if not cand.finite:
        problems.append("NaN or infinite log-probs in its generations")
    if not math.isfinite(ppl):
        problems.append("NaN or infinite perplexity on held-out text")
    if cand.empty_rate > config.max_empty_rate:
        problems.append(
            f"{cand.empty_rate:.0%} of its outputs are empty without declining (bound {config.max_empty_rate:.0%})"
        )
    if cand.declined_rate > config.max_declined_rate:
        problems.append(f"it declines {cand.declined_rate:.0%} of the prompts (bound {config.max_declined_rate:.0%})")
    if cand.truncated_rate > config.max_truncated_rate:
        problems.append(
            f"{cand.truncated_rate:.0%} of its outputs are cut at max_tokens (bound {config.max_truncated_rate:.0%})"
        )
    n = len(cand.generations)
    detail = "; ".join(problems) or (
        f"generated on {n} held-out prompts: {cand.empty_rate:.0%} empty, {cand.declined_rate:.0%} declined, "
        f"{cand.truncated_rate:.0%} cut at {config.max_tokens} tokens, no NaN"
    )
    bound = (
        f"empty <= {config.max_empty_rate:.0%}, declined <= {config.max_declined_rate:.0%}, "
        f"truncated <= {config.max_truncated_rate:.0%}, no NaN"
    )
    return _result("sanity", not problems, cand.empty_rate, bound, detail)


def _kl(candidate: Policy, champion: Policy, cand: Sampled, config: OfflineGateConfig) -> OfflineGateResult:
    bound = f"<= {config.max_kl}"
    n_cand = candidate.model.get_output_embeddings().weight.shape[0]
    n_champ = champion.model.get_output_embeddings().weight.shape[0]
    if n_cand != n_champ:
        return _result("kl_to_champion", False, None, bound, f"vocabularies differ ({n_cand} vs {n_champ} tokens)")
    kl = mean_kl(candidate, champion, cand)
    detail = f"mean per-token KL(candidate || champion) {kl:.4g} nats over {len(cand.generations)} held-out completions"
    return _result("kl_to_champion", math.isfinite(kl) and kl <= config.max_kl, kl, bound, detail)


def _regression(ppl_cand: float, ppl_champ: float, n_texts: int, config: OfflineGateConfig) -> OfflineGateResult:
    ratio = ppl_cand / ppl_champ if math.isfinite(ppl_cand) and math.isfinite(ppl_champ) else math.nan
    detail = f"perplexity {ppl_cand:.4g} vs champion {ppl_champ:.4g} on {n_texts} held-out texts"
    ok = math.isfinite(ratio) and ratio <= config.max_perplexity_ratio
    return _result("perplexity_regression", ok, ratio, f"candidate / champion <= {config.max_perplexity_ratio}", detail)


def _versus_champion(cand: Sampled, champ: Sampled, config: OfflineGateConfig) -> list[OfflineGateResult]:
    """The `VERSUS_CHAMPION` gates, in that order."""
    rise = cand.empty_rate - champ.empty_rate
    empty = _result(
        "empty_rate_vs_champion",
        rise <= config.max_empty_rate_increase,
        rise,
        f"candidate - champion <= {config.max_empty_rate_increase:.0%}",
        f"empty outputs (not declined): candidate {cand.empty_rate:.0%}, champion {champ.empty_rate:.0%}",
    )
    more = cand.declined_rate - champ.declined_rate
    declined = _result(
        "declined_rate_vs_champion",
        more <= config.max_declined_rate_increase,
        more,
        f"candidate - champion <= {config.max_declined_rate_increase:.0%}",
        f"declined: candidate {cand.declined_rate:.0%}, champion {champ.declined_rate:.0%} of the held-out prompts",
    )
    low, high = config.length_ratio_range
    # Both empty everywhere: equal lengths; only the candidate: ratio 0 (fails the low bound).
    ratio = cand.mean_length / champ.mean_length if champ.mean_length else (1.0 if not cand.mean_length else math.inf)
    length = _result(
        "mean_length_vs_champion",
        low <= ratio <= high,
        ratio,
        f"{low} <= candidate / champion <= {high}",
        f"mean suggestion length (declines left out): candidate {cand.mean_length:.1f}, champion "
        f"{champ.mean_length:.1f} characters",
    )
    return [empty, declined, length]


def _ope(candidate: Policy, traffic: LoggedTraffic, config: OfflineGateConfig, in_sample: bool) -> OfflineGateResult:
    samples = traffic.samples
    name = "ope_satisfaction"
    if len(samples) < max(1, config.ope_min_samples):
        detail = (
            f"insufficient evidence: {len(samples)} signed, rewarded generations of the champion "
            f"(need {config.ope_min_samples})"
        )
        return OfflineGateResult(name, "insufficient_evidence", None, f"n >= {config.ope_min_samples}", detail)
    settings = offpolicy.EstimatorSettings(
        clip=config.ope_clip, ratio=config.ope_ratio, ridge=config.ope_ridge, dm_prompts=config.ope_dm_prompts,
        bootstrap_samples=config.bootstrap_samples, confidence=config.confidence, seed=config.seed,
    )  # fmt: skip
    try:
        est = offpolicy.estimate_candidate(
            candidate, [s.record for s in samples], [s.reward for s in samples], settings
        )
    except (RuntimeError, IndexError, ValueError) as exc:  # token ids outside its vocabulary, shapes, NaN
        why = f"cannot score the champion's logged completions: {type(exc).__name__}: {exc}"
        return OfflineGateResult(name, "failed", None, "scores logged traffic", why)
    diff = est.dr_minus_behaviour
    bound = (
        f"DR - champion's logged mean: interval's upper end >= -{config.ope_refuse_margin} (else refused), "
        f"lower end >= -{config.ope_margin} to pass"
    )
    detail = (
        f"DR {est.dr.value:.4g} [{est.dr.ci[0]:.4g}, {est.dr.ci[1]:.4g}], SNIPS {est.snips.value:.4g} "
        f"[{est.snips.ci[0]:.4g}, {est.snips.ci[1]:.4g}] vs champion's logged mean {est.behaviour_mean:.4g}; "
        f"DR - champion {diff.value:.4g} [{diff.ci[0]:.4g}, {diff.ci[1]:.4g}] ({config.confidence:.0%} bootstrap, "
        f"seed {config.seed}); ESS {est.ess:.1f} of n={est.n} ({traffic.reward_version}; ratios "
        f"{config.ope_ratio}, clipped at {config.ope_clip:g}); {traffic.untrusted} untrusted left out"
    )
    # Significantly worse than the champion on its estimate alone: refused, whatever the ESS (clipping
    # bounds every weight, so a small ESS widens the interval instead of hiding a harm).
    if diff.ci[1] < -config.ope_refuse_margin:
        return OfflineGateResult(name, "failed", diff.value, bound, f"worse than the champion: {detail}")
    if est.ess < config.ope_min_ess:
        why = f"insufficient evidence: ESS below {config.ope_min_ess}; {detail}"
        return OfflineGateResult(name, "insufficient_evidence", diff.value, bound, why)
    if in_sample:
        why = (f"insufficient evidence: in-sample (the candidate trained on this traffic; set the trainer's "
               f"ope_holdout_share), so the estimate is optimistic; {detail}")  # fmt: skip
        return OfflineGateResult(name, "insufficient_evidence", diff.value, bound, why)
    if diff.ci[0] >= -config.ope_margin:
        return OfflineGateResult(name, "passed", diff.value, bound, detail)
    why = f"insufficient evidence: the interval straddles -{config.ope_margin}; {detail}"
    return OfflineGateResult(name, "insufficient_evidence", diff.value, bound, why)


def _distinct(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
