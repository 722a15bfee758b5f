"""Errors of loading a model (kept apart so that every module of `flywheel.lm` can raise them)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """The path given is not a loadable Hugging Face causal-LM checkpoint (or LoRA adapter)."""


__all__ = ["CheckpointError"]
