"""`python -m ingest.worker`: the worker with settings from the environment."""

from __future__ import annotations

from ingest.worker.loop import main

main()
