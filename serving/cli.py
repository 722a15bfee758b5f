"""`flywheel serve`: run the model server."""

from __future__ import annotations

import typer

app = typer.Typer(invoke_without_command=True)


@app.callback()
def serve(
    port: int = typer.Option(None, help="Port (default: FLYWHEEL_SERVING_PORT)."),
    host: str | None = typer.Option(None, help="Interface to bind (default: FLYWHEEL_BIND_HOST, 127.0.0.1)."),
) -> None:
    """Serve completions from the champion and challenger named by the traffic split."""
    import uvicorn

    from flywheel.ops import freeze_startup
    from flywheel.settings import get_settings
    from serving import build_serving_app

    settings = get_settings()
    serving_app = build_serving_app(settings)
    freeze_startup()  # the modules and the app live as long as the process: out of the cyclic GC's walks
    uvicorn.run(
        serving_app,
        host=host or settings.bind_host,
        port=port or settings.serving_port,
        log_level="warning",
        log_config=None,  # its records go through the process's JSON logging (`flywheel.logs`)
        timeout_keep_alive=settings.http_keep_alive_s,
    )
