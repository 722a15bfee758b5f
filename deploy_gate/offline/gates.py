"""The offline gates: each turns a measurement of the candidate (against the champion) into a verdict.

Gates, in order (names as recorded on the version and shown by `GET /api/versions/{v}`):
- `sanity`: the candidate loads, generates on every held-out prompt, no NaN in its log-probs or
  perplexity, empty outputs, declines and outputs cut at max_tokens under their bounds;
- `kl_to_champion`: mean per-token KL(candidate || champion) on its own held-out completions;
- `lm_vs_champion`: the language model kept: a paired t-interval of the mean per-window difference in token
  log-loss (candidate - champion) on held-out text (the product's own held-out traffic and general text),
  against a non-inferiority margin in nats per token (`deploy_gate.offline.lm`); "undecided" when it
  straddles the margin (shown, never blocks);
- `lm_vs_reference`: the same against the lineage's first champion (the base model), with a cumulative
  margin: drift across promotions is bounded, not only each step;
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
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from deploy_gate.offline import lm, offpolicy
from deploy_gate.offline.config import OfflineGateConfig
from deploy_gate.offline.logged import LoggedTraffic
from deploy_gate.offline.measure import Sampled, mean_kl, sample
from flywheel.lm import CheckpointError, Policy, load_policy
from flywheel.lm.engine import EngineChoice, open_engine
from model_registry import OfflineGateResult

GATES = (
    "sanity",
    "kl_to_champion",
    "lm_vs_champion",
    "lm_vs_reference",
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
    logged_texts: Sequence[str] = (),
    reference: Reference = None,
    clock: Callable[[], float] | None = None,
    engine: EngineChoice | None = None,
    version: str = "candidate",
) -> list[OfflineGateResult]:
    """Every gate's verdict on the checkpoint at `candidate_dir` against the loaded `champion`.

    `texts`: general held-out text; `logged_texts`: held-out text from the product's own traffic.
    `reference`: the lineage's first champion for the drift bound; None when the champion is it (its
    comparison is then judged against the cumulative margin too); a string says why it could not be loaded.
    `in_sample`: the candidate was trained on `traffic` (its trainer held none out), so the off-policy
    estimate is optimistic: it may still refuse, never pass. `clock`: CPU seconds, for the budgets; by default
    this thread's when torch computes on it alone (the process may run other work: `flywheel up`'s simulated
    users), else the whole process's. `engine`: where the candidate (registry `version`) completes the logged
    prompts of `ope_satisfaction`'s direct-method term (flywheel.lm.engine; default: in process)."""
    threads = config.num_threads
    if threads is None and sum(p.numel() for p in champion.model.parameters()) < config.small_model_params:
        threads = 1
    with _threads(threads):
        if clock is None:
            clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time
        return _run_gates(candidate_dir, champion, prompts, texts, traffic, config, in_sample,
                          logged_texts, reference, clock, engine or EngineChoice(), version)  # fmt: skip


@dataclass(frozen=True)
class ReferenceModel:
    """The lineage's first champion, for the drift bound: loaded, or why it could not be (`policy` None)."""

    version: str
    policy: Policy | None
    why: str = ""


Reference = ReferenceModel | None


