"""torch.distributed for a cycle under torchrun: the rank, the device, and what every process must agree on.

Outside torchrun (WORLD_SIZE unset or 1) every helper is the identity or a no-op, so a cycle runs the same code
on one process.
"""

from __future__ import annotations

import os
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def distributed_rank_world() -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group (gloo on CPU, NCCL on CUDA) under torchrun."""
    if not (dist.is_available() and dist.is_initialized()):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and dist.is_available():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        else:
            return 0, 1
    return dist.get_rank(), dist.get_world_size()


def local_device(device: str) -> str:
    """`device` for this process: "cuda" is this process's own GPU (LOCAL_RANK) under torchrun."""
    if device == "cuda" and dist.is_available() and dist.is_initialized():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def broadcast_from_zero(obj: T, world: int) -> T:
    """Process 0's `obj` on every process (identity when not distributed)."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_process(flag: bool, model: torch.nn.Module) -> bool:
    """Whether `flag` holds on any process: every process must stop sampling at the same prompt, or they would
    train on different samples (and DDP would hang)."""
    out = torch.tensor([float(flag)], device=next(model.parameters()).device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return bool(out.item())


def barrier(world: int) -> None:
    """Wait for every process (nothing to wait for when not distributed)."""
    if world > 1:
        dist.barrier()
