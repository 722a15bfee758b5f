"""The policy model shared by serving and the trainer: load, generate, score, bootstrap.

`from flywheel.lm import Policy, Generation, load_policy, token_logprobs, bootstrap_model`, and the
stochastic rounding that stores float32-trained weights in bfloat16 (`flywheel.lm.precision`).
"""

from __future__ import annotations

from flywheel.lm.bootstrap import METADATA_FILE, PRESETS, bootstrap_model
from flywheel.lm.policy import CheckpointError, Generation, Policy, load_policy
from flywheel.lm.precision import round_parameters_to_bfloat16_, stochastic_round_to_bfloat16
from flywheel.lm.scoring import token_logprobs

__all__ = [
    "METADATA_FILE",
    "PRESETS",
    "CheckpointError",
    "Generation",
    "Policy",
    "bootstrap_model",
    "load_policy",
    "round_parameters_to_bfloat16_",
    "stochastic_round_to_bfloat16",
    "token_logprobs",
]
