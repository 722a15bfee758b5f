"""The off-policy holdout: logged generations the trainer leaves out so the offline gate can judge on them.

An estimate made from the very traffic a candidate was trained on is optimistic: training raised the
probability of exactly the completions that were rewarded there, so their importance weights, and the
estimate, rise with it (measured in the closed loop: +0.07 to +0.11 estimated for candidates no better
in ground truth). A generation is in the holdout when a hash of its *prompt* falls below `share`: the
trainer (`TrainerConfig.ope_holdout_share`, recorded in the candidate's lineage) and the gate read the same
rule, so the gate estimates each candidate from champion traffic on prompts that candidate never trained
on. Keyed by prompt, not by generation: where prompts recur (a file edited for hours, the simulator's
context pools) a holdout by generation id still shares its prompts with the training data, and a candidate
that learned those prompts' rewarded completions is estimated on them, not on prompts it has not seen.

>>> in_holdout("x = ", 0.0), in_holdout("x = ", 1.0)
(False, True)
>>> sum(in_holdout(f"prompt {i}", 0.2) for i in range(10_000))  # about a fifth
1999
"""

from __future__ import annotations

import hashlib


def in_holdout(prompt: str, share: float) -> bool:
    """Whether generations of `prompt` (the logged record's prompt text) are held out of training for the
    offline estimate, at this `share` in [0, 1]."""
    if share <= 0.0:
        return False
    digest = hashlib.sha256(f"ope-holdout:{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < share * 2**64
