"""The closed loop with simulated users as the only feedback: real serving, collector, broker, ingest,
signals, trainer, offline gates and rollout controller (`simulator.closed_loop`), on the tiny model.

The ground truth is the simulator's: the populations' hidden preferences, measured on fixed held-out
contexts with fixed seeds, never through Flywheel's own numbers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch

from deploy_gate.rollout.config import RampStep, RolloutConfig
from flywheel.contract import ModelLineage
from flywheel.lm import load_policy
from flywheel.settings import Settings
from signals.config import SignalsConfig
from simulator.closed_loop import ClosedLoop, LoopPlan, harm_weights, train_inverted
from simulator.contexts import Context, held_out_contexts
from simulator.populations import DecliningPopulation, LengthPopulation, Population, Reaction, Truth
from trainer.config import TrainerConfig
from trainer.cycle import run_cycle
from trainer.loop import decline_probabilities

# Every random id in the loop seeded per test (`seeded_ids`), so that a run is repeatable.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("seeded_ids")]


@dataclass(frozen=True)
class Contrarian(LengthPopulation):
    """Judges like `LengthPopulation` (the ground truth), but its users do the opposite of what they think:
    the reward the loop sees is inverted."""

    name: str = "length"

    def react(self, truth: Truth, rng: random.Random) -> Reaction:
        flipped = Truth(truth.shown, 1.0 - truth.p_accept, truth.satisfaction, truth.wanted) if truth.shown else truth
        return super().react(flipped, rng)


def loop(settings: Settings, model: Path, pops: list[Population], *, cycles_rounds: int = 1, requests: int = 48,
         lr: float = 1e-3, eval_contexts: int = 40, eval_repeats: int = 2, abstain_coef: float = 0.0,
         baseline: Literal["batch_mean"] | float = 0.0, evaluate_each_cycle: bool = True) -> ClosedLoop:  # fmt: skip
    plan = LoopPlan(cycles=3, users=24, requests=requests, warmup_rounds=1, max_rounds=cycles_rounds, seed=0,
                    eval_repeats=eval_repeats, evaluate_each_cycle=evaluate_each_cycle)  # fmt: skip
    rollout = RolloutConfig(ramp=[RampStep(share=0.5, min_users=4, min_seconds=0)], max_duration_s=3600,
                            tuning_n=200, latency_p95_ratio=100.0, metrics_port=0)  # fmt: skip
    trainer = TrainerConfig(learning_rate=lr, batch_size=16, epochs=2, baseline=baseline, seed=0,
                            abstain_coef=abstain_coef)  # fmt: skip
    return ClosedLoop(settings.model_copy(update={"min_train_samples": 16}), model, pops,
                      held_out_contexts(120, 1, preset="test"), held_out_contexts(eval_contexts, 2, preset="test"),
                      plan, trainer, rollout, SignalsConfig(refit_every_s=0))  # fmt: skip


def learned_reward(settings: Settings, model: Path, pop: Population, cycles: int) -> tuple[float, float]:
    """(base, last candidate) ground-truth reward of `pop` after `cycles` closed-loop cycles.

    Ids are seeded (`seeded_ids`), but a run still varies a little (the signals' timings), so the data, the
    learning rate and the evaluation (80 contexts, 4 samples each) are large enough that the gain is well
    above that spread: +0.06 to +0.14 over base in repeated runs, against +0.03 asserted."""
    # Only the last candidate is judged: the cycles before it are not measured (evaluating is most of the time).
    lp = loop(settings, model, [pop], requests=96, lr=3e-3, eval_contexts=80, eval_repeats=4,
              evaluate_each_cycle=False)  # fmt: skip
    with lp.running():
        lp.warm_up()
        records = [lp.cycle(k) for k in range(1, cycles + 1)]
    last = next(r.candidate for r in reversed(records) if r.candidate)
    return lp.base_eval[pop.name].reward, lp.evaluate(last)[pop.name].reward


def test_a_short_loop_raises_a_learnable_populations_reward_and_not_when_the_signal_is_inverted(
    settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    base, learned = learned_reward(settings, tiny_model_dir, LengthPopulation(), cycles=3)
    assert learned > base + 0.03, f"ground-truth reward per request: base {base:.3f}, after 3 cycles {learned:.3f}"

    inverted = settings.model_copy(update={
        "data_dir": tmp_path / "inverted", "redis_prefix": settings.redis_prefix + "inv:",
        "events_topic": settings.events_topic + "-inv", "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'inv.db'}",
    })  # fmt: skip
    base_i, learned_i = learned_reward(inverted, tiny_model_dir, Contrarian(), cycles=3)
    assert base_i == base  # same model, same contexts, same seeds
    assert learned_i < base + 0.01, f"trained on inverted reactions: base {base:.3f} -> {learned_i:.3f}"


def test_the_offline_estimates_sign_agrees_with_the_ground_truth_for_a_better_and_a_worse_candidate(
    settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """On the loop's own logged, rewarded traffic (serving, collector, ingest, signals all real), the offline
    gate's estimate of candidate - champion has the sign of the simulator's ground truth: for a candidate
    trained on the users' rewards (better) and one trained on them negated (worse), judged on the traffic their
    trainer held out."""
    pop = LengthPopulation()
    lp = loop(settings, tiny_model_dir, [pop], requests=96, lr=1e-2, eval_contexts=80, eval_repeats=4)
    # A third of the traffic held out of training (`flywheel.holdout`): the gate estimates on what neither saw.
    trainer = lp.trainer.replace(ope_holdout_share=0.3)
    with lp.running():
        # Five rounds of the base model's traffic, the champion's logged data: with three, the estimate rested on
        # about 100 held-out prompts, whose interval (about ±0.1) could not resolve a +0.09 gain.
        for _ in range(5):
            lp.warm_up()
        better = run_cycle(lp.settings, trainer, progress=False).version
        assert better is not None
        worse_dir = train_inverted(lp.settings, trainer, lp.base, tmp_path / "worse")
        worse = lp.registry.register(worse_dir, ModelLineage(base=str(tiny_model_dir), parent_version=lp.base,
                                                             trainer_config=trainer.to_dict()))  # fmt: skip
        offline = lp.gate.offline
        assert offline is not None
        found = {}
        for name, version in (("better", better), ("worse", worse)):
            report = offline.check(version, lp.base)
            ope_result = next(r for r in report.results if r.name == "ope_satisfaction")
            assert ope_result.value is not None, ope_result
            truth = lp.evaluate(version)[pop.name].reward - lp.base_eval[pop.name].reward
            found[name] = (ope_result.value, truth, ope_result.detail)
    (est_b, truth_b, why_b), (est_w, truth_w, why_w) = found["better"], found["worse"]
    # Better and worse in ground truth, beyond the evaluation's paired noise (same contexts and seeds for
    # both); on a loaded machine the signals close fewer windows in time and the "better" gain runs +0.02.
    assert truth_b > 0.015 and truth_w < -0.015, found
    assert est_b > 0, f"better by {truth_b:+.3f} in truth, estimated {est_b:+.3f}: {why_b}"
    assert est_w < 0, f"worse by {truth_w:+.3f} in truth, estimated {est_w:+.3f}: {why_w}"


@pytest.fixture(scope="module")
def exploring_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model declining 30% of requests to start with (the default preset starts at 5%): the most
    exploration a few hundred samples can give the trainer to learn declining from."""
    from flywheel.lm import bootstrap_model

    return bootstrap_model(tmp_path_factory.mktemp("model") / "exploring", preset="test", seed=0, progress=False,
                           decline_prior=0.3)  # fmt: skip


def shown_probability(model: Path, contexts: tuple[Context, ...]) -> float:
    """How likely `model` is to show a suggestion in `contexts` (not end-of-text first), on average: the
    expected shown rate there, computed exactly instead of sampled."""
    policy = load_policy(model)
    with torch.no_grad():
        declined = [float(decline_probabilities(policy.model, [policy.encode_prompt(c.prompt, max_tokens=16)],
                                                policy.stop_ids, policy.pad_id)[0]) for c in contexts]  # fmt: skip
    return 1.0 - sum(declined) / len(declined)


def test_declining_the_unwanted_contexts_is_learned_while_accepts_elsewhere_hold(
    settings: Settings, exploring_model: Path
) -> None:
    pop = DecliningPopulation(comment_share=0.6)
    # Only the last candidate is judged (evaluate_each_cycle=False).
    lp = loop(settings, exploring_model, [pop], requests=96, lr=3e-3, eval_contexts=80, eval_repeats=4,
              abstain_coef=5.0, baseline="batch_mean", evaluate_each_cycle=False)  # fmt: skip
    with lp.running():
        lp.warm_up()
        records = [lp.cycle(k) for k in range(1, 5)]
    last = next(r.candidate for r in reversed(records) if r.candidate)
    base_dir, learned_dir = lp.registry.fetch(lp.base), lp.registry.fetch(last)
    # Where this population wants no suggestion (comments) the shown rate falls, and by more than where it
    # wants one: declining is learned for those contexts, not everywhere. Exact probabilities, no sampling
    # noise; the run repeats exactly on the same machine. Measured (60% comments, batch-mean baseline,
    # abstain_coef 5): fell 0.156 where unwanted and rose 0.056 elsewhere. With half the requests in
    # comments the accepted code suggestions pull declining down in every context the tiny model cannot
    # yet tell apart: where unwanted the shown rate rose 0.072 (baseline 0) or fell only 0.020 (batch
    # mean; +0.169 elsewhere); there abstain_coef 10 fell 0.197 where unwanted and 0.075 elsewhere, and
    # lr 2e-3 lowered the accept rate. Without the abstain term a declined sample teaches nothing.
    comment, code = lp.eval_contexts.comment, lp.eval_contexts.code
    unwanted = shown_probability(base_dir, comment) - shown_probability(learned_dir, comment)
    wanted = shown_probability(base_dir, code) - shown_probability(learned_dir, code)
    assert unwanted > 0.03 and unwanted > wanted + 0.05, f"shown rate fell {unwanted:+.3f} where unwanted, " \
        f"{wanted:+.3f} elsewhere"  # fmt: skip
    base, learned = lp.base_eval[pop.name], lp.evaluate(last)[pop.name]
    assert learned.accept_rate >= base.accept_rate - 0.02, (base, learned)


def test_a_harmed_challenger_is_never_promoted(settings: Settings, tiny_model_dir: Path) -> None:
    """Two control cycles on one loop, one harm each: trained on inverted rewards, then seeded weight noise. One
    loop for both (the base's evaluation, its warm-up and serving's start are a loop's fixed cost); the second
    cycle starts from the champion the first left, which is still the base."""
    lp = loop(settings, tiny_model_dir, [LengthPopulation()], cycles_rounds=4, requests=96)

    def inverted(src: Path, out: Path) -> Path:
        return train_inverted(lp.settings, lp.trainer, lp.base, out)

    def noise(src: Path, out: Path) -> Path:
        return harm_weights(src, out, 0.3, seed=1)

    with lp.running():
        lp.warm_up()
        records = {kind: lp.cycle(k, harm=harm) for k, (kind, harm) in
                   enumerate((("inverted rewards", inverted), ("weight noise", noise)), start=1)}  # fmt: skip
    for kind, rec in records.items():
        assert rec.harmed and rec.candidate is not None, kind
        assert rec.decision in ("refused", "rolled_back", "undecided"), (kind, rec)
        assert lp.registry.gate_state(rec.candidate) != "champion", kind
        assert rec.truth_candidate["length"].reward < lp.base_eval["length"].reward, kind  # it really is worse
    assert lp.gate.splits.get().champion_version == lp.base
