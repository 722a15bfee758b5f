"""The lake's tables are one contract: every writer writes the same rows, every reader reads them alike.

One event history (late and duplicated events included) goes on the embedded broker once. Ingest's
worker writes it to one lake; the simulator's `lake_events_from_topic` to another. Signals' batch
recompute turns each lake's events into reward records, written by signals' sink to the first lake
(two files, as two batches would be) and by the trainer simulator to the second. Then every reader
(signals recompute, the trainer's selection, the gate's metrics) must see the same thing in both
lakes, every file must have the table's declared schema, and compaction must change nothing a
reader sees.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from deploy_gate.metrics import arm_metrics
from flywheel.bus import ensure_topics
from flywheel.contract import RewardRecord, utcnow
from flywheel.lake.maintenance import compact
from flywheel.lake.tables import EVENTS, PARTITION_COLUMNS, REWARDS, TABLES, LakeSchemaError, Table, rewards_frame
from flywheel.settings import Settings
from ingest.worker.loop import IngestWorker
from signals.config import SignalsConfig
from signals.recompute import recompute_records
from signals.reward import DEFAULT_DEFINITION
from signals.sink import read_rewards, write_rewards
from simulator.lake_feedback import consent_events
from simulator.lake_feedback import write_rewards as simulate_rewards
from simulator.telemetry import history, lake_events_from_topic, send
from trainer.config import TrainerConfig
from trainer.data import Selection, load_selection

NOW = utcnow()
LATER = NOW + timedelta(days=1)  # every window closed, every hour settled
START = NOW.replace(minute=0, second=0, microsecond=0) - timedelta(days=2)


def files_have_the_declared_schema(table: Table, location: str) -> int:
    """The Delta table's schema is the declared one plus the partition columns; so is every data file's (less the
    partition columns, which Delta keeps in the log). Returns how many data files the newest version has."""
    assert pl.scan_delta(location).collect_schema() == pl.Schema({**table.schema, **PARTITION_COLUMNS})
    files = table.files(location)
    for f in files:
        assert pl.read_parquet_schema(f) == dict(table.schema), f
    return len(files)


def same_selection(a: Selection, b: Selection) -> bool:
    """The same samples and window; the table versions read may differ (each lake has its own history)."""
    assert a.window is not None and b.window is not None
    return a.samples == b.samples and a.window.model_copy(update={"lake_versions": {}}) == b.window.model_copy(
        update={"lake_versions": {}}
    )


def table_rows(table: Table, location: str) -> pl.DataFrame:
    return table.read(location).sort(list(table.key))


def selection_of(settings: Settings) -> Selection:
    config = TrainerConfig(reward_version=DEFAULT_DEFINITION.version)
    return load_selection(settings, config, watermark=None, quarantined=set(), encode_prompt=lambda _: [1])


def _rounded(value: object) -> object:
    """Sums in another row order differ in the last bits (two lakes list their files in their own order)."""
    if isinstance(value, float):
        return round(value, 12)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def arms_of(settings: Settings) -> list[dict[str, object]]:
    return [_rounded(a.model_dump()) for a in arm_metrics(settings, reward_version=DEFAULT_DEFINITION.version).arms]


def test_every_writer_and_reader_of_the_lake_agree(settings: Settings, tmp_path: Path) -> None:
    ensure_topics(settings)
    hist = history(30, start=START, seed=3, spacing_s=0.5, signing_key=settings.serving_key.get_secret_value())
    consent = consent_events(sorted({e.user_id for e in hist.events}))
    send(settings, [*hist.events, *consent])
    distinct = len({e.event_id for e in [*hist.events, *consent]})

    # Writers of the events table: ingest's worker, and the simulator playing ingest.
    # Small batches: several files an hour, as a busy worker writes, for compaction to merge below.
    worker = IngestWorker(settings, group_id=f"lake-tables-{settings.events_topic}", batch_size=16, poll_timeout_s=0.3)
    deadline = time.monotonic() + 60
    while EVENTS.read(EVENTS.at(settings.lake_root)).height < distinct and time.monotonic() < deadline:
        worker.run_once()
    worker.close()
    sim = settings.model_copy(update={"data_dir": tmp_path / "simulated"})
    lake_events_from_topic(sim)

    ingested, simulated = EVENTS.at(settings.lake_root), EVENTS.at(sim.lake_root)
    events = table_rows(EVENTS, ingested)
    assert events.height == distinct and len(hist.events) > distinct - len(consent), "no duplicate was sent"
    assert_frame_equal(events, table_rows(EVENTS, simulated))
    assert files_have_the_declared_schema(EVENTS, ingested) and files_have_the_declared_schema(EVENTS, simulated)

    # Signals' recompute reads either lake alike; its records go through both rewards writers.
    records = recompute_records(settings, DEFAULT_DEFINITION, config=SignalsConfig(), now=LATER)
    assert records == recompute_records(sim, DEFAULT_DEFINITION, config=SignalsConfig(), now=LATER)
    assert any(r.revision > 0 for r in records), "the history must make late revisions"
    half = len(records) // 2
    write_rewards(REWARDS.at(settings.lake_root), records[:half], "signals-a")
    write_rewards(REWARDS.at(settings.lake_root), records[half:], "signals-b")
    simulate_rewards(sim, records)
    rewards = table_rows(REWARDS, REWARDS.at(settings.lake_root))
    assert_frame_equal(rewards, table_rows(REWARDS, REWARDS.at(sim.lake_root)))
    assert_frame_equal(rewards, rewards_frame(records).sort(list(REWARDS.key)))
    assert files_have_the_declared_schema(REWARDS, REWARDS.at(settings.lake_root)) == 2

    # The current reward of each generation: the highest revision.
    current = {r.generation_id: r for r in sorted(records, key=lambda r: r.revision)}
    latest = read_rewards(REWARDS.at(settings.lake_root), latest_only=True)
    assert dict(zip(latest["generation_id"], latest["revision"], strict=True)) == {
        g: r.revision for g, r in current.items()
    }

    # The gate's metrics: n and mean per arm and version over the current rewards, alike in both lakes.
    arms = arms_of(settings)
    expected: dict[tuple[str, str], list[float]] = {}
    for r in current.values():
        expected.setdefault((r.arm, r.model_version), []).append(r.reward)
    assert {(a["arm"], a["model_version"]): (a["n"], pytest.approx(a["mean"])) for a in arms} == {
        k: (len(v), sum(v) / len(v)) for k, v in expected.items()
    }
    assert arms == arms_of(sim)

    # The trainer's selection: the current reward of every generation it keeps, alike in both lakes.
    selection = selection_of(settings)
    assert selection.samples, selection.describe_drops()
    assert {s.generation_id: s.reward for s in selection.samples} == {
        g: r.reward for g, r in current.items() if g in {s.generation_id for s in selection.samples}
    }
    assert same_selection(selection, selection_of(sim))

    # Compaction merges the small files of every partition; no reader sees anything change.
    merged = {name: compact(t, t.at(settings.lake_root)) for name, t in TABLES.items()}
    assert merged["rewards"].files_before == 2 and merged["rewards"].files_after == 1
    assert merged["events"].files_after < merged["events"].files_before
    assert_frame_equal(table_rows(EVENTS, ingested), events)
    assert_frame_equal(table_rows(REWARDS, REWARDS.at(settings.lake_root)), rewards)
    assert files_have_the_declared_schema(REWARDS, REWARDS.at(settings.lake_root)) == 1
    assert recompute_records(settings, DEFAULT_DEFINITION, config=SignalsConfig(), now=LATER) == records
    assert arms_of(settings) == arms
    assert same_selection(selection_of(settings), selection)


def test_a_frame_that_breaks_the_schema_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    record = RewardRecord(
        generation_id="g", reward_version="v", reward=1.0, confidence=1.0, label_source="explicit",
        window_start=NOW, window_end=NOW,
    )  # fmt: skip
    frame = rewards_frame([record])
    with pytest.raises(LakeSchemaError, match=r"lacks \['arm'\]"):
        REWARDS.write(str(tmp_path), frame.drop("arm"), "x")
    with pytest.raises(LakeSchemaError, match=r"does not: \['extra'\]"):
        REWARDS.write(str(tmp_path), frame.with_columns(pl.lit(1).alias("extra")), "x")
    assert REWARDS.version(str(tmp_path)) is None
    # Types are the table's whatever the frame had: an Int32 revision is written as the declared Int64.
    REWARDS.write(str(tmp_path), frame.with_columns(pl.col("revision").cast(pl.Int32)), "x")
    assert files_have_the_declared_schema(REWARDS, str(tmp_path)) == 1
