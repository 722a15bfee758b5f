"""Train/inference log-prob agreement and the cost of making it exact.

Prints, for a bootstrapped test model (or --path DIR) on CPU:
- logged vs trainer-recomputed behaviour log-probs (token_logprobs, same dtype): max |diff|
- a padded batched forward vs per-sample forward: max |diff| (why token_logprobs scores per sample)
- KV-cache sampling log-probs vs a full forward, and bfloat16 vs float32: max |diff|
- scoring throughput of token_logprobs (per-sample forwards) as a ratio to one padded batched
  forward (the bare baseline), and generate() tokens/s as a ratio to a bare KV-cache loop.

Run: python bench/lm_logprob_agreement.py [--path DIR] [--samples 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from flywheel.lm import Policy, bootstrap_model, load_policy, token_logprobs

PROMPTS = [
    "def ",
    "import os\n\nclass Config:\n    def __init__(self",
    "    for key, value in ",
    "# parse\nx = ",
]


def padded_logprobs(
    model, prompts: list[list[int]], completions: list[list[int]], pad: int
) -> list[torch.Tensor]:
    """Baseline: one right-padded batched forward with an attention mask."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad)  # (B, L)
    attention = torch.zeros(len(seqs), width, dtype=torch.long)  # (B, L)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
    logp = torch.log_softmax(
        model(input_ids=ids, attention_mask=attention).logits.float(), dim=-1
    )  # (B, L, V)
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        positions = torch.arange(len(p) - 1, len(p) - 1 + len(c))
        out.append(logp[i, positions, torch.tensor(c)])
    return out


def kv_cache_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """What the sampler saw: log-probs from incremental KV-cache steps."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    values = []
    for token in completion:
        values.append(torch.log_softmax(out.logits[0, -1].float(), -1)[token].item())
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return values


def bare_generate(model, prompt: list[int], n: int) -> None:
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    for _ in range(n):
        token = int(out.logits[0, -1].argmax())
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", type=Path, default=None)
    parser.add_argument("--samples", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread is faster and steadier
    path = args.path or bootstrap_model(
        Path(tempfile.mkdtemp()) / "tiny", preset="test", seed=0, progress=False
    )
    policy: Policy = load_policy(path)
    model = policy.model
    gens = [
        policy.generate(PROMPTS[i % len(PROMPTS)], max_tokens=16, seed=i, temperature=1.0)
        for i in range(args.samples)
    ]
    prompts = [g.prompt_token_ids for g in gens]
    completions = [g.completion_token_ids for g in gens]
    with torch.no_grad():
        recomputed, _ = token_logprobs(model, prompts, completions, policy.pad_id)  # (B, T)
        logged_diff = max(
            (recomputed[i, : len(g.logprobs)] - torch.tensor(g.logprobs)).abs().max().item()
            for i, g in enumerate(gens)
        )
        padded = padded_logprobs(model, prompts, completions, policy.pad_id)
        padded_diff = max(
            (padded[i] - recomputed[i, : len(c)]).abs().max().item() for i, c in enumerate(completions)
        )
        kv_diff = max(
            max(abs(a - b) for a, b in zip(kv_cache_logprobs(model, p, c), g.logprobs, strict=True))
            for p, c, g in zip(prompts, completions, gens, strict=True)
        )
        bf16 = load_policy(path, dtype="bfloat16")
        bf16_lp, _ = token_logprobs(bf16.model, prompts, completions, bf16.pad_id)
        lengths = torch.tensor([len(c) for c in completions])
        mask = torch.arange(recomputed.shape[1])[None, :] < lengths[:, None]
        bf16_diff = (bf16_lp - recomputed).abs()[mask]

        per_sample_s = timed(lambda: token_logprobs(model, prompts, completions, policy.pad_id))
        batched_s = timed(lambda: padded_logprobs(model, prompts, completions, policy.pad_id))
    n_tokens = int(lengths.sum())
    prompt = policy.encode_prompt(PROMPTS[1], 32)
    with torch.inference_mode():
        bare_s = timed(lambda: bare_generate(model, prompt, 32))
    # Greedy with a stop-free budget is not guaranteed; time the real path on the same prompt.
    gen_tokens = []

    def real() -> None:
        gen_tokens.append(
            len(policy.generate(PROMPTS[1], max_tokens=32, temperature=0.0).completion_token_ids)
        )

    real_s = timed(real)
    real_tps, bare_tps = gen_tokens[-1] / real_s, 32 / bare_s

    print(f"model: {path}  samples: {len(gens)}  completion tokens: {n_tokens}")
    print(f"logged vs token_logprobs recomputation   max|diff| = {logged_diff:.3e}  (must be 0)")
    print(f"padded batched forward vs per-sample     max|diff| = {padded_diff:.3e}")
    print(f"KV-cache sampling vs full forward        max|diff| = {kv_diff:.3e}")
    print(
        f"bfloat16 vs float32 log-probs            max|diff| = {bf16_diff.max().item():.3e}  "
        f"mean = {bf16_diff.mean().item():.3e}"
    )
    print(
        f"scoring: token_logprobs {n_tokens / per_sample_s:,.0f} tok/s vs padded batch "
        f"{n_tokens / batched_s:,.0f} tok/s  ratio {batched_s / per_sample_s:.2f}x"
    )
    print(
        f"generate (with logged logprobs) {real_tps:,.0f} tok/s vs bare KV-cache loop {bare_tps:,.0f} tok/s  "
        f"ratio {real_tps / bare_tps:.2f}x"
    )


if __name__ == "__main__":
    main()
