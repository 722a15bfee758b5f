"""`flywheel registry`: list model versions and show one with its lineage and gate history."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from flywheel.settings import get_settings
from model_registry.registry import ModelRegistry, UnknownVersion

app = typer.Typer(no_args_is_help=True)
console = Console()


@app.command("list")
def list_versions(limit: int = typer.Option(20, help="How many versions, newest first.")) -> None:
    """Model versions, newest first: gate state, aliases, parent, samples."""
    registry = ModelRegistry(get_settings())
    table = Table("version", "created", "gate state", "aliases", "parent", "samples", "mean reward")
    for info in registry.versions()[:limit]:
        reward = info.lineage.metrics.get("mean_reward")
        table.add_row(
            info.version,
            info.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            info.gate_state,
            ", ".join(info.aliases),
            info.lineage.parent_version or "-",
            str(info.lineage.sample_count),
            "-" if reward is None else f"{reward:.3f}",
        )
    console.print(table)


@app.command("show")
def show(version: str = typer.Argument(..., help="The version number.")) -> None:
    """One version: lineage (parent, data window, config, metrics) and its gate-state history."""
    registry = ModelRegistry(get_settings())
    try:
        lineage = registry.lineage(version)
        history = registry.gate_history(version)
    except UnknownVersion as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    console.print(f"[bold]version {version}[/]  gate state: [bold]{registry.gate_state(version)}[/]")
    console.print_json(json.dumps(lineage.model_dump(mode="json")))
    table = Table("when", "state", "from", "by", "why")
    for change in history:
        table.add_row(
            change.at.strftime("%Y-%m-%d %H:%M:%S"),
            change.state,
            change.previous or "-",
            change.by,
            change.reason,
        )
    console.print(table)
