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
    check: bool = typer.Option(
        False, help="Write nothing; compare each generation's final record (revision and reward) with the lake's."
    ),
) -> None:
    """Recompute rewards over the lake's events table with one definition version."""
    from signals.recompute import backfill, parity, recompute_rewards, stored_definition, window_s

    settings = get_settings()
    if check:
        report = parity(settings, version)
        typer.echo(json.dumps({"version": version, **report}))
        if report["window_differs"]:
            window = window_s(settings, stored_definition(settings, version))
            typer.echo(
                f"{report['window_differs']} of the stream's records have another window than the {window:g} s these "
                "settings give: check with the settings the stream ran with (FLYWHEEL_REWARD_WINDOW_S; "
                "`flywheel up` runs with 60 s unless it is set)",
                err=True,
            )
        if report["agree"] != report["generations"]:
            raise typer.Exit(1)
    elif write:
        written, skipped = backfill(settings, version)
        typer.echo(json.dumps({"version": version, "written": written, "already_present": skipped}))
    else:
        df = recompute_rewards(settings, version)
        typer.echo(json.dumps({"version": version, "records": df.height}))


@app.command()
def refit(
    surface: str = typer.Option("code-completion", help="The product surface whose thumbs to fit on."),
    activate: bool = typer.Option(True, help="Activate the new definition if it beats the rules."),
) -> None:
    """Fit the surface's satisfaction model on its explicit thumbs; compare it with the rules on held-out
    labels (AUC and ECE with intervals, logged to MLflow); activate it only if it beats them."""
    from signals.config import SignalsConfig
    from signals.satisfaction import refit as do_refit

    result = do_refit(get_settings(), SignalsConfig(), surface=surface, activate=activate)
    typer.echo(json.dumps(result.summary(), default=str))


@app.command()
def definitions() -> None:
    """List reward definition versions with their surface; the active one of each surface is marked '*'."""
    from flywheel.connections import redis_client
    from signals.definitions import DefinitionStore

    store = DefinitionStore(get_settings(), redis_client(get_settings()))
    active = set(store.active_map().values())
    for v in store.versions():
        typer.echo(f"{'*' if v in active else ' '} {v}\t{store.get(v).surface}")


@app.command()
def activate(version: str) -> None:
    """Make `version` the active definition of its surface: the stream scores that surface's generations
    that arrive from now on with it, and the trainer and the dashboard read its records."""
    from flywheel.connections import redis_client
    from signals.definitions import DefinitionStore

    surface = DefinitionStore(get_settings(), redis_client(get_settings())).set_active(version)
    typer.echo(f"active reward definition of {surface}: {version}")


@app.command()
def orphans(limit: int = typer.Option(50, min=1, help="Show at most this many generation ids.")) -> None:
    """Feedback in the lake for generation ids that never had a `generation` event (they score nothing)."""
    from signals.orphans import orphan_feedback

    df = orphan_feedback(get_settings())
    typer.echo(json.dumps({"orphan_generations": df.height, "orphan_events": int(df["events"].sum() or 0)}))
    for row in df.head(limit).iter_rows(named=True):
        typer.echo(json.dumps(row, default=str))


@app.command()
def trends(every: str = typer.Option("1h", help="Bucket width (polars duration, e.g. 15m, 1h, 1d).")) -> None:
    """Signal distributions per arm and model version over time, with gaming alerts."""
    from signals.watch import gaming_alerts, signal_trends

    df = signal_trends(get_settings(), every=every)
    typer.echo(str(df))
    typer.echo(str(gaming_alerts(df)))


@app.command()
def sycophancy(
    experiment: str = typer.Option("", help="The experiment whose arms to compare; empty: every chat generation."),
    surface: str = typer.Option("chat", help="The product surface whose replies to read."),
) -> None:
    """Flag a challenger whose replies got longer, more agreeable or more flattering (or whose reward rose)
    without more thumbs up than the champion's; exits 1 when flagged."""
    from signals.chat_reward import experiment_sycophancy

    check = experiment_sycophancy(get_settings(), experiment=experiment, surface=surface)
    typer.echo(json.dumps({"flagged": check.flagged, "reasons": list(check.reasons), **check.metrics()}))
    if check.flagged:
        raise typer.Exit(1)