def _run_gates(
    candidate_dir: Path,
    champion: Policy,
    prompts: list[str],
    texts: list[str],
    traffic: LoggedTraffic,
    config: OfflineGateConfig,
    in_sample: bool,
    logged_texts: Sequence[str],
    reference: Reference,
    clock: Callable[[], float],
    engine: EngineChoice,
    version: str,
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
    lm_results, lm_finite = _language_model(candidate, champion, texts, logged_texts, reference, config, clock)
    results = [_sanity(cand, 0.0 if lm_finite else math.nan, config)]
    results.append(_kl(candidate, champion, cand, config))
    results += lm_results
    if isinstance(champ, str):  # the champion itself cannot generate: nothing to compare with
        results += [OfflineGateResult(n, "failed", None, "-", f"champion: {champ}") for n in VERSUS_CHAMPION]
    else:
        results += _versus_champion(cand, champ, config)
    results.append(_ope(candidate, traffic, config, in_sample, clock, _Completions(engine, version, candidate_dir)))
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


def _language_model(
    candidate: Policy, champion: Policy, texts: Sequence[str], logged_texts: Sequence[str], reference: Reference,
    config: OfflineGateConfig, clock: Callable[[], float],
) -> tuple[list[OfflineGateResult], bool]:  # fmt: skip
    """(`lm_vs_champion`, `lm_vs_reference`), and whether the candidate's losses were all finite."""
    vocab = candidate.model.get_output_embeddings().weight.shape[0]
    others = {"champion": champion}
    ref_policy = reference.policy if reference is not None else None
    if reference is not None and ref_policy is not None:
        if ref_policy.model.get_output_embeddings().weight.shape[0] != vocab:
            reference = ReferenceModel(reference.version, None, "its vocabulary differs from the candidate's")
        else:
            others["reference"] = ref_policy
    if champion.model.get_output_embeddings().weight.shape[0] != vocab:
        why = "vocabularies differ: the candidate's token log-loss cannot be compared with the champion's"
        return [_result(n, False, None, "same vocabulary", why) for n in ("lm_vs_champion", "lm_vs_reference")], True
    items = lm.windows(champion, logged_texts, "product", config.text_window_tokens)
    items += lm.windows(champion, texts, "general", config.text_window_tokens)
    budget = lm.Budget(config.lm_cpu_budget_s, clock)
    scored = lm.score(candidate, others, items, budget, config.seed)
    spent = budget.spent()
    finite = bool(scored.n == 0 or all(math.isfinite(x) for x in scored.candidate))

    def judge(name: str, other: str, label: str, margin: float) -> OfflineGateResult:
        cmp = lm.non_inferiority(scored.candidate - scored.others[other], margin, config.confidence,
                                 config.lm_min_windows)  # fmt: skip
        bound = f"interval's upper end < {margin} nats/token ({math.expm1(margin):.1%} perplexity)"
        detail = lm.describe(cmp, scored, label, config.confidence, spent)
        value = cmp.mean if math.isfinite(cmp.mean) else None
        return OfflineGateResult(name, cmp.verdict, value, bound, detail)

    vs_champion = judge("lm_vs_champion", "champion", "champion", config.lm_margin)
    if reference is not None and "reference" in others:
        vs_reference = judge("lm_vs_reference", "reference", f"reference v{reference.version}",
                             config.lm_reference_margin)  # fmt: skip
    elif reference is None:  # the champion is the lineage's first: one comparison, judged on both margins
        vs_reference = judge("lm_vs_reference", "champion", "reference (the champion itself: the lineage's first)",
                             config.lm_reference_margin)  # fmt: skip
    else:
        assert reference is not None
        why = f"undecided: the reference v{reference.version} could not be compared with: {reference.why}"
        vs_reference = OfflineGateResult("lm_vs_reference", "undecided", None, "-", why)
    return [vs_champion, vs_reference], finite


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


@dataclass(frozen=True)
class _Completions:
    """Where the candidate completes the DM term's prompts: `version` at `checkpoint` on `engine`'s choice."""

    engine: EngineChoice
    version: str
    checkpoint: Path


def _ope(
    candidate: Policy, traffic: LoggedTraffic, config: OfflineGateConfig, in_sample: bool, clock: Callable[[], float],
    completions: _Completions,
) -> OfflineGateResult:  # fmt: skip
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
        cpu_budget_s=config.ope_cpu_budget_s, bootstrap_samples=config.bootstrap_samples,
        confidence=config.confidence, seed=config.seed,
    )  # fmt: skip
    with open_engine(completions.engine, completions.version, completions.checkpoint, candidate) as opened:
        try:
            engine = opened.engine if opened.name != "hf" else None
            covered = offpolicy.estimate_candidate(
                candidate, [s.record for s in samples], [s.reward for s in samples], settings, clock, engine
            )
        except (RuntimeError, IndexError, ValueError) as exc:  # token ids outside its vocabulary, shapes, NaN
            why = f"cannot score the champion's logged completions: {type(exc).__name__}: {exc}"
            return OfflineGateResult(name, "failed", None, "scores logged traffic", why)
    outside = ", its CPU not counted" if opened.name == "vllm" else ""
    coverage = (
        f"covered {covered.covered} of {covered.available} logged samples (a seeded uniform sample, at most "
        f"{config.ope_dm_prompts}) in {covered.cpu_s:.1f} CPU-s of a {config.ope_cpu_budget_s:g} s budget; "
        f"completed on {opened.describe()} in {covered.completion_s:.1f} s{outside}"
    )
    est = covered.estimate
    if est is None or covered.covered < config.ope_min_samples:
        detail = f"insufficient evidence: {coverage} (need {config.ope_min_samples})"
        return OfflineGateResult(name, "insufficient_evidence", None, f"n >= {config.ope_min_samples}", detail)
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
        f"{config.ope_ratio}, clipped at {config.ope_clip:g}); {traffic.untrusted} untrusted left out; {coverage}"
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
