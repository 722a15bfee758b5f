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
