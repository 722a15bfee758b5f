"""Log-probabilities of completion tokens: the one function serving and the trainer share.

Serving logs each generation's behaviour log-probs with `token_logprobs` (batch of one) and the
trainer recomputes them with the same function, so on the same device and dtype the two agree
bit for bit and any importance ratio the trainer sees comes from changed weights, not numerics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def token_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each completion token given its prompt and the completion tokens before it.

    Returns `(logprobs, mask)`, both `(batch, T)` float32 with `T` the longest completion;
    positions past a sample's completion hold `0.0` in both. Differentiable: call it under
    `torch.no_grad()` yourself when you only need values.

    Each sample is scored with its own forward pass of exactly `prompt + completion` tokens.
    Why not one padded forward: on CPU float32 a padded batch is *not* bit-identical to the
    same sample alone (other matmul shapes pick other kernel blockings and accumulation
    orders; bench/lm_logprob_agreement.py measures it), and the trainer must reproduce the logged
    behaviour log-probs exactly. Sequences here are short (prompt + a line of completion),
    so the per-sample loop costs little next to the backward pass.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(
            f"prompt_ids has {len(prompt_ids)} samples but completion_ids has {len(completion_ids)}; "
            "pass one prompt per completion."
        )
    batch = len(prompt_ids)
    longest = max((len(c) for c in completion_ids), default=0)
    device = next(model.parameters()).device
    rows: list[Tensor] = []
    for prompt, completion in zip(prompt_ids, completion_ids, strict=True):
        if not prompt:
            raise ValueError("every prompt needs at least one token (e.g. the BOS token) to condition on.")
        n_prompt, n_completion = len(prompt), len(completion)
        if n_completion == 0:
            rows.append(torch.zeros(longest, dtype=torch.float32, device=device))
            continue
        # The last completion token predicts nothing we score, so it is not fed in.
        inputs = torch.tensor(
            [list(prompt) + list(completion[:-1])], dtype=torch.long, device=device
        )  # (1, L)
        logits = model(input_ids=inputs, use_cache=False).logits[0]  # (L, vocab)
        # Logits at position i predict token i+1: completion token j is predicted at n_prompt-1+j.
        scored = logits[n_prompt - 1 :].float()  # (n_completion, vocab)
        targets = torch.tensor(completion, dtype=torch.long, device=device)  # (n_completion,)
        row = torch.log_softmax(scored, dim=-1).gather(-1, targets[:, None])[:, 0]  # (n_completion,)
        rows.append(torch.nn.functional.pad(row, (0, longest - n_completion), value=0.0))
    if batch == 0:
        empty = torch.zeros(0, 0, dtype=torch.float32, device=device)
        return empty, empty.clone()
    logprobs = torch.stack(rows)  # (batch, T)
    lengths = torch.tensor([len(c) for c in completion_ids], device=device)  # (batch,)
    mask = (torch.arange(longest, device=device)[None, :] < lengths[:, None]).float()  # (batch, T)
    # pad_id is part of the agreed signature for batched scorers; per-sample scoring needs no padding.
    del pad_id
    return logprobs, mask
