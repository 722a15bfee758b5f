"""`flywheel lake ...`: maintenance of the Parquet lake."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from flywheel.lake import STALE_TEMP_S
from flywheel.lake.compaction import compact_table
from flywheel.lake.tables import TABLES
from flywheel.settings import get_settings

app = typer.Typer(help=f"The Parquet lake ({', '.join(TABLES)}).", no_args_is_help=True)


@app.command()
def compact(
    table: Annotated[list[str] | None, typer.Option(help="Table to compact (repeatable; default: all).")] = None,
    settle_hours: float = typer.Option(2.0, min=0, help="Only hours that ended at least this long ago."),
    grace_minutes: float = typer.Option(
        STALE_TEMP_S / 60, min=0, help="Replaced files are deleted this long after their compaction (by a later run)."
    ),
    every: float = typer.Option(0.0, min=0, help="Seconds between runs; 0 runs once."),
) -> None:
    """Merge the small files of each closed hour into one (readers never see a row twice)."""
    tables = table or list(TABLES)
    unknown = sorted(set(tables) - set(TABLES))
    if unknown:
        raise typer.BadParameter(f"no table {unknown}; tables: {', '.join(TABLES)}")
    settings = get_settings()
    console = Console(stderr=True)
    while True:
        for name in tables:
            with console.status(f"compacting {name}") as status:

                def show(directory: Path, name: str = name) -> None:
                    status.update(f"compacting {name}: {directory.parent.name}/{directory.name}")

                settle_s, grace_s = settle_hours * 3600, grace_minutes * 60
                location = TABLES[name].at(settings.lake_dir)
                result = compact_table(location, settle_s=settle_s, grace_s=grace_s, on_directory=show)
            typer.echo(
                f"{name}: merged {result.files_merged} file(s) into {result.directories} "
                f"({result.rows} rows); deleted {result.files_deleted} replaced file(s)"
                + (f"; {len(result.skipped_locked)} hour(s) locked by another run" if result.skipped_locked else "")
            )
        if not every:
            return
        time.sleep(every)
