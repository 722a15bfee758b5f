"""`flywheel signals ...`: run the worker, recompute a version, refit, inspect."""

from __future__ import annotations

import json

import typer

from flywheel.settings import get_settings

app = typer.Typer(help="Satisfaction signals: one reward record per generation.", no_args_is_help=True)


@app.command()
def worker(
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", min=0, help="Serve /metrics, /healthz, /readyz on settings.bind_host:PORT; "
        "default settings.signals_metrics_port (9102); 0 turns it off.",
    ),
) -> None:
    """Run the streaming extractor until interrupted (SIGINT / SIGTERM)."""
    from flywheel.ops import run_worker, stop_on_signals
    from signals.worker import SignalsWorker

    settings = get_settings()
    stop = stop_on_signals()
    extractor = SignalsWorker(settings)
    port = settings.signals_metrics_port if metrics_port is None else metrics_port
    run_worker(extractor.health, extractor.run, stop, port=port, host=settings.bind_host)


@app.command()
def recompute(
    version: str = typer.Option(..., "--version", help="Reward definition version to compute."),
    write: bool = typer.Option(
        True, help="Write records missing from the lake's rewards table (a backfill)."
    ),
) -> None:
    """Recompute rewards over the lake's events table with one definition version."""
    from signals.recompute import backfill, recompute_rewards

    settings = get_settings()
    if write:
        written, skipped = backfill(settings, version)
        typer.echo(json.dumps({"version": version, "written": written, "already_present": skipped}))
    else:
        df = recompute_rewards(settings, version)
        typer.echo(json.dumps({"version": version, "records": df.height}))


@app.command()
def refit(
    activate: bool = typer.Option(True, help="Make the new definition active when it has enough labels."),
) -> None:
    """Fit the satisfaction model on explicit thumbs; log AUC and ECE to MLflow."""
    from signals.config import SignalsConfig
    from signals.satisfaction import refit as do_refit

    result = do_refit(get_settings(), SignalsConfig(), activate=activate)
    typer.echo(json.dumps(result.summary(), default=str))


@app.command()
def definitions() -> None:
    """List reward definition versions; the active one is marked with '*'."""
    from flywheel.connections import redis_client
    from signals.definitions import DefinitionStore

    store = DefinitionStore(get_settings(), redis_client(get_settings()))
    active = store.active_version()
    for v in store.versions():
        typer.echo(f"{'*' if v == active else ' '} {v}")


@app.command()
def activate(version: str) -> None:
    """Make `version` the definition the stream uses for windows that close from now on."""
    from flywheel.connections import redis_client
    from signals.definitions import DefinitionStore

    DefinitionStore(get_settings(), redis_client(get_settings())).set_active(version)
    typer.echo(f"active reward definition: {version}")


@app.command()
def trends(every: str = typer.Option("1h", help="Bucket width (polars duration, e.g. 15m, 1h, 1d).")) -> None:
    """Signal distributions per arm and model version over time, with gaming alerts."""
    from signals.watch import gaming_alerts, signal_trends

    df = signal_trends(get_settings(), every=every)
    typer.echo(str(df))
    typer.echo(str(gaming_alerts(df)))
