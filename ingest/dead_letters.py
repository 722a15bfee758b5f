"""Dead letters, as ingest writes them: the format is the core's (`flywheel.dead_letters`), shared with signals."""

from __future__ import annotations

from flywheel.dead_letters import DeadLetter, dead_letter

__all__ = ["DeadLetter", "dead_letter"]
