"""Which tensors differ between two checkpoints, and by how much (`flywheel registry diff`).

Counts compare raw bits (a value is changed when its bits are), so the changed share is exactly
what a delta has to carry; sizes of the change are measured in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class TensorDiff:
    file: str
    name: str
    status: Literal["same", "changed", "added", "removed", "reshaped"]
    elements: int
    changed: int = 0
    max_abs: float = 0.0
    rel_l2: float = 0.0  # ||b - a|| / ||a||

    @property
    def changed_share(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


def diff_checkpoints(a: Path, b: Path) -> list[TensorDiff]:
    """Tensor by tensor, every safetensors file of checkpoint `a` against `b`'s (bit-level counts)."""
    import torch
    from safetensors.torch import load_file

    out: list[TensorDiff] = []
    names = sorted({p.relative_to(d).as_posix() for d in (a, b) for p in d.rglob("*.safetensors")})
    for file in names:
        old = load_file(a / file) if (a / file).is_file() else {}
        new = load_file(b / file) if (b / file).is_file() else {}
        for name in sorted(set(old) | set(new)):
            x, y = old.get(name), new.get(name)
            if x is None or y is None:
                t = x if y is None else y
                assert t is not None
                out.append(TensorDiff(file, name, "removed" if y is None else "added", t.numel()))
                continue
            if x.shape != y.shape or x.dtype != y.dtype:
                out.append(TensorDiff(file, name, "reshaped", y.numel()))
                continue
            if x.element_size() in (1, 2, 4, 8):
                bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
                changed = int((x.view(bits) != y.view(bits)).sum())
            else:
                changed = int((x != y).sum())
            if changed == 0:
                out.append(TensorDiff(file, name, "same", y.numel()))
                continue
            xd, yd = x.double(), y.double()
            delta = (yd - xd).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
            norm = float(xd.norm())
            out.append(TensorDiff(file, name, "changed", y.numel(), changed, float(delta.abs().max()),
                                  float(delta.norm()) / norm if norm else float("inf")))  # fmt: skip
    return out
