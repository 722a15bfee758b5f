"""bench/trainer_efficiency.py's pure parts: the signals' reward of a simulated reaction, and the measures."""

import numpy as np
import pytest

from simulator.populations import Reaction
from tests.helpers import bench_module


def _bench():  # type: ignore[no-untyped-def]
    return bench_module("trainer_efficiency")


@pytest.mark.parametrize(
    ("reaction", "text", "finish", "reward"),
    [
        (Reaction(shown=True, accepted=True, kept=True), "x = 1", "stop", 0.75),
        (Reaction(shown=True, accepted=True, kept=True, retained=True), "x = 1", "stop", 0.75),
        (Reaction(shown=True, accepted=True, kept=False), "x = 1", "stop", -0.10),
        (Reaction(shown=True), "x = 1", "stop", -0.25),
        (Reaction(shown=True, thumbs="up"), "x = 1", "stop", 1.0),
        (Reaction(shown=False), "", "declined", 0.0),
    ],
)
def test_a_reaction_gets_the_default_reward_definitions_reward(reaction, text, finish, reward) -> None:  # type: ignore[no-untyped-def]
    assert _bench().signals_reward(reaction, text, finish) == pytest.approx(reward)


def test_the_frontier_at_no_kl_is_the_base_and_a_candidate_equal_to_the_base_gains_nothing() -> None:
    b = _bench()
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, (20, 4))
    base = b.Judged(p, np.ones_like(p), rng.integers(1, 17, p.shape).astype(float))
    assert b.frontier_accept(base, 0.0) == base.accept()
    assert b.frontier_accept(base, 0.05) > base.accept()
    assert b.relative_gain_interval(base, base) == (0.0, 0.0, 0.0)
    assert b.share(0.05, 0.1) == pytest.approx(0.5) and b.share(0.05, 0.0) is None


def test_a_lora_grid_entry_trains_an_adapter_on_the_frozen_base(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """`{"update": "lora"}` trains what a LoRA cycle from full weights trains: a fresh adapter, the base untouched;
    full weights (the default) move the base itself."""
    import torch

    from flywheel.lm import load_policy
    from launcher.up import demo_trainer_config
    from simulator.contexts import fit_prompts, held_out_contexts
    from simulator.populations import LengthPopulation

    b = _bench()
    base = load_policy(tiny_model_dir)
    pool = fit_prompts(held_out_contexts(20, 0, preset="test"), base.context - 8)
    rows = b.log_requests(base, LengthPopulation(), pool, 48, seed=0, max_tokens=8, batch=16)
    samples = b.training_samples(rows, 0.0)
    before = {k: v.clone() for k, v in base.model.state_dict().items()}
    quick = {"own_samples": 0, "time_budget_s": 0, "target_kl": 0.0, "learning_rate": 1e-2, "seed": 0}

    lora = b.train(tiny_model_dir, samples, demo_trainer_config(update="lora", **quick))
    assert hasattr(lora.policy.model, "peft_config") and lora.steps == len(samples) // 16
    merged = lora.policy.model.state_dict()
    adapters = [k for k in merged if "lora_B" in k]
    assert adapters and any(merged[k].abs().sum() > 0 for k in adapters)  # B starts at 0: the adapter moved
    for name, weight in before.items():  # peft names a wrapped layer's weight base_layer.weight
        stored = [k for k in merged if k.replace("base_model.model.", "").replace(".base_layer", "") == name]
        assert len(stored) == 1 and torch.equal(merged[stored[0]], weight), name

    full = b.train(tiny_model_dir, samples, demo_trainer_config(**quick))
    assert not hasattr(full.policy.model, "peft_config")
    assert any(not torch.equal(full.policy.model.state_dict()[k], v) for k, v in before.items())
