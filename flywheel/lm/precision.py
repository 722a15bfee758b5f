"""Weights stored in bfloat16, trained in float32: rounding a trained float32 value to bfloat16 without bias.

Why bfloat16 storage: the registry stores each candidate as a lossless delta against its parent, and
its size is set by how many values change bits. A float32 optimizer step changes the low mantissa bits
of every value it touches (a delta of about 1.7x); in bfloat16 a value keeps its bits unless the update
crosses one of its rounding steps (bench/registry_delta.py).

Why stochastic rounding: a bfloat16 ulp is 2**-7 of a value's power of two, and one cycle's update is
mostly far below half of it, so round-to-nearest would store the parent's value again and the update
would be lost, cycle after cycle. Rounding up with probability (distance above the lower neighbour) / ulp
makes the stored value equal the float32 one in expectation: a value moved by |d| < ulp changes with
probability |d| / ulp, by one ulp, and over many cycles it drifts as the float32 training says.
"""

from __future__ import annotations

import torch

_HIGH_HALF = -(1 << 16)  # 0xFFFF0000 as an int32: keeps sign, exponent and bfloat16's 7 mantissa bits


def stochastic_round_to_bfloat16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`x` rounded to bfloat16, up or down at random so that the expected result is `x`.

    The float32 bits read as an int32, plus a uniform integer in [0, 2**16), then the low 16 bits
    dropped: the carry reaches bfloat16's last mantissa bit with probability (low 16 bits) / 2**16, the
    distance to the lower neighbour in units of the ulp. A float keeps sign and magnitude apart, so this
    rounds the magnitude, for negative values alike, and a carry out of the mantissa steps the exponent,
    which is the next bfloat16 value. A value already in bfloat16 (low bits zero) never moves. Inf and
    NaN take the plain cast. `generator` is on `x`'s device; the same seed gives the same result.

    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.full((100_000,), 1 + 2**-10)  # an eighth of a bfloat16 step above 1
    >>> x.to(torch.bfloat16).unique().tolist()  # round to nearest: the update is lost
    [1.0]
    >>> y = stochastic_round_to_bfloat16(x, g)
    >>> y.unique().tolist()
    [1.0, 1.0078125]
    >>> round((y.float().mean().item() - 1) / 2**-10, 1)  # the mean update, in units of the true one
    1.0
    """
    bits = x.detach().to(torch.float32).contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, dtype=torch.int32, device=bits.device)
    rounded = ((bits + noise) & _HIGH_HALF).view(torch.float32).to(torch.bfloat16)  # exact: low bits are 0
    return torch.where(torch.isfinite(x), rounded, x.to(torch.bfloat16))


@torch.no_grad()
def round_parameters_to_bfloat16_(model: torch.nn.Module, seed: int) -> None:
    """Round every float32 parameter of `model` to a bfloat16 value, stochastically, in place.

    Parameters keep their dtype (float32 holding bfloat16 values), so what runs on the model now, a
    KL to its reference say, sees exactly the weights that will be stored and served, and the final
    cast to bfloat16 is exact. Parameters in another dtype are left as they are. Draws come from one
    generator per device seeded with `seed`, parameters in the model's order: same seed, same result.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for p in model.parameters():
        if p.dtype != torch.float32:
            continue
        if p.device not in generators:
            generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.copy_(stochastic_round_to_bfloat16(p, generators[p.device]))
