"""The closed loop, run as production runs it, with simulated users as the only source of feedback.

Every stage is the real one, in one process: serving (`build_serving_app`, the split in Redis, live
swaps), the collector's Segment API, the broker, the ingest and signals workers, the scheduled
trainer's cycle (`trainer.cycle.run_cycle`), the gate's approval with its offline gates (the
auto-approve policy), and the rollout controller's ramp and decision. The simulator only sends
requests and its users' reactions (`simulator.product`); what it knows of each user's preference
stays here, in the ground truth it measures.

A cycle: the trainer registers a candidate from the champion; the auto-approve policy runs the
offline gates and makes it the challenger; traffic rounds follow (requests, reactions, ingest,
signals, a controller look) until the controller promotes or rolls it back, or `max_rounds` pass.
After each cycle the champion is evaluated on a fixed set of held-out contexts with fixed seeds,
straight through the policy (no events): the independent measurement the A/B test is checked
against. A control run replaces the trained candidate with a harmed one (`train_inverted`: trained on
the same data with every reward negated; or `harm_weights`: seeded weight noise); none may become
champion.
"""

from __future__ import annotations

import logging
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import polars as pl
import torch
from fastapi.testclient import TestClient

from deploy_gate import DeployGate
from deploy_gate.policy import AutoApprove
from deploy_gate.rollout.config import RolloutConfig
from deploy_gate.rollout.controller import RolloutController
from flywheel.bus import ensure_topics
from flywheel.contract import ModelLineage
from flywheel.lake.tables import REWARDS
from flywheel.lm import load_policy
from flywheel.lm.policy import Generation, GenerationRequest, Policy
from flywheel.settings import Settings
from ingest.collector.app import create_app as create_collector
from ingest.worker.loop import IngestWorker
from model_registry import ModelRegistry
from serving import build_serving_app
from signals.config import SignalsConfig
from signals.worker import SignalsWorker
from simulator.contexts import Context, ContextPool, fit_prompts
from simulator.populations import Population, Reaction
from simulator.product import Outcome, SimulatedProduct
from trainer.config import TrainerConfig
from trainer.cycle import run_cycle

log = logging.getLogger(__name__)
# Requests per `generate_batch` call when evaluating. A batch's decode steps cost about the same whatever its
# size on a CPU, so larger batches are cheaper per request: 356 requests of the test model took 20-23 CPU s
# at 32, 7 at 256. Each request's draws are its own seed's whatever the batch (`flywheel.lm.policy`).
_EVAL_BATCH = 256


@dataclass(frozen=True)
class LoopPlan:
    """Sizes of a closed-loop run (the defaults are the benchmark's)."""

    cycles: int = 5
    users: int = 40  # simulated users per population
    requests: int = 60  # requests per population per traffic round
    warmup_rounds: int = 2  # rounds on the base model before the first cycle
    max_rounds: int = 6  # rounds a cycle waits for the controller's decision
    max_tokens: int = 16
    eval_repeats: int = 2  # samples per evaluation context (fixed seeds)
    seed: int = 0
    # Measure each cycle's candidate and the champion after it (the records' truths). Off, a cycle measures
    # nothing and the caller evaluates what it judges (`ClosedLoop.evaluate`): evaluation is most of a small
    # loop's time, and a test that judges only the last candidate need not pay for the others.
    evaluate_each_cycle: bool = True


@dataclass(frozen=True)
class Truth:
    """The simulator's ground truth over a set of requests: what users really thought."""

    n: int
    shown_rate: float
    accept_rate: float  # mean accept probability of shown suggestions
    reward: float  # Cursor's expected reward per request (+0.75 accepted, -0.25 rejected, 0 not shown)
    unwanted_shown_rate: float | None  # shown where the user wanted no suggestion (None: no such request)
    harmful_rate: float  # shown and accepted less than a quarter of the time (worse than silence)


