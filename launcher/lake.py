"""`flywheel lake ...`: the lake's Delta tables: history, compaction, vacuum, migration from the former format.

On a schedule (k8s/base/apps/lake-compaction.yaml): `compact` hourly, with the vacuum within the retention,
and `vacuum --full` daily on its own, since a one-off `compact` never reaches its `--full-every` pass.

Here, above the registry, because the vacuum keeps every table version a registered model version
trained on (its lineage's `data_window.lake_versions`): a model can always be traced to, and retrained
on, the exact rows it learnt from. Without the registry's answer no vacuum runs, and the command exits
75 (EX_TEMPFAIL), so a scheduler sees the failure and runs it again later. `compact` also sets each
table's log retention (`FLYWHEEL_LAKE_LOG_RETENTION_DAYS`): a version whose log is gone cannot be read.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Annotated

import typer
from deltalake.exceptions import CommitFailedError

from flywheel.lake.maintenance import (
    DEFAULT_RETENTION_HOURS,
    MIN_RETENTION_HOURS,
    MigrationError,
    compact,
    history,
    migrate,
    set_log_retention,
    vacuum,
)
from flywheel.lake.tables import TABLES, Table
from flywheel.settings import Settings

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL: the registry did not answer, nothing was vacuumed; try again later.
EXIT_REGISTRY_UNAVAILABLE = 75

app = typer.Typer(help=f"The lake's Delta tables ({', '.join(TABLES)}).", no_args_is_help=True)

TableOption = Annotated[list[str] | None, typer.Option("--table", help="Table (repeatable; default: all).")]


def _tables(names: list[str] | None) -> list[Table]:
    unknown = sorted(set(names or []) - set(TABLES))
    if unknown:
        raise typer.BadParameter(f"no table {unknown}; tables: {', '.join(TABLES)}")
    return [TABLES[n] for n in (names or list(TABLES))]


def pinned_versions(settings: Settings) -> dict[str, list[int]]:
    """{table: versions} that registered model versions trained on (their lineage names them)."""
    from model_registry import ModelRegistry

    registry = ModelRegistry(settings)
    pinned: dict[str, set[int]] = {}
    for info in registry.versions():
        window = registry.lineage(info.version).data_window
        for table, version in (window.lake_versions if window else {}).items():
            pinned.setdefault(table, set()).add(version)
    return {table: sorted(versions) for table, versions in pinned.items()}


def _vacuum_all(
    settings: Settings, tables: list[Table], retention_hours: float, full: bool, dry_run: bool = False
) -> bool:
    """Vacuum `tables`; False (nothing vacuumed) when the registry did not say which versions to keep."""
    try:
        pinned = pinned_versions(settings)
    except Exception as exc:  # noqa: BLE001 - without the registry's versions a vacuum could delete what a model needs
        typer.echo(f"vacuum skipped: the registry did not say which versions models trained on ({exc})", err=True)
        return False
    for table in tables:
        keep = pinned.get(table.name, [])
        try:
            gone = vacuum(table, table.at(settings.lake_root), retention_hours=retention_hours,
                          keep_versions=keep, full=full, dry_run=dry_run)  # fmt: skip
        except MigrationError as exc:
            typer.echo(f"{table.name}: vacuum skipped: {exc}", err=True)
            continue
        verb = "would delete" if dry_run else "deleted"
        typer.echo(f"{table.name}: {verb} {len(gone)} file(s){' (full)' if full else ''}; kept versions {keep}")
    return True


@app.command("history")
def history_command(
    table: str = typer.Argument(..., help=f"One of {', '.join(TABLES)}."),
    limit: int = typer.Option(20, min=1, help="The newest N commits."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
) -> None:
    """The table's commits, newest first: version, time, operation, metrics."""
    (found,) = _tables([table])
    for entry in history(found, found.at(Settings().lake_root), limit):
        if as_json:
            typer.echo(json.dumps(entry))
        else:
            metrics = entry["metrics"] if isinstance(entry["metrics"], dict) else {}
            rows = metrics.get("num_added_rows", "")
            typer.echo(f"{entry['version']:>6}  {entry['at']}  {entry['operation']:<12} {rows}")


@app.command("compact")
def compact_command(
    table: TableOption = None,
    every: float = typer.Option(0.0, min=0, help="Seconds between runs; 0 runs once."),
    vacuum_after: bool = typer.Option(True, "--vacuum/--no-vacuum", help="Vacuum after each compaction."),
    retention_hours: float = typer.Option(DEFAULT_RETENTION_HOURS, min=MIN_RETENTION_HOURS, help="Vacuum retention."),
    full_every: int = typer.Option(
        24, min=1, help="With --every: every Nth pass's vacuum is full (orphaned files of lost commits). A one-off run "
        "(a CronJob's) is never the Nth: schedule `flywheel lake vacuum --full` on its own (k8s/base/apps).",
    ),
) -> None:
    """Merge each partition's small files (optimize), then vacuum; readers never see a row twice."""
    tables = _tables(table)
    settings = Settings()
    runs = 0
    while True:
        for t in tables:
            try:
                if set_log_retention(t, t.at(settings.lake_root), settings.lake_log_retention_days):
                    typer.echo(f"{t.name}: commit log kept {settings.lake_log_retention_days} days")
            except CommitFailedError as exc:  # a concurrent commit won: set on the next run
                typer.echo(f"{t.name}: log retention not set this run ({exc})", err=True)
            done = compact(t, t.at(settings.lake_root))
            typer.echo(f"{t.name}: {done.files_before} -> {done.files_after} file(s) in {done.seconds:.2f}s"
                       + (f" (version {done.version})" if done.version is not None else ""))  # fmt: skip
        full = runs % full_every == full_every - 1
        vacuumed = not vacuum_after or _vacuum_all(settings, tables, retention_hours, full=full)
        runs += 1
        if not every:
            if not vacuumed:
                raise typer.Exit(EXIT_REGISTRY_UNAVAILABLE)
            return
        time.sleep(every)


@app.command("vacuum")
def vacuum_command(
    table: TableOption = None,
    retention_hours: float = typer.Option(DEFAULT_RETENTION_HOURS, min=MIN_RETENTION_HOURS, help="Keep this long."),
    full: bool = typer.Option(False, help="Also delete files no version ever named (lost or killed commits)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would go."),
) -> None:
    """Delete files no version within the retention, nor any registered model's data version, needs.

    Exits 75 (EX_TEMPFAIL) without deleting anything when the registry does not answer."""
    if not _vacuum_all(Settings(), _tables(table), retention_hours, full, dry_run):
        raise typer.Exit(EXIT_REGISTRY_UNAVAILABLE)


@app.command("migrate")
def migrate_command(
    table: TableOption = None,
    source: str = typer.Option("", help="The former lake's folder; default settings.lake_dir."),
) -> None:
    """Turn a lake of the former Parquet format into Delta tables at the lake URI, with counts checked."""
    from pathlib import Path

    settings = Settings()
    root = Path(source) if source else settings.lake_dir
    failed = False
    for t in _tables(table):
        try:
            done = migrate(t, root / t.path, t.at(settings.lake_root))
        except MigrationError as exc:
            typer.echo(f"{t.name}: {exc}; the former files are kept", err=True)
            failed = True
            continue
        typer.echo(f"{t.name}: {done.rows_found} row(s) found, {done.rows_written} written, {done.rows_in_table} "
                   f"in the table; {done.files_removed} former file(s) removed")  # fmt: skip
    if failed:
        raise typer.Exit(1)
