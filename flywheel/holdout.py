"""The off-policy holdout: logged generations the trainer leaves out so the offline gate can judge on them.

An estimate made from the very traffic a candidate was trained on is optimistic: training raised the
probability of exactly the completions that were rewarded there, so their importance weights, and the
estimate, rise with it (measured in the closed loop: +0.07 to +0.11 estimated for candidates no better
in ground truth). A generation is in the holdout when a hash of its id falls below `share`: the trainer
(`TrainerConfig.ope_holdout_share`, recorded in the candidate's lineage) and the gate read the same rule,
so the gate estimates each candidate from champion traffic that candidate never saw.

>>> in_holdout("g-1", 0.0), in_holdout("g-1", 1.0)
(False, True)
>>> sum(in_holdout(f"g{i}", 0.2) for i in range(10_000))  # about a fifth
1989
"""

from __future__ import annotations

import hashlib


def in_holdout(generation_id: str, share: float) -> bool:
    """Whether `generation_id` is held out of training for the offline estimate, at this `share` in [0, 1]."""
    if share <= 0.0:
        return False
    digest = hashlib.sha256(f"ope-holdout:{generation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < share * 2**64
