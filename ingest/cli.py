"""`flywheel ingest ...`: the collector, the workers and the dead letters."""

from __future__ import annotations

import typer

from flywheel.settings import get_settings

app = typer.Typer(
    help="Collector (HTTP) and ingest workers (Kafka to lake), dead letters.", no_args_is_help=True
)


@app.command()
def collector(
    port: int = typer.Option(0, help="Port on 127.0.0.1; default settings.collector_port."),
) -> None:
    """Run the HTTP collector (Segment-compatible and native endpoints)."""
    import uvicorn

    from ingest.collector import create_app

    settings = get_settings()
    uvicorn.run(
        create_app(settings), host="127.0.0.1", port=port or settings.collector_port, log_level="info"
    )


@app.command()
def worker(
    group_id: str = typer.Option("flywheel-ingest", help="Consumer group of the ingest workers."),
    batch_size: int = typer.Option(5000, min=1, help="Most records per batch."),
    pause_before_commit_s: float = typer.Option(0.0, hidden=True, help="Fault injection for crash tests."),
) -> None:
    """Run an ingest worker (Kafka events topic to the lake) until SIGTERM."""
    import signal
    import threading

    from ingest.worker import IngestWorker

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    IngestWorker(
        get_settings(), group_id=group_id, batch_size=batch_size, pause_before_commit_s=pause_before_commit_s
    ).run(stop)
