"""The `flywheel` command: a thin layer over the components.

Each component contributes its own Typer sub-app (`<component>/cli.py`); this
module only mounts them.
"""

from __future__ import annotations

import importlib
import logging

import typer

app = typer.Typer(help="Flywheel: real-time online RL from user reactions.", no_args_is_help=True)

# (sub-command name, module holding a Typer `app`, help)
_COMPONENTS = [
    ("model", "flywheel.model_cli", "Bootstrap or inspect the policy model."),
    ("serve", "serving.cli", "The model server (OpenAI-compatible completions)."),
    ("ingest", "ingest.cli", "Collector (HTTP) and ingest workers (Kafka to lake), dead letters."),
    ("signals", "signals.cli", "Satisfaction signals: rewards per generation."),
    ("trainer", "trainer.cli", "The incremental RL trainer."),
    ("registry", "model_registry.cli", "Model versions and their lineage."),
    ("gate", "deploy_gate.cli", "Approvals, traffic split and the A/B dashboard."),
]


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}',
    )


for _name, _module, _help in _COMPONENTS:
    try:
        _sub = importlib.import_module(_module).app
    except ModuleNotFoundError as exc:  # a component not written yet must not break the others
        if exc.name != _module:
            raise
        continue
    app.add_typer(_sub, name=_name, help=_help)