def measure(outcomes: list[Outcome]) -> Truth | None:
    """Ground truth of `outcomes` (None when empty)."""
    if not outcomes:
        return None
    shown = [o for o in outcomes if o.truth.shown]
    unwanted = [o for o in outcomes if not o.truth.wanted]
    return Truth(
        n=len(outcomes),
        shown_rate=len(shown) / len(outcomes),
        accept_rate=statistics.fmean(o.truth.p_accept for o in shown) if shown else 0.0,
        reward=statistics.fmean(o.truth.expected_reward for o in outcomes),
        unwanted_shown_rate=sum(o.truth.shown for o in unwanted) / len(unwanted) if unwanted else None,
        harmful_rate=sum(o.truth.shown and o.truth.p_accept < 0.25 for o in outcomes) / len(outcomes),
    )


@dataclass
class CycleRecord:
    """What one cycle did and measured."""

    cycle: int
    champion: str
    candidate: str | None = None
    trained_on: int = 0
    trainer_note: str = ""  # the trainer's account of the cycle (what it trained on, left out, own samples)
    trainer_metrics: dict[str, float] = field(default_factory=dict)  # its metrics (steps, kl_to_champion, ...)
    decision: str = "none"  # promoted, rolled_back, refused (offline gates), undecided, skipped
    reason: str = ""
    estimate: tuple[float, float, float] | None = None  # the gate's difference and its sequential interval
    truth_ab: dict[str, dict[str, Truth]] = field(default_factory=dict)  # arm -> population -> truth
    truth_eval: dict[str, Truth] = field(default_factory=dict)  # the champion after the cycle, per population
    truth_candidate: dict[str, Truth] = field(default_factory=dict)  # the candidate, evaluated the same way
    offline_estimate: float | None = None  # ope_satisfaction's DR - champion's logged mean reward
    offline_verdict: str = ""  # its status (passed, insufficient_evidence, failed)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per stage
    # This process's CPU seconds per stage (`time.process_time`, every thread's: serving, the workers, the trainer
    # and the gate all run here; the broker, a child process, is not counted). Wall time on a shared machine
    # counts everyone's work; this counts the loop's own.
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    turnaround_s: float | None = None  # last trained-on feedback -> the candidate serving traffic (training,
    # offline gates, approval, swap; the reward window and the signals before it are the deployment's)
    harmed: bool = False

    def ab_difference(self) -> float | None:
        """The ground truth's challenger - champion expected reward per request, over all populations."""
        arms = [self.truth_ab.get(a, {}) for a in ("champion", "challenger")]
        if not all(arms):
            return None
        means = [sum(t.reward * t.n for t in arm.values()) / sum(t.n for t in arm.values()) for arm in arms]
        return means[1] - means[0]


def harm_weights(checkpoint: Path, out: Path, scale: float, seed: int) -> Path:
    """A harmed copy of `checkpoint`: every weight matrix gets seeded noise of `scale` times its own std."""
    policy = load_policy(checkpoint)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.ndim >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * scale * float(p.std()))
    return policy.save(out)


def train_inverted(settings: Settings, config: TrainerConfig, champion: str, out: Path) -> Path:
    """A harmed candidate: `champion` trained as the trainer would, on the same eligible data, with every
    reward negated (what users liked is pushed down). Saved to `out`; nothing is registered."""
    from trainer.cycle import select_samples
    from trainer.loop import score_samples, train_policy
    from trainer.scoring import scorer_for

    registry = ModelRegistry(settings)
    policy = load_policy(registry.fetch(champion))
    selection = select_samples(settings, config, registry, champion, policy)
    samples = [replace(s, reward=-s.reward) for s in selection.samples]
    scorer = scorer_for(config.exact_logprobs)
    reference = score_samples(policy.model, samples, scorer, policy.pad_id, config.batch_size)
    train_policy(policy.model, samples, reference, config, scorer, policy.pad_id)
    return policy.save(out)


