"""The policy model: bootstrap, load, generate (stop rules, seeds), exact log-prob agreement, and the
stochastic rounding that stores trained weights in bfloat16."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flywheel.lm import (
    METADATA_FILE,
    CheckpointError,
    Policy,
    bootstrap_model,
    load_policy,
    round_parameters_to_bfloat16_,
    stochastic_round_to_bfloat16,
    token_logprobs,
)
from flywheel.lm.bootstrap import pretrain_state_path
from flywheel.lm.corpus import package_corpus, stdlib_corpus
from flywheel.lm.policy import GenerationRequest

PROMPTS = [
    "def ",
    "import os\nimport sys\n\n\nclass Reader:\n    def __init__(self, path):\n        self.",
    "x = ",
    "# compute the total\nfor item in items:\n    ",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # A tiny model on this shared 2-core machine runs ~4x faster on one intra-op thread
    # (measured); restored afterwards because the setting is process-wide.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> Policy:
    return load_policy(tiny_model_dir)


def naive_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> list[float]:
    """Reference: one full forward of prompt+completion, then look up each position by hand."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()  # (L, vocab)
    out = []
    for j, token in enumerate(completion):
        out.append(torch.log_softmax(logits[len(prompt) + j - 1], dim=-1)[token].item())
    return out


def test_bootstrap_writes_a_hf_checkpoint_with_its_recipe(tiny_model_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", METADATA_FILE):
        assert (tiny_model_dir / name).is_file(), name
    meta = json.loads((tiny_model_dir / METADATA_FILE).read_text())
    assert meta["preset"] == "test" and meta["seed"] == 0 and meta["steps"] > 0 and meta["dtype"] == "bfloat16"
    # Stored in bfloat16, the trainer's stored dtype, so its first candidate is a delta against it.
    assert {t.dtype for t in load_file(tiny_model_dir / "model.safetensors").values()} == {torch.bfloat16}
    # Pretraining learned something: far below the uniform-guess loss ln(512) = 6.24.
    assert meta["final_loss"] < 5.5


def test_bootstrap_reuses_a_matching_model_and_refuses_to_clobber_another(tiny_model_dir: Path) -> None:
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert bootstrap_model(tiny_model_dir, preset="test", seed=0, progress=False) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(FileExistsError, match="force=True"):
        bootstrap_model(tiny_model_dir, preset="test", seed=1, progress=False)


def test_bootstrap_is_deterministic_given_the_seed(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = bootstrap_model(tmp_path / "again", preset="test", seed=0, progress=False, max_steps=20)
    twice = bootstrap_model(tmp_path / "twice", preset="test", seed=0, progress=False, max_steps=20)
    a, b = load_file(again / "model.safetensors"), load_file(twice / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (again / "tokenizer.json").read_text() == (tiny_model_dir / "tokenizer.json").read_text()


def test_pretraining_resumed_gives_the_weights_of_one_longer_run(tmp_path: Path) -> None:
    straight = bootstrap_model(tmp_path / "straight", preset="test", seed=0, progress=False, max_steps=24)
    split = bootstrap_model(tmp_path / "split", preset="test", seed=0, progress=False, max_steps=10)
    assert json.loads((split / METADATA_FILE).read_text())["steps"] == 10
    bootstrap_model(split, preset="test", seed=0, progress=False, max_steps=24, resume=True)
    meta = json.loads((split / METADATA_FILE).read_text())
    assert (meta["steps"], meta["resumed_from_step"]) == (24, 10)
    a, b = load_file(straight / "model.safetensors"), load_file(split / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The state beside the checkpoint, never inside it (registering the checkpoint would upload it).
    assert pretrain_state_path(split).is_file() and not list(split.glob("*.pt"))


def test_resuming_refuses_other_settings_and_a_checkpoint_without_state(tmp_path: Path) -> None:
    model = bootstrap_model(tmp_path / "m", preset="test", seed=0, progress=False, max_steps=4)
    with pytest.raises(ValueError, match="decline_prior"):
        bootstrap_model(model, preset="test", seed=0, progress=False, max_steps=8, resume=True, decline_prior=0.2)
    pretrain_state_path(model).unlink()
    with pytest.raises(FileNotFoundError, match="no pretraining state"):
        bootstrap_model(model, preset="test", seed=0, progress=False, max_steps=8, resume=True)


def test_installed_packages_join_the_corpus_without_changing_the_standard_library_sample() -> None:
    stdlib = stdlib_corpus(40, 2_000, 0)
    packages = package_corpus(30, 2_000, 0)
    assert len(packages) >= 20 and not set(packages) & set(stdlib)
    assert package_corpus(30, 2_000, 0) == packages  # seeded
    assert package_corpus(0, 2_000, 0) == []


def test_save_and_load_round_trip_gives_identical_weights(policy: Policy, tmp_path: Path) -> None:
    saved = policy.save(tmp_path / "copy")
    reloaded = load_policy(saved)
    assert not reloaded.model.training
    original = policy.model.state_dict()
    for name, tensor in reloaded.model.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    assert reloaded.tokenizer("def f():")["input_ids"] == policy.tokenizer("def f():")["input_ids"]


def test_loading_a_directory_that_is_not_a_checkpoint_says_so(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(CheckpointError, match="not a Hugging Face checkpoint"):
        load_policy(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # a config alone is not a checkpoint either
    with pytest.raises(CheckpointError, match="could not be loaded"):
        load_policy(tmp_path)


def test_generation_obeys_the_stop_rules_and_max_tokens(policy: Policy) -> None:
    eos = policy.tokenizer.eos_token_id
    reasons = set()
    for seed in range(40):
        gen = policy.generate(PROMPTS[seed % len(PROMPTS)], max_tokens=6, seed=seed)
        ids = gen.completion_token_ids
        reasons.add(gen.finish_reason)
        assert 1 <= len(ids) <= 6 and len(gen.logprobs) == len(ids)
        # Nothing after a stop: no newline or end-of-text token before the last one.
        assert all(t != eos and "\n" not in policy.tokenizer.decode([t]) for t in ids[:-1])
        if gen.finish_reason == "declined":
            assert ids == [eos] and gen.completion == ""
        elif gen.finish_reason == "stop":
            assert ids[-1] == eos or "\n" in policy.tokenizer.decode([ids[-1]])
            # The completion completes one line: newlines come only from its last token.
            assert "\n" not in policy.tokenizer.decode(ids[:-1])
        else:
            assert gen.finish_reason == "length" and len(ids) == 6 and "\n" not in gen.completion
    assert {"stop", "length"} <= reasons
    assert len(policy.generate("def ", max_tokens=1, seed=3).completion_token_ids) == 1


def test_first_token_end_of_text_is_a_declined_empty_completion(policy: Policy) -> None:
    # Force the model to prefer end-of-text by boosting its logit; everything else is real.
    eos = policy.tokenizer.eos_token_id
    head = policy.model.get_output_embeddings()
    bias = torch.zeros(head.weight.shape[0])
    bias[eos] = 100.0
    head.bias = torch.nn.Parameter(bias)
    try:
        gen = policy.generate("def ", max_tokens=8, seed=0)
    finally:
        head.bias = None
    assert gen.finish_reason == "declined" and gen.completion == "" and gen.completion_token_ids == [eos]
    assert gen.logprobs[0] == pytest.approx(0.0, abs=1e-3)


def test_same_seed_gives_the_same_generation(policy: Policy) -> None:
    a = policy.generate(PROMPTS[1], max_tokens=12, seed=7)
    b = policy.generate(PROMPTS[1], max_tokens=12, seed=7)
    assert a == b
    others = {tuple(policy.generate(PROMPTS[1], 12, seed=s).completion_token_ids) for s in range(8)}
    assert len(others) > 1  # the seed actually drives sampling
    quick = policy.generate_batch([GenerationRequest(PROMPTS[1], 12, seed=7)], behaviour_logprobs=False)[0]
    assert quick.logprobs == [] and quick.completion_token_ids == a.completion_token_ids


def test_greedy_generation_picks_the_most_likely_token(policy: Policy) -> None:
    gen = policy.generate(PROMPTS[0], max_tokens=1, temperature=0.0)
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([gen.prompt_token_ids])).logits[0, -1]  # (vocab,)
    assert gen.completion_token_ids == [int(logits.argmax())]


def test_long_prompts_are_cut_from_the_left_keeping_bos(policy: Policy) -> None:
    long_prompt = "value = compute(value)\n" * 400
    gen = policy.generate(long_prompt, max_tokens=10, seed=0)
    assert len(gen.prompt_token_ids) == policy.context - 10
    assert gen.prompt_token_ids[0] == policy.tokenizer.bos_token_id
    tail = policy.tokenizer(long_prompt)["input_ids"][-20:]
    assert gen.prompt_token_ids[-20:] == tail


def test_logged_logprobs_equal_trainer_recomputation_exactly(policy: Policy) -> None:
    gens = [policy.generate(p, max_tokens=10, seed=i) for i, p in enumerate(PROMPTS)]
    prompts = [g.prompt_token_ids for g in gens]
    completions = [g.completion_token_ids for g in gens]
    for g in gens:  # batch of one, as the trainer may score it
        single, mask = token_logprobs(
            policy.model, [g.prompt_token_ids], [g.completion_token_ids], policy.pad_id
        )
        assert single[0].tolist() == g.logprobs and mask.sum().item() == len(g.logprobs)
    batch, mask = token_logprobs(policy.model, prompts, completions, policy.pad_id)  # (4, T)
    assert batch.shape == mask.shape == (len(gens), max(len(c) for c in completions))
    for i, g in enumerate(gens):
        n = len(g.completion_token_ids)
        assert batch[i, :n].tolist() == g.logprobs  # bit-identical, not approximately
        assert mask[i, :n].eq(1).all() and mask[i, n:].eq(0).all() and batch[i, n:].eq(0).all()


def test_token_logprobs_match_a_naive_reference_and_are_differentiable(policy: Policy) -> None:
    tok = policy.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    completions = [tok("return x\n")["input_ids"][1:], tok("(")["input_ids"][1:], []]
    logprobs, mask = token_logprobs(policy.model, prompts, completions, policy.pad_id)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        assert logprobs[i, : len(c)].tolist() == pytest.approx(naive_logprobs(policy.model, p, c), abs=1e-5)
    assert mask[2].sum().item() == 0  # an empty completion has nothing to score
    (logprobs * mask).sum().backward()
    grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    policy.model.zero_grad(set_to_none=True)


def test_bfloat16_loads_and_generates_on_cpu(tiny_model_dir: Path) -> None:
    bf16 = load_policy(tiny_model_dir, dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    gen = bf16.generate("def ", max_tokens=8, seed=0)
    assert gen.logprobs and all(lp <= 0 for lp in gen.logprobs)
    again, _ = token_logprobs(bf16.model, [gen.prompt_token_ids], [gen.completion_token_ids], bf16.pad_id)
    assert again[0].tolist() == gen.logprobs
    with pytest.raises(ValueError, match="not supported"):
        load_policy(tiny_model_dir, dtype="int4")


def _bfloat16_values_with_sub_step_updates(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bfloat16 values as float32, their bfloat16 step, the values moved by 2% to 48% of a step either way).

    Values are sign x (1 + k/128) x 2**e with k in 1..127: exactly bfloat16, never a power of two, so the
    step is the same on both sides of each."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(1, 128, (n,), generator=gen)
    e = torch.randint(-12, 3, (n,), generator=gen).float()
    sign = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    base = sign * (1 + k / 128) * 2**e
    step = 2 ** (e - 7)
    direction = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    return base, step, base + direction * step * (0.02 + 0.46 * torch.rand(n, generator=gen))


def test_stochastic_rounding_keeps_updates_below_half_a_bfloat16_step_on_average() -> None:
    base, step, x = _bfloat16_values_with_sub_step_updates(64, seed=0)
    assert torch.equal(x.to(torch.bfloat16).float(), base)  # round to nearest: every update is lost
    draws = stochastic_round_to_bfloat16(x.repeat(4000, 1), torch.Generator().manual_seed(1)).float()  # (4000, 64)
    assert ((draws == base) | ((draws - base).abs() == step)).all()  # always one of the two neighbours
    # Unbiased: the mean draw is the float32 value (the standard error is at most 0.008 step here).
    error = ((draws.mean(dim=0) - x) / step).abs()
    assert error.max() < 0.05, f"mean draw off by {error.max():.3f} of a step"
    moved = (draws != base).float().mean(dim=0)  # each value moves with probability |update| / step
    assert torch.allclose(moved, (x - base).abs() / step, atol=0.05)


def test_stochastic_rounding_is_seeded_and_leaves_bfloat16_and_non_finite_values_alone() -> None:
    _, _, x = _bfloat16_values_with_sub_step_updates(1000, seed=2)
    once = stochastic_round_to_bfloat16(x, torch.Generator().manual_seed(7))
    assert once.dtype == torch.bfloat16
    assert torch.equal(once, stochastic_round_to_bfloat16(x, torch.Generator().manual_seed(7)))
    assert not torch.equal(once, stochastic_round_to_bfloat16(x, torch.Generator().manual_seed(8)))
    exact = x.to(torch.bfloat16)
    assert torch.equal(stochastic_round_to_bfloat16(exact.float(), torch.Generator().manual_seed(7)), exact)
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    out = stochastic_round_to_bfloat16(special, torch.Generator().manual_seed(7)).float()
    assert out[:2].tolist() == [float("inf"), float("-inf")] and out[2].isnan()
    assert out[3:].tolist() == [0.0, 0.0] and torch.signbit(out[3:]).tolist() == [False, True]


def test_rounding_a_model_keeps_float32_parameters_holding_bfloat16_values(tiny_model_dir: Path) -> None:
    def trained(seed: int) -> torch.nn.Module:
        model = load_policy(tiny_model_dir).model  # float32: the bfloat16 checkpoint upcast
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-5)  # an update far below most values' bfloat16 step
        round_parameters_to_bfloat16_(model, seed)
        return model

    a, b, c = trained(0), trained(0), trained(1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert pa.dtype == torch.float32 and torch.equal(pa, pa.to(torch.bfloat16).float()), name
        assert torch.equal(pa, pb), name  # same seed, same weights
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True))
    assert a.get_input_embeddings().weight is a.get_output_embeddings().weight  # still tied
