"""Completion log-probs for training: exact per-sample scoring, or one padded batch.

`exact` is `flywheel.lm.token_logprobs`, the function serving logs behaviour log-probs with,
so on the same device and dtype the trainer reproduces them bit for bit. `batched` runs the
whole batch in one right-padded forward pass: faster, but other matmul shapes accumulate in
another order, so it differs from serving by ~1e-6 (the mismatch report shows how much).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from flywheel.lm import token_logprobs

Scorer = Callable[
    [torch.nn.Module, Sequence[Sequence[int]], Sequence[Sequence[int]], int], tuple[Tensor, Tensor]
]


def batched_token_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int,
) -> tuple[Tensor, Tensor]:
    """Same contract as `token_logprobs`: (B, T) log-probs and mask of the completion tokens."""
    device = next(model.parameters()).device
    batch = len(prompt_ids)
    longest = max((len(c) for c in completion_ids), default=0)
    if batch == 0 or longest == 0:
        zeros = torch.zeros(batch, longest, dtype=torch.float32, device=device)
        return zeros, zeros.clone()
    # Inputs are prompt + completion[:-1]: the last completion token predicts nothing we score.
    seqs = [list(p) + list(c[:-1]) if c else list(p) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(len(s) for s in seqs)
    inputs = torch.full((batch, width), pad_id, dtype=torch.long, device=device)  # (B, L)
    attention = torch.zeros(batch, width, dtype=torch.long, device=device)  # (B, L)
    for i, s in enumerate(seqs):
        inputs[i, : len(s)] = torch.tensor(s, device=device)
        attention[i, : len(s)] = 1
    logits = model(input_ids=inputs, attention_mask=attention, use_cache=False).logits  # (B, L, V)
    # Completion token j of sample i is predicted at position len(prompt_i) - 1 + j.
    starts = torch.tensor([len(p) - 1 for p in prompt_ids], device=device)  # (B,)
    offsets = torch.arange(longest, device=device)  # (T,)
    positions = (starts[:, None] + offsets[None, :]).clamp(max=width - 1)  # (B, T)
    picked = logits.gather(1, positions[:, :, None].expand(-1, -1, logits.shape[-1])).float()  # (B, T, V)
    targets = torch.full((batch, longest), 0, dtype=torch.long, device=device)  # (B, T)
    lengths = torch.tensor([len(c) for c in completion_ids], device=device)  # (B,)
    for i, c in enumerate(completion_ids):
        if c:
            targets[i, : len(c)] = torch.tensor(c, device=device)
    mask = (offsets[None, :] < lengths[:, None]).float()  # (B, T)
    logprobs = torch.log_softmax(picked, dim=-1).gather(-1, targets[:, :, None])[:, :, 0] * mask  # (B, T)
    return logprobs, mask


def scorer_for(exact: bool) -> Scorer:
    return token_logprobs if exact else batched_token_logprobs
