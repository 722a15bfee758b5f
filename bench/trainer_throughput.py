"""Trainer throughput: tokens/s of the cycle's optimizer steps over a bare torch loop.

Both run on the same freshly initialised Llama model (the bootstrap preset's shape), the same
samples (prompt + completion token ids) and batch size, in the same process:
- bare: one right-padded forward, cross-entropy on the completion tokens, backward, AdamW step;
- trainer (batched scoring): `trainer.loop.train_policy` with exact_logprobs=False;
- trainer (exact scoring): the same with exact_logprobs=True, one forward per sample so the
  log-probs match serving's bit for bit (what a cycle uses by default).
Also reports the train / inference mismatch on this device and dtype: behaviour log-probs
logged by `Policy.generate` versus the trainer's recomputation (exact and batched).

    python bench/trainer_throughput.py [--device cuda] [--dtype bfloat16] [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from datetime import UTC, datetime

import torch

from flywheel.lm import PRESETS
from flywheel.lm.bootstrap import llama_config
from trainer.config import TrainerConfig
from trainer.data import Sample
from trainer.loop import mismatch_report, score_samples, train_policy
from trainer.scoring import scorer_for

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(preset: str, device: str, dtype: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = llama_config(PRESETS[preset], PRESETS[preset].vocab_size)
    return LlamaForCausalLM(config).to(device=device, dtype=_DTYPES[dtype]).eval()


def make_samples(
    n: int, vocab: int, prompt_len: tuple[int, int], completion_len: tuple[int, int]
) -> list[Sample]:
    rng = random.Random(0)
    now = datetime.now(UTC)
    out = []
    for i in range(n):
        p = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))]
        c = [rng.randrange(vocab) for _ in range(rng.randint(*completion_len))]
        out.append(Sample(f"g{i}", "u", p, c, [0.0] * len(c), rng.choice([-1.0, 1.0]), "1", now))
    return out


def bare_loop(model: torch.nn.Module, samples: list[Sample], batch_size: int, steps: int, lr: float) -> float:
    """Seconds for `steps` plain padded forward / backward / AdamW steps."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batches = [samples[i : i + batch_size] for i in range(0, len(samples), batch_size)]
    _sync(device)
    start = time.perf_counter()
    for step in range(steps):
        batch = batches[step % len(batches)]
        seqs = [s.prompt_token_ids + s.completion_token_ids[:-1] for s in batch]
        width = max(len(s) for s in seqs)
        inputs = torch.zeros(len(batch), width, dtype=torch.long, device=device)
        labels = torch.full((len(batch), width), -100, dtype=torch.long, device=device)
        attention = torch.zeros(len(batch), width, dtype=torch.long, device=device)
        for i, (s, seq) in enumerate(zip(batch, seqs, strict=True)):
            inputs[i, : len(seq)] = torch.tensor(seq, device=device)
            attention[i, : len(seq)] = 1
            n_prompt = len(s.prompt_token_ids)
            labels[i, n_prompt - 1 : n_prompt - 1 + len(s.completion_token_ids)] = torch.tensor(
                s.completion_token_ids, device=device
            )
        logits = model(input_ids=inputs, attention_mask=attention, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    _sync(device)
    return time.perf_counter() - start


def trainer_loop(model: torch.nn.Module, samples: list[Sample], config: TrainerConfig) -> float:
    scorer = scorer_for(config.exact_logprobs)
    reference = [s.behaviour_logprobs for s in samples]
    device = next(model.parameters()).device
    _sync(device)
    start = time.perf_counter()
    train_policy(model, samples, reference, config, scorer, pad_id=0)
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mismatch(device: str, dtype: str, n: int) -> None:
    """Serving's logged log-probs vs the trainer's, on a bootstrapped test model on this device."""
    import tempfile
    from pathlib import Path

    from flywheel.lm import bootstrap_model, load_policy

    with tempfile.TemporaryDirectory() as tmp:
        path = bootstrap_model(Path(tmp) / "m", preset="test", seed=0, progress=False)
        policy = load_policy(path, device=device, dtype=dtype)
    prompts = ["def add(a, b):\n    return", "import os\n", "for i in range(", "x = ", "print("]
    now = datetime.now(UTC)
    samples = []
    for i in range(n):
        g = policy.generate(prompts[i % len(prompts)], max_tokens=12, seed=i)
        samples.append(
            Sample(f"g{i}", "u", g.prompt_token_ids, g.completion_token_ids, g.logprobs, 0.0, "1", now)
        )
    for exact in (True, False):
        recomputed = score_samples(policy.model, samples, scorer_for(exact), policy.pad_id, 8)
        r = mismatch_report(samples, recomputed, "1", 1e-3)
        print(
            f"mismatch ({'exact' if exact else 'batched'} scoring, {device} {dtype}): {r.tokens} tokens, "
            f"mean |diff| {r.mean_abs:.3g}, max {r.max_abs:.3g}, share > 1e-3 {r.share_over_threshold:.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2, help="Best of this many timings of each loop.")
    ap.add_argument("--mismatch-samples", type=int, default=24)
    args = ap.parse_args()

    base = build_model(args.preset, args.device, args.dtype)
    samples = make_samples(args.batch_size * args.steps, PRESETS[args.preset].vocab_size, (24, 48), (4, 16))
    tokens = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) - 1 for s in samples)
    lr = 1e-5
    timings: dict[str, float] = {}
    for _ in range(args.repeats):  # interleaved, so a busy machine slows every loop alike
        t = bare_loop(copy.deepcopy(base), samples, args.batch_size, args.steps, lr)
        timings["bare"] = min(timings.get("bare", t), t)
        for exact in (False, True):
            cfg = TrainerConfig(
                batch_size=args.batch_size,
                learning_rate=lr,
                device=args.device.split(":")[0],
                dtype=args.dtype,
                exact_logprobs=exact,
            )
            name = "trainer (exact scoring)" if exact else "trainer (batched scoring)"
            t = trainer_loop(copy.deepcopy(base), samples, cfg)
            timings[name] = min(timings.get(name, t), t)
    n_params = sum(p.numel() for p in base.parameters())
    print(
        f"model: {args.preset} preset, {n_params / 1e6:.1f}M params, {args.device} {args.dtype}; "
        f"{args.steps} steps x batch {args.batch_size}, {tokens} tokens per pass, best of {args.repeats}"
    )
    bare_tps = tokens / timings["bare"]
    print(f"bare torch loop: {bare_tps:,.0f} tokens/s")
    for name in ("trainer (batched scoring)", "trainer (exact scoring)"):
        tps = tokens / timings[name]
        print(f"{name}: {tps:,.0f} tokens/s  ratio over bare {tps / bare_tps:.3f}")
    if args.mismatch_samples:
        mismatch(args.device, args.dtype, args.mismatch_samples)


if __name__ == "__main__":
    main()
