"""The policy model shared by serving and the trainer: load, generate, score, bootstrap.

`from flywheel.lm import Policy, Generation, load_policy, token_logprobs, bootstrap_model`, and the
stochastic rounding that stores float32-trained weights in bfloat16 (`flywheel.lm.precision`), and LoRA
adapters on a shared base (`flywheel.lm.adapters`).
"""

from __future__ import annotations

from flywheel.lm.adapters import AdapterInfo, SharedBase, is_adapter_dir, read_adapter_info, write_adapter_info
from flywheel.lm.bootstrap import METADATA_FILE, PRESETS, bootstrap_model
from flywheel.lm.policy import CheckpointError, Generation, Policy, load_policy
from flywheel.lm.precision import round_parameters_to_bfloat16_, stochastic_round_to_bfloat16
from flywheel.lm.scoring import token_logprobs

__all__ = [
    "METADATA_FILE",
    "PRESETS",
    "AdapterInfo",
    "CheckpointError",
    "Generation",
    "Policy",
    "SharedBase",
    "bootstrap_model",
    "is_adapter_dir",
    "load_policy",
    "read_adapter_info",
    "round_parameters_to_bfloat16_",
    "stochastic_round_to_bfloat16",
    "token_logprobs",
    "write_adapter_info",
]