class ClosedLoop:
    """One deployment of Flywheel and the simulated populations using it (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        base_model: Path,
        populations: list[Population],
        contexts: ContextPool,
        eval_contexts: ContextPool,
        plan: LoopPlan,
        trainer: TrainerConfig,
        rollout: RolloutConfig,
        signals: SignalsConfig | None = None,
    ) -> None:
        self.settings = settings.model_copy(update={"auto_approve": True})
        self.populations = populations
        self.plan = plan
        self.trainer = trainer
        self.rng = random.Random(plan.seed)
        ensure_topics(self.settings)
        self.registry = ModelRegistry(self.settings)
        self.base = self.registry.register(base_model, ModelLineage(base=str(base_model)))
        room = load_policy(base_model).context - plan.max_tokens
        self.contexts, self.eval_contexts = fit_prompts(contexts, room), fit_prompts(eval_contexts, room)
        self.registry.set_alias("champion", self.base)
        self.registry.set_gate_state(self.base, "champion", by="closed-loop", reason="the base model")
        self.gate = DeployGate.from_settings(self.settings)
        self.gate.ensure_split()
        self.approve = AutoApprove(self.gate)
        self.controller = RolloutController(self.gate, rollout)
        self.ingest = IngestWorker(self.settings)
        self.signals = SignalsWorker(self.settings, signals)
        self.outcomes: list[Outcome] = []
        self.records: list[CycleRecord] = []
        self._evaluated: dict[str, dict[str, Truth]] = {}
        self.base_eval = self.evaluate(self.base)

    @contextmanager
    def running(self) -> Iterator[ClosedLoop]:
        """Serving and the collector up for the loop's life; the workers closed after."""
        self.serving_app = build_serving_app(self.settings)
        self.serving = TestClient(self.serving_app)
        self.collector = TestClient(create_collector(self.settings))
        try:
            with self.serving, self.collector:
                yield self
        finally:
            self.ingest.close()
            self.signals.close()

    # ---- traffic ---------------------------------------------------------------------------

    def traffic_round(self, rec: CycleRecord) -> list[Outcome]:
        """Every population sends `plan.requests` requests (populations in parallel), then the lake catches up."""
        with _timed(rec, "traffic"):
            self._wait_adopted()
            seeds = [self.rng.randrange(2**31) for _ in self.populations]
            with ThreadPoolExecutor(len(self.populations)) as pool:
                batches = list(pool.map(self._population_round, self.populations, seeds))
            outcomes = [o for batch in batches for o in batch]
            self.outcomes.extend(outcomes)
        with _timed(rec, "ingest+signals"):
            self.pump({o.generation_id for o in outcomes})
        return outcomes

    def _population_round(self, pop: Population, seed: int) -> list[Outcome]:
        rng = random.Random(seed)
        key = sorted(self.settings.write_key_set)[0]
        product = SimulatedProduct(self.serving, self.collector, key, self.contexts, max_tokens=self.plan.max_tokens)
        return [product.step(pop, f"{pop.name}-{rng.randrange(self.plan.users)}", rng)
                for _ in range(self.plan.requests)]  # fmt: skip

    def pump(self, generation_ids: set[str], timeout_s: float = 120.0) -> None:
        """Run ingest and signals until every generation in `generation_ids` has a reward (or time is up)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.ingest.run_once()
            self.signals.run_once()
            rewards = REWARDS.scan(REWARDS.at(self.settings.lake_root))
            done = set() if rewards is None else set(
                rewards.filter(pl.col("generation_id").is_in(list(generation_ids)))
                .select("generation_id").unique().collect()["generation_id"].to_list()
            )  # fmt: skip
            if generation_ids <= done:
                return
            if time.monotonic() > deadline:
                log.warning("%d generations still without a reward after %.0fs", len(generation_ids - done), timeout_s)
                return

    # ---- the cycle -------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Traffic on the base model alone: the first cycle's data."""
        untimed = CycleRecord(cycle=0, champion=self.base)
        for _ in range(self.plan.warmup_rounds):
            self.traffic_round(untimed)

    def cycle(self, index: int, harm: Callable[[Path, Path], Path] | None = None) -> CycleRecord:
        """Train, gate and roll out one candidate (a harmed one when `harm` is given); evaluate the champion."""
        champion = self.gate.splits.get().champion_version  # type: ignore[union-attr]
        rec = CycleRecord(cycle=index, champion=champion, harmed=harm is not None)
        last_feedback = time.monotonic()
        with _timed(rec, "train"):
            result = run_cycle(self.settings, self.trainer, progress=False)
        if result.status != "registered":
            rec.decision, rec.reason = "skipped", result.reason
            self.traffic_round(rec)
            return self._finish(rec)
        candidate = result.version
        assert candidate is not None
        rec.trained_on = result.sample_count
        rec.trainer_note, rec.trainer_metrics = result.reason, result.metrics
        if harm is not None:
            candidate = self._harmed(candidate, champion, harm)
        rec.candidate = candidate
        if self.plan.evaluate_each_cycle:
            with _timed(rec, "evaluate"):
                rec.truth_candidate = self.evaluate(candidate)
        with _timed(rec, "offline gates+approve"):
            try:
                self.approve.tick()
            except Exception as exc:  # noqa: BLE001 - the refusal is the result (the audit log has it too)
                rec.decision, rec.reason = "refused", str(exc)
        report = self.registry.offline_gates(candidate)
        ope_result = next((r for r in report.results if r.name == "ope_satisfaction"), None) if report else None
        if ope_result is not None:
            rec.offline_estimate, rec.offline_verdict = ope_result.value, ope_result.status
        if rec.decision == "refused":  # the champion keeps serving; its traffic is the next cycle's new data
            if self.registry.gate_state(candidate) == "pending":  # an offline refusal marks it refused already
                self.gate.reject(candidate, by="closed-loop", reason=f"refused at approval: {rec.reason[:200]}")
            self.traffic_round(rec)
            return self._finish(rec)
        with _timed(rec, "swap"):
            self._wait_loaded(candidate)
        rec.turnaround_s = time.monotonic() - last_feedback - rec.seconds.get("evaluate", 0.0)  # without measuring
        self.controller.tick()  # the experiment starts: the first ramp step's share
        served: list[Outcome] = []
        for _ in range(self.plan.max_rounds):
            served.extend(self.traffic_round(rec))
            with _timed(rec, "rollout decision"):
                state = self.controller.tick()
            if state.analysis is not None and state.analysis.difference is not None:
                d = state.analysis.difference
                rec.estimate = (d.estimate, *d.sequential_ci)
            if state.state in ("promoted", "rolled_back"):
                rec.decision = state.state
                rec.reason = state.analysis.decision.reason if state.analysis else ""
                break
        else:
            rec.decision, rec.reason = "undecided", f"no decision after {self.plan.max_rounds} rounds"
            self._end_undecided(candidate)
        for arm in ("champion", "challenger"):
            mine = [o for o in served if o.arm == arm]
            truths = {p.name: measure([o for o in mine if o.population == p.name]) for p in self.populations}
            rec.truth_ab[arm] = {name: t for name, t in truths.items() if t is not None}
        return self._finish(rec)

    def _end_undecided(self, version: str) -> None:
        """Take an undecided challenger out of traffic without quarantining what it served: nothing showed
        it harmful, so its users' feedback stays eligible for the next candidate."""
        why = "the closed loop's rounds ran out before the controller decided"
        self.gate.rollback(by="closed-loop", reason=why)
        self.gate.apply(self.gate.plan_unquarantine(version, by="closed-loop", reason=why))

    def _finish(self, rec: CycleRecord) -> CycleRecord:
        if self.plan.evaluate_each_cycle:
            with _timed(rec, "evaluate"):
                champion = self.gate.splits.get().champion_version  # type: ignore[union-attr]
                rec.truth_eval = self.evaluate(champion)
        self.records.append(rec)
        return rec

    def _harmed(self, trained: str, champion: str, harm: Callable[[Path, Path], Path]) -> str:
        """Register a harmed version in place of the trained candidate, which is rejected."""
        self.gate.reject(trained, by="closed-loop", reason="control run: replaced by a harmed candidate")
        with tempfile.TemporaryDirectory(dir=self.settings.data_dir) as tmp:
            out = harm(Path(self.registry.fetch(champion)), Path(tmp) / "harmed")
            # Its own run: the trained candidate's run already holds that candidate's artifacts.
            lineage = self.registry.lineage(trained).model_copy(update={"parent_version": champion, "run_id": None})
            return self.registry.register(out, lineage)

    def _wait_adopted(self, timeout_s: float = 120.0) -> None:
        """Until serving routes by the split in Redis. Serving adopts a gate's change from its pub/sub watcher
        thread, a moment later; a round started before that would route its first users by the old share, and
        how many depends on thread timing (so a run would not repeat)."""
        pool = self.serving_app.state.pool
        deadline = time.monotonic() + timeout_s
        while pool.split != self.gate.splits.get():
            if time.monotonic() > deadline:
                log.warning("serving has not adopted the traffic split after %.0fs", timeout_s)
                return
            time.sleep(0.01)

    def _wait_loaded(self, version: str, timeout_s: float = 120.0) -> None:
        pool = self.serving_app.state.pool
        deadline = time.monotonic() + timeout_s
        while version not in pool.loaded_versions and time.monotonic() < deadline:
            time.sleep(0.1)

    # ---- the independent measurement -------------------------------------------------------

    def evaluate(self, version: str) -> dict[str, Truth]:
        """Ground truth of `version` per population on the fixed evaluation contexts (fixed seeds, no events).

        Kept per version: a registered version's weights never change and the seeds are fixed, so a second
        evaluation (a cycle's champion after it, mostly the one evaluated before) would repeat the first."""
        if version not in self._evaluated:
            policy = load_policy(self.registry.fetch(version))
            self._evaluated[version] = evaluate_policy(policy, self.populations, self.eval_contexts,
                                                       self.plan.max_tokens, self.plan.eval_repeats)  # fmt: skip
        return self._evaluated[version]


