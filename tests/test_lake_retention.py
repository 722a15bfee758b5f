"""A table version stays readable as long as the lake keeps its commit log, and the vacuum fails loudly.

delta-rs deletes log files older than `delta.logRetentionDuration` at each checkpoint; a version whose
log is gone cannot be opened, though the vacuum kept its data files. Here the log is aged with
`os.utime` and the cleanup forced (`create_checkpoint`, `cleanup_metadata`), as an automatic checkpoint
a year on would do. Real Delta tables in a temporary folder; the CLI through Typer's runner.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable
from pydantic import ValidationError
from typer.testing import CliRunner

from flywheel.lake.tables import EVENTS, LOG_RETENTION, VersionGone, log_retention
from flywheel.settings import Settings
from ingest.worker.dedup import PartitionLedger
from launcher.cli import app as flywheel_cli
from launcher.embedded import settings_env
from launcher.lake import EXIT_REGISTRY_UNAVAILABLE
from tests.test_lake import KEY, events, offsets_in

SIXTY_DAYS = 60 * 86400


def _five_commits(location: str, log_retention_days: int) -> None:
    """Versions 1..5, each committing offsets [2(v-1), 2v)."""
    ledger = PartitionLedger(EVENTS, location, "ingest", log_retention_days=log_retention_days)
    ledger.reload([KEY])
    for v in range(5):
        ledger.commit(events(range(2 * v, 2 * v + 2)), {KEY: 2 * v + 1})


def _age_the_log_and_clean_it(location: str) -> list[str]:
    """Every log file 60 days old, then a checkpoint and its log cleanup; returns the log's files left."""
    log = Path(location) / "_delta_log"
    old = time.time() - SIXTY_DAYS
    for f in log.iterdir():
        os.utime(f, (old, old))
    table = DeltaTable(location)
    table.create_checkpoint()
    table.cleanup_metadata()
    return sorted(f.name for f in log.iterdir())


@pytest.mark.parametrize("days", [365, 30])
def test_a_version_older_than_the_log_retention_cannot_be_opened_and_a_longer_one_keeps_it(
    tmp_path: Path, days: int
) -> None:
    location = EVENTS.at(tmp_path)
    _five_commits(location, days)
    assert DeltaTable(location).metadata().configuration[LOG_RETENTION] == f"interval {days} days"
    assert offsets_in(location, 2) == [0, 1, 2, 3]

    left = _age_the_log_and_clean_it(location)

    assert offsets_in(location) == list(range(10))  # the newest version reads from the checkpoint either way
    if days == 365:
        assert "00000000000000000002.json" in left
        assert offsets_in(location, 2) == [0, 1, 2, 3]  # the very rows version 2 held
    else:  # Delta's default: 60-day-old log files are gone, and with them version 2
        assert "00000000000000000002.json" not in left
        with pytest.raises(VersionGone, match="version 2 .* cannot be opened .*30 days"):
            EVENTS.read(location, 2)  # never an empty table: a re-run would train on nothing


def test_lake_compact_sets_the_log_retention_on_a_table_created_before(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", lake_log_retention_days=400)
    location = EVENTS.at(settings.lake_root)
    _five_commits(location, 30)
    env = settings_env(settings)
    runner = CliRunner()

    done = runner.invoke(flywheel_cli, ["lake", "compact", "--table", "events", "--no-vacuum"], env=env)
    assert done.exit_code == 0, done.output
    assert "events: commit log kept 400 days" in done.output
    assert DeltaTable(location).metadata().configuration[LOG_RETENTION] == "interval 400 days"
    again = runner.invoke(flywheel_cli, ["lake", "compact", "--table", "events", "--no-vacuum"], env=env)
    assert again.exit_code == 0 and "commit log kept" not in again.output, again.output  # set once

    _age_the_log_and_clean_it(location)
    assert offsets_in(location, 2) == [0, 1, 2, 3]


def test_the_log_retention_setting_is_at_least_deltas_default() -> None:
    assert Settings().lake_log_retention_days == 365
    assert Settings(lake_log_retention_days=30).lake_log_retention_days == 30
    with pytest.raises(ValidationError, match="lake_log_retention_days"):
        Settings(lake_log_retention_days=29)
    with pytest.raises(ValueError, match="shorter than Delta's 30-day default"):
        log_retention(7)


@pytest.mark.parametrize("command", [["vacuum"], ["compact"]])
def test_a_vacuum_without_the_registry_exits_tempfail(tmp_path: Path, command: list[str]) -> None:
    """A cron job must learn that nothing was vacuumed: exit 75 (EX_TEMPFAIL), and the reason on stderr."""
    settings = Settings(data_dir=tmp_path / "data", mlflow_tracking_uri="http://127.0.0.1:9")  # nothing answers
    location = EVENTS.at(settings.lake_root)
    _five_commits(location, 365)
    env = {**settings_env(settings), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}

    done = CliRunner().invoke(flywheel_cli, ["lake", *command, "--table", "events"], env=env)

    assert done.exit_code == EXIT_REGISTRY_UNAVAILABLE == 75, done.output
    assert "vacuum skipped: the registry did not say which versions models trained on" in done.output
    assert offsets_in(location) == list(range(10))
