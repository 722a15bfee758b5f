"""The `flywheel` command: a thin layer over the components.

Each component contributes its own Typer sub-app (`<component>/cli.py`); this
module only mounts them.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from pathlib import Path

import typer

from flywheel.logs import configure_logging

app = typer.Typer(help="Flywheel: real-time online RL from user reactions.", no_args_is_help=True)

# (sub-command name, module holding a Typer `app`, help)
_COMPONENTS = [
    ("model", "flywheel.lm.cli", "Bootstrap, make a tiny one of a family, or inspect the policy model."),
    ("serve", "serving.cli", "The model server (OpenAI-compatible completions)."),
    ("ingest", "ingest.cli", "Collector (HTTP) and ingest workers (Kafka to lake), dead letters."),
    ("signals", "signals.cli", "Satisfaction signals: rewards per generation."),
    ("trainer", "trainer.cli", "The incremental RL trainer."),
    ("registry", "model_registry.cli", "Model versions and their lineage."),
    ("gate", "deploy_gate.cli", "Approvals, traffic split and the A/B dashboard."),
    ("lake", "launcher.lake", "The lake's Delta tables: history, compaction, vacuum, migration."),
    ("config", "launcher.config_cli", "Every setting's value and source; check them without starting anything."),
]


@app.callback()
def _main(ctx: typer.Context, verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    # One JSON object per line for every logger of the process, whatever the messages hold.
    configure_logging(verbose)
    if ctx.invoked_subcommand not in ("up", "config"):  # config says what the environment holds, as it is
        _join_a_running_embedded_broker()


def _join_a_running_embedded_broker() -> None:
    """With no Kafka configured, a command run beside `flywheel up` (dead letters, replay, a worker) talks to the
    broker `flywheel up` started on its loopback port, instead of failing to bootstrap from nothing."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return
    from flywheel.settings import Settings, get_settings

    port = Settings.model_fields["embedded_kafka_port"].default
    port = int(os.environ.get("FLYWHEEL_EMBEDDED_KAFKA_PORT", port))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            pass
    except OSError:
        return
    os.environ["KAFKA_BOOTSTRAP_SERVERS"] = f"127.0.0.1:{port}"
    get_settings.cache_clear()


def _needed(argv: list[str]) -> set[str] | None:
    """The sub-commands whose modules the `flywheel` command (or `python -m launcher`, as `flywheel up` starts
    each component) imports: the one its command line names (`up`, `init` and the top-level help name none of
    them); None (all) when this module is imported by anything else (a test's `CliRunner`). Importing every
    component loads torch, transformers and MLflow, about 20 s on a busy machine, for `flywheel gate plan` as
    much as for `flywheel trainer run`."""
    path = Path(argv[0]) if argv else Path()
    if path.name != "flywheel" and path.parts[-2:] != ("launcher", "__main__.py"):
        return None
    words = [a for a in argv[1:] if not a.startswith("-")]
    return {words[0]} if words else set()


_NEEDED = _needed(sys.argv)
for _name, _module, _help in _COMPONENTS:
    if _NEEDED is not None and _name not in _NEEDED:
        app.add_typer(typer.Typer(), name=_name, help=_help)  # listed in the help; never run
        continue
    try:
        _sub = importlib.import_module(_module).app
    except ModuleNotFoundError as exc:  # a component not written yet must not break the others
        if exc.name != _module:
            raise
        continue
    app.add_typer(_sub, name=_name, help=_help)


_TRAINER_CONFIG_OPTION = typer.Option(
    None, help="TrainerConfig JSON for the trainer (default: the demo's fields, launcher/demo.py)."
)


_POPULATIONS_OPTION = typer.Option(
    "",
    help="The simulated users' populations, comma-separated (simulator/populations.py). Default: the three the "
    "defaults were tuned on (length, style, declining), so the demo shows the loop on users it was built for; content, "
    "noisy, style-mirror and brackets were not used for tuning (bench/outside_traffic.py reports on them).",
)


@app.command()
def up(
    users: int = typer.Option(4000, help="Simulated users; 0: none (drive it from outside: bench/outside_traffic.py)."),
    rate: float = typer.Option(
        12.0, help="Requests a second from the simulated users, each from a user drawn at random (a small product); "
        "0: each user a thread of its own asking every 0.2 s on average (a handful of very active users)."),
    bootstrap_seconds: float = typer.Option(120.0, help="CPU seconds to pretrain the embedded model."),
    train_interval: float = typer.Option(120.0, help="Seconds between training cycles (production: hours)."),
    auto_approve: bool = typer.Option(True, help="Approve candidates automatically (demo only)."),
    duration: float = typer.Option(None, help="Stop after this many seconds (default: run until Ctrl-C)."),
    trainer_config: Path = _TRAINER_CONFIG_OPTION,
    populations: str = _POPULATIONS_OPTION,
) -> None:
    """Run the whole loop on one machine: embedded parts, every component, simulated users, dashboard."""
    from flywheel.settings import get_settings
    from launcher.up import run_up
    from simulator.populations import populations_named

    names = [n.strip() for n in populations.split(",") if n.strip()]
    try:
        populations_named(names)  # checked before anything starts
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--populations") from exc
    run_up(get_settings(), users=users, rate=rate, bootstrap_seconds=bootstrap_seconds,
           train_interval_s=train_interval,
           auto_approve_candidates=auto_approve, duration_s=duration, trainer_config=trainer_config,
           populations=names or None)  # fmt: skip


@app.command("init")
def init(
    bootstrap_seconds: float = typer.Option(
        120.0, help="CPU seconds to pretrain the embedded model when FLYWHEEL_MODEL_PATH is empty."
    ),
) -> None:
    """Give a new deployment its first champion: register FLYWHEEL_MODEL_PATH (or bootstrap the embedded
    model) and point the traffic split at it. Does nothing when a champion and its split are there, so a
    Kubernetes Job may run it on every deploy; serving is ready only once it has."""
    from flywheel.settings import get_settings
    from launcher.up import ensure_champion

    version = ensure_champion(get_settings(), bootstrap_seconds=bootstrap_seconds, progress=False)
    typer.echo(f"champion v{version}")
