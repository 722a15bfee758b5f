"""The off-policy estimate of a candidate from the champion's logged, rewarded generations.

Three choices, each measured against the simulator's ground truth (`bench/ope_calibration.py`):

- Importance ratios per token: log w_i = mean_t (log pi - log mu) over completion i's tokens (the
  geometric mean of the token ratios), capped at log(`clip`). Biased (it is not the sequence's
  probability ratio) but with far less variance than the product over a completion's tokens; on
  the tuning populations it predicted the ground truth best (`bench/ope_calibration.py`). The
  sequence ratio, capped the same way (Bottou et al. 2013, "Counterfactual reasoning", section
  4.6: clipping trades a bounded bias for a bounded variance), is `ratio="sequence"`.
- A reward model fitted on the logged data for the direct-method term: ridge regression on
  features of the prompt and completion that any user's preference could bear on (shown or
  declined, where the cursor is (a comment or code), length, whether it runs on past the line,
  quote characters, identifier naming, overlap with the prompt, and hashed character trigrams of
  the completion). The DM term is that model's mean over the candidate's own seeded completions
  of the logged prompts: it needs no overlap between the two policies, which the weights do. It is
  paired with the logged term per prompt (`ope.estimate`), so what differs between prompts cancels
  in the difference the gate judges.
- The logging policy is the champion; the caller passes only its traffic (`logged.champion_traffic`),
  newest first, so the estimate is about the users of now. Completing every logged prompt costs a
  generation each (2,000 by default): `estimate_candidate` covers a seeded uniform sample of them
  that fits a CPU-seconds budget and estimates on exactly those, so the pairing holds at any budget.
  The completions may run on an engine (vLLM: `Settings.sampling_backend`); the ratios are always
  the candidate's log-probs here.

What must hold: the same samples, candidate and seed give the same estimate; a candidate equal to
the champion has every weight 1, so SNIPS is the logged mean.
"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from deploy_gate.offline import ope
from flywheel.contract import GenerationRecord
from flywheel.lm import Policy, token_logprobs
from flywheel.lm.engine import Generator
from flywheel.lm.policy import Generation, GenerationRequest

Ratio = Literal["sequence", "per_token"]
_TRIGRAM_BUCKETS = 48
_BATCH = 32
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CAMEL = re.compile(r"^[a-z]+[A-Z][A-Za-z0-9]*$")
_SNAKE = re.compile(r"^[a-z]+(_[a-z0-9]+)+$")


@dataclass(frozen=True)
class EstimatorSettings:
    """How the estimate is made (the offline gate's config carries these values)."""

    clip: float = 20.0  # cap on a sample's importance ratio (inf: none)
    ratio: Ratio = "per_token"
    ridge: float = 1.0
    dm_prompts: int = 2000  # at most this many logged samples are estimated on (a seeded uniform sample)
    cpu_budget_s: float = float("inf")  # CPU-seconds for their completions and ratios (`estimate_candidate`)
    max_tokens: int | None = None  # the DM term's completion length; None: the longest logged one
    bootstrap_samples: int = 500
    confidence: float = 0.95
    seed: int = 0


def generation_features(prompt: str, completion: str, finish_reason: str) -> list[float]:
    """Features of one (prompt, completion) that a reward model regresses on; see the module docstring."""
    in_comment = float(prompt.rsplit("\n", 1)[-1].lstrip().startswith("#"))
    shown = float(finish_reason != "declined" and bool(completion.strip()))
    body = completion.rstrip("\n")
    first = body.split("\n", 1)[0]
    idents = _IDENT.findall(completion)
    prompt_idents = set(_IDENT.findall(prompt))
    overlap = sum(i in prompt_idents for i in idents) / len(idents) if idents else 0.0
    dense = [
        shown,
        in_comment,
        shown * in_comment,
        shown * min(len(first), 80) / 80,
        shown * float(len(first) <= 24),
        shown * float(finish_reason == "stop"),
        shown * float(finish_reason == "length"),
        shown * float("\n" in body),
        shown * float("'" in completion),
        shown * float('"' in completion),
        shown * float(any(_CAMEL.match(i) for i in idents)),
        shown * float(any(_SNAKE.match(i) for i in idents)),
        shown * overlap,
        shown * float(not prompt.endswith((" ", "\t", "\n")) and completion[:1].isalnum()),
    ]
    grams = np.zeros(_TRIGRAM_BUCKETS)
    text = first.strip()
    for i in range(max(0, len(text) - 2)):
        grams[zlib.crc32(text[i : i + 3].encode()) % _TRIGRAM_BUCKETS] += 1.0
    if grams.sum():
        grams /= np.sqrt(grams.sum())
    return dense + list(shown * grams)


def features(records: Sequence[tuple[str, str, str]]) -> np.ndarray:
    return np.array([generation_features(p, c, f) for p, c, f in records], dtype=np.float64)


def log_ratios(candidate: Policy, records: Sequence[GenerationRecord], ratio: Ratio = "sequence") -> np.ndarray:
    """log pi(a|x) - log mu(a|x) per logged record (per token, averaged, for `ratio="per_token"`)."""
    out = np.empty(len(records))
    with torch.no_grad():
        for i, r in enumerate(records):
            assert r.prompt_token_ids is not None and r.completion_token_ids is not None
            assert r.behaviour_logprobs is not None
            lp, _ = token_logprobs(candidate.model, [r.prompt_token_ids], [r.completion_token_ids], candidate.pad_id)
            diff = lp[0, : len(r.completion_token_ids)].double().numpy() - np.asarray(r.behaviour_logprobs)
            out[i] = diff.mean() if ratio == "per_token" else diff.sum()
    return out


@dataclass(frozen=True)
class Covered:
    """An estimate made on the logged samples a CPU budget covered: `covered` of `available`, drawn uniformly."""

    estimate: ope.OffPolicyEstimate | None  # None: the budget covered none
    covered: int
    available: int
    cpu_s: float
    completion_s: float = 0.0  # wall seconds the candidate's completions took (on `engine`, when one was given)


def estimate_candidate(
    candidate: Policy, records: Sequence[GenerationRecord], rewards: Sequence[float], settings: EstimatorSettings,
    clock: Callable[[], float] = time.process_time, engine: Generator | None = None,
) -> Covered:  # fmt: skip
    """SNIPS and DR of `candidate` from the champion's logged `records` and their `rewards`.

    Cost is bounded: the samples are visited in a seeded random order (at most `dm_prompts` of them), a batch
    at a time (the candidate's completion of each prompt for the DM term, and its importance ratio), until
    `cpu_budget_s` of `clock` is spent. The estimate is made on the samples covered, a uniform sample of the
    logged ones, with the DM term paired per prompt; the reward model is fitted on every logged sample (cheap).
    `engine` completes the prompts (the candidate on another engine: flywheel.lm.engine.open_engine; its CPU is
    then not on `clock`), else `candidate` in process; the importance ratios are always the candidate's here.

    Raises RuntimeError, IndexError or ValueError when the candidate cannot score the records (token
    ids outside its vocabulary); the caller says so in its verdict."""
    if not records or len(records) != len(rewards):
        raise ValueError("need one reward per logged record, and at least one record")
    start = clock()
    r_all = np.asarray(rewards, dtype=np.float64)
    logged_all = features([(x.prompt, x.completion, x.finish_reason) for x in records])
    coef = ope.fit_reward_model(logged_all, r_all, settings.ridge)
    order = np.random.default_rng(settings.seed).permutation(len(records))[: max(1, settings.dm_prompts)]
    max_tokens = settings.max_tokens or max(len(x.completion_token_ids or []) for x in records)
    covered: list[int] = []
    completion_s = 0.0
    log_w_parts: list[np.ndarray] = []
    targets: list[tuple[str, str, str]] = []
    for at in range(0, len(order), _BATCH):
        if clock() - start >= settings.cpu_budget_s:
            break
        batch = [int(i) for i in order[at : at + _BATCH]]
        chosen = [records[i] for i in batch]
        requests = [GenerationRequest(records[i].prompt, max_tokens, 1.0, seed=settings.seed + i) for i in batch]
        began = time.monotonic()
        gens = _complete(candidate, engine, requests)
        completion_s += time.monotonic() - began
        targets += [(x.prompt, g.completion, g.finish_reason) for x, g in zip(chosen, gens, strict=True)]
        log_w_parts.append(log_ratios(candidate, chosen, settings.ratio))
        covered += batch
    if not covered:
        return Covered(None, 0, len(records), clock() - start, completion_s)
    log_w = np.concatenate(log_w_parts)
    if not np.all(np.isfinite(log_w)):
        raise ValueError("NaN or infinite log-probs on the logged traffic")
    if np.isfinite(settings.clip):
        log_w = np.minimum(log_w, np.log(settings.clip))
    idx = np.asarray(covered)
    target = ope.predict_reward(coef, features(targets))
    est = ope.estimate(
        r_all[idx], log_w, ope.predict_reward(coef, logged_all[idx]), target,
        bootstrap_samples=settings.bootstrap_samples, confidence=settings.confidence, seed=settings.seed, paired=True,
    )  # fmt: skip
    return Covered(est, len(covered), len(records), clock() - start, completion_s)


def _complete(candidate: Policy, engine: Generator | None, requests: Sequence[GenerationRequest]) -> list[Generation]:
    """The DM term's completions: on `engine`, else in process without behaviour log-probs (the term reads the
    text alone, and their recompute is most of a short completion's cost on a CPU)."""
    if engine is not None:
        return engine.generate_batch(requests)
    return candidate.generate_batch(requests, behaviour_logprobs=False)


def target_records(
    candidate: Policy, records: Sequence[GenerationRecord], settings: EstimatorSettings
) -> list[tuple[str, str, str]]:
    """(prompt, completion, finish) of the candidate's seeded completions of the newest `dm_prompts` logged
    prompts: the DM term. When they cover every logged prompt the term is paired with the logged one."""
    dm = records[: max(1, settings.dm_prompts)]
    max_tokens = settings.max_tokens or max(len(x.completion_token_ids or []) for x in records)
    requests = [GenerationRequest(x.prompt, max_tokens, 1.0, seed=settings.seed + i) for i, x in enumerate(dm)]
    gens = [g for i in range(0, len(requests), _BATCH) for g in _complete(candidate, None, requests[i : i + _BATCH])]
    return [(x.prompt, g.completion, g.finish_reason) for x, g in zip(dm, gens, strict=True)]