def evaluate_policy(policy: Policy, populations: list[Population], contexts: ContextPool, max_tokens: int = 16,
                    repeats: int = 2) -> dict[str, Truth]:  # fmt: skip
    """Ground truth of `policy` per population on `contexts` (each population's mix of code and comment
    contexts), `repeats` samples per context with fixed seeds, straight through the policy: no events."""
    out = {}
    for pop in populations:
        judged = eval_generations(policy, pop, contexts, max_tokens, repeats)
        truth = measure([_eval_outcome(pop, c, g.completion, g.finish_reason) for c, g in judged])
        assert truth is not None
        out[pop.name] = truth
    return out


def eval_generations(policy: Policy, pop: Population, contexts: ContextPool, max_tokens: int = 16,
                     repeats: int = 2) -> list[tuple[Context, Generation]]:  # fmt: skip
    """`policy`'s completions of `pop`'s evaluation contexts, repeat-major (repeat r of context i has seed
    1000 r + i). Only their text is judged, so behaviour log-probs are not recomputed (same completions)."""
    chosen = eval_set(contexts, pop)
    requests = [GenerationRequest(c.prompt, max_tokens, 1.0, seed=1000 * r + i)
                for r in range(repeats) for i, c in enumerate(chosen)]  # fmt: skip
    gens = [g for i in range(0, len(requests), _EVAL_BATCH)
            for g in policy.generate_batch(requests[i : i + _EVAL_BATCH], behaviour_logprobs=False)]  # fmt: skip
    return list(zip([c for _ in range(repeats) for c in chosen], gens, strict=True))


def eval_set(pool: ContextPool, pop: Population) -> list[Context]:
    """The population's mix of code and comment contexts, the same every time."""
    n_comment = round(len(pool.code) * pop.comment_share / max(1e-9, 1 - pop.comment_share))
    return list(pool.code) + list(pool.comment[:n_comment])


def _eval_outcome(pop: Population, ctx: Context, text: str, finish: str) -> Outcome:
    truth = pop.truth(ctx, text, finish)
    return Outcome(pop.name, ctx, "eval", "", "", text, finish, truth, Reaction(shown=truth.shown), 0)


@contextmanager
def _timed(rec: CycleRecord, stage: str) -> Iterator[None]:
    """Add the block's wall seconds and this process's CPU seconds to `rec`'s, under `stage`."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        _add(rec.seconds, stage, time.perf_counter() - wall)
        _add(rec.cpu_seconds, stage, time.process_time() - cpu)


def _add(seconds: dict[str, float], stage: str, value: float) -> None:
    seconds[stage] = seconds.get(stage, 0.0) + value
