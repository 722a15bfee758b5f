"""`flywheel trainer`: one cycle now (`run-once`) or cycles on a schedule (`schedule`)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import typer
from rich.console import Console

from flywheel.settings import get_settings
from trainer.config import TrainerConfig
from trainer.cycle import run_cycle
from trainer.distributed import broadcast_from_zero, distributed_rank_world
from trainer.scheduler import TrainerScheduler, cycle_lock, lock_key

app = typer.Typer(no_args_is_help=True)
console = Console()

_CONFIG_OPTION = typer.Option(
    None,
    "--config",
    exists=True,
    dir_okay=False,
    help="JSON file with TrainerConfig fields, over FLYWHEEL_TRAINER_* (docs/configuration.md).",
)


def _config(path: Path | None, objective: str | None, lr: float | None, device: str | None,
            dtype: str | None) -> TrainerConfig:  # fmt: skip
    values = json.loads(path.read_text()) if path else {}
    for key, value in (("objective", objective), ("learning_rate", lr), ("device", device), ("dtype", dtype)):
        if value is not None:
            values[key] = value
    try:
        return TrainerConfig.from_dict(values)
    except (ValueError, TypeError) as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None


@app.command("run-once")
def run_once(
    config: Path | None = _CONFIG_OPTION,
    objective: str | None = typer.Option(None, help="pg, kto or rwl (kto and rwl need no behaviour log-probs)"),
    lr: float | None = typer.Option(None, "--lr", help="Learning rate."),
    device: str | None = typer.Option(None, help="cpu, cuda or cuda:N"),
    dtype: str | None = typer.Option(None, help="float32 or bfloat16"),
) -> None:
    """Run one training cycle now (waits for no one: skips if another replica is training)."""
    settings = get_settings()
    cfg = _config(config, objective, lr, device, dtype)
    from flywheel.connections import redis_client

    rank, world = distributed_rank_world()  # under torchrun, process 0 holds the lock for all
    lock = (
        cycle_lock(redis_client(settings), lock_key(settings)) if rank == 0 else contextlib.nullcontext(True)
    )
    with lock as held:
        if not broadcast_from_zero(held, world):
            console.print("[yellow]skipped:[/] another replica is training right now")
            return
        result = run_cycle(settings, cfg, progress=True)
    if rank != 0:
        return
    if result.status == "registered":
        console.print(f"[green]registered candidate v{result.version}[/] from v{result.parent_version}: "
                      f"{result.sample_count} samples, run {result.run_id}")  # fmt: skip
        for key in ("mean_reward", "kl_to_champion", "mismatch_mean_abs", "mismatch_max_abs"):
            if key in result.metrics:
                console.print(f"  {key}: {result.metrics[key]:.6g}")
    else:
        console.print(f"[yellow]skipped:[/] {result.reason}")


@app.command("schedule")
def schedule(
    config: Path | None = _CONFIG_OPTION,
    interval_s: float | None = typer.Option(
        None, help="Seconds between cycles (default: FLYWHEEL_TRAIN_INTERVAL_S)."
    ),
    now: bool = typer.Option(False, "--now", help="Also run a cycle right away."),
    port: int | None = typer.Option(
        None, help="Serve the status / manual-trigger API on PORT (default FLYWHEEL_TRAINER_PORT; 0: none), "
        "on FLYWHEEL_BIND_HOST (127.0.0.1)."
    ),
) -> None:
    """Run cycles every interval until stopped; a restart keeps the schedule."""
    settings = get_settings()
    scheduler = TrainerScheduler(settings, _config(config, None, None, None, None), interval_s=interval_s)
    next_run = scheduler.start()
    if now:
        scheduler.run_now()
        next_run = scheduler.next_run_time()
    console.print(f"trainer scheduled every {scheduler.interval_s:.0f}s; next cycle at {next_run}")
    port = settings.trainer_port if port is None else port
    if port:
        import uvicorn

        from trainer.api import create_app

        host = settings.bind_host
        console.print(f"trainer API on http://{host}:{port}/api/status (POST /api/run to train now)")
        # uvicorn handles SIGINT / SIGTERM and returns when asked to stop.
        uvicorn.run(create_app(settings, scheduler), host=host, port=port, log_level="warning", log_config=None,
                    timeout_keep_alive=settings.http_keep_alive_s)
    else:
        from flywheel.ops import serve_ops, stop_on_signals

        metrics = None
        if settings.trainer_metrics_port:  # no API, but its /metrics and health still
            metrics = serve_ops(settings.trainer_metrics_port, scheduler.health, settings.bind_host)
        stop_on_signals().wait()
        if metrics is not None:
            metrics.stop()
    scheduler.shutdown(wait=True)
    console.print("trainer scheduler stopped")
