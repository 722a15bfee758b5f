"""`flywheel ingest ...`: the collector, the workers and the dead letters."""

from __future__ import annotations

import typer

from flywheel.settings import Settings, get_settings

app = typer.Typer(
    help="Collector (HTTP) and ingest workers (Kafka to lake), dead letters.", no_args_is_help=True
)


@app.command()
def collector(
    port: int = typer.Option(0, help="Port; default settings.collector_port."),
    host: str | None = typer.Option(None, help="Interface to bind; default settings.bind_host (127.0.0.1)."),
    workers: int = typer.Option(
        1, min=1, help="Processes serving the port, each with its own socket (SO_REUSEPORT) and Kafka producer."
    ),
) -> None:
    """Run the HTTP collector (Segment-compatible and native endpoints)."""
    settings = get_settings()
    host, port = host or settings.bind_host, port or settings.collector_port
    if workers == 1:
        import uvicorn

        from ingest.collector.app import create_app

        # No access log: a line per tracked batch would drown the process's own (its /metrics counts them).
        # No proxy headers: who the client is behind a proxy is the rate limit's to decide (`Settings.trusted_proxies`).
        uvicorn.run(create_app(settings), host=host, port=port, log_level="info", log_config=None, access_log=False,
                    proxy_headers=False, timeout_keep_alive=settings.http_keep_alive_s)
        return
    import os
    import tempfile

    from ingest.collector.procs import serve

    # Each process builds its app from this environment; their metrics meet in one directory, so /metrics
    # answers for all of them whichever process takes the scrape.
    with tempfile.TemporaryDirectory(prefix="flywheel-collector-metrics-") as metrics_dir:
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", metrics_dir)
        code = serve(host, port, workers)
    raise typer.Exit(code)


@app.command()
def worker(
    group_id: str | None = typer.Option(
        None, help="Consumer group of the ingest workers (default: flywheel-ingest.<events topic>)."
    ),
    batch_size: int = typer.Option(10_000, min=1, help="Most records per batch (one Delta commit each)."),
    linger_s: float = typer.Option(
        1.0, min=0, help="A batch waits this long after its first record to fill up (a Delta commit costs ~20 ms)."
    ),
    pause_before_commit_s: float = typer.Option(0.0, hidden=True, help="Fault injection for crash tests."),
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", min=0, help="Serve /metrics, /healthz, /readyz on settings.bind_host:PORT; "
        "default settings.ingest_metrics_port (9101); 0 turns it off.",
    ),
) -> None:
    """Run an ingest worker (Kafka events topic to the lake) until SIGTERM."""
    from flywheel.ops import stop_on_signals
    from ingest.worker.loop import IngestWorker, run_worker

    settings = get_settings()
    stop = stop_on_signals()
    worker = IngestWorker(
        settings, group_id=group_id, batch_size=batch_size, linger_s=linger_s,
        pause_before_commit_s=pause_before_commit_s,
    )  # fmt: skip
    run_worker(
        worker, stop, settings.ingest_metrics_port if metrics_port is None else metrics_port, settings.bind_host
    )


dead_letters = typer.Typer(help="List and replay dead letters.", no_args_is_help=True)
app.add_typer(dead_letters, name="dead-letters")


@dead_letters.command("list")
def list_letters(
    limit: int = typer.Option(50, min=1, help="Show the newest N."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line (original as base64)."),
) -> None:
    """Show dead letters: where they came from, when, and why they were refused."""
    import json

    from rich.console import Console
    from rich.table import Table

    from ingest.replay import list_dead_letters

    letters = list_dead_letters(_settings_with_kafka())[-limit:]
    if as_json:
        for record, letter in letters:
            doc = json.loads(letter.to_bytes())
            typer.echo(json.dumps({"position": f"{record.topic}/{record.partition}/{record.offset}", **doc}))
        return
    # The reason is what a reader came for: shown whole, wrapped; the rest kept on one line each.
    table = Table()
    for name in ("position", "source", "received_at", "bytes"):
        table.add_column(name, no_wrap=True)
    table.add_column("reason", overflow="fold")
    for record, letter in letters:
        table.add_row(
            f"{record.partition}/{record.offset}",
            letter.source,
            letter.received_at.isoformat(timespec="seconds"),
            str(len(letter.original)),
            letter.reason,
        )
    Console().print(table)
    typer.echo(f"{len(letters)} dead letter(s)")


def _settings_with_kafka() -> Settings:
    """The settings of a command that reads the dead-letter topic: with no Kafka configured and no `flywheel up`
    running beside it, it says so at once instead of failing to bootstrap from an empty address."""
    settings = get_settings()
    if not settings.kafka_bootstrap_servers:
        typer.echo(
            "no Kafka to read the dead letters from: set FLYWHEEL_KAFKA_BOOTSTRAP_SERVERS, or run this while "
            f"`flywheel up` is running (its embedded broker listens on 127.0.0.1:{settings.embedded_kafka_port})",
            err=True,
        )
        raise typer.Exit(2)
    return settings


@dead_letters.command()
def replay(
    source: str = typer.Option("", help="Only letters whose source starts with this (e.g. http:/v1/batch)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Re-validate only; produce nothing."),
) -> None:
    """Re-validate dead letters and produce those that pass now (idempotent: event ids are kept)."""
    from ingest.replay import replay_dead_letters

    result = replay_dead_letters(_settings_with_kafka(), source_prefix=source, dry_run=dry_run)
    verb = "would replay" if dry_run else "replayed"
    typer.echo(f"{verb} {len(result.replayed)} event(s); {len(result.still_invalid)} still invalid")
    for position, reason in result.still_invalid[:20]:
        typer.echo(f"  {position}: {reason}")
