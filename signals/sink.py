"""Where reward records go: the rewards topic and the lake's rewards table (`flywheel.lake.tables.REWARDS`).

`write_rewards` writes records in one commit named by the batch, so a batch written twice (a crash
between the lake write and the outbox pop) is committed once (`flywheel.lake.tables.Table.write`;
`write_lines` writes several such named batches in one commit, `Table.write_parts`);
`read_rewards` reads them back.

The streaming worker moves its records as `RecordLine`s, the JSON `RewardRecord.model_dump_json` writes
(tests/test_signals_stream.py holds the two to the same text and fields), encoded and decoded by msgspec: a
pydantic model per record, built, written, read back and dumped again, cost more than scoring the window.
`produce_lines` and `write_lines` are `produce_rewards` and `write_rewards` for them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

import msgspec
import polars as pl

from flywheel.bus import Outgoing, Producer
from flywheel.contract import RewardRecord
from flywheel.lake.tables import REWARDS, rewards_frame
from flywheel.settings import Settings
from signals.events import to_us


def write_rewards(table: str, records: Sequence[RewardRecord], name: str) -> int | None:
    """Append records to the rewards table at `table` in one commit named `name`: the same batch twice is
    written once. Returns the table version made (None: already written)."""
    return REWARDS.write(table, rewards_frame(records), name)


def produce_rewards(producer: Producer, settings: Settings, records: Sequence[RewardRecord]) -> None:
    producer.send_all(
        [
            Outgoing(
                settings.rewards_topic,
                r.to_bytes(),
                r.generation_id.encode(),
                (("record_id", f"{r.reward_version}:{r.generation_id}:{r.revision}".encode()),),
            )
            for r in records
        ]
    )


def read_rewards(table: str, *, latest_only: bool = False) -> pl.DataFrame:
    """The rewards table at `table`; `latest_only` keeps the current revision per generation and version."""
    df = REWARDS.read(table)
    return REWARDS.latest(df) if latest_only else df


class RecordLine(msgspec.Struct, kw_only=True, gc=False):
    """A `RewardRecord` as the stream carries it: the same fields, in its order, the same JSON."""

    generation_id: str
    reward_version: str
    revision: int
    reward: float
    confidence: float
    label_source: str
    signals: dict[str, float]
    user_id: str
    model_version: str
    arm: str
    experiment: str
    window_start: datetime
    window_end: datetime
    late_events: int
    emitted_at: datetime

    def record_id(self) -> str:
        return f"{self.reward_version}:{self.generation_id}:{self.revision}"


encode_line = msgspec.json.Encoder().encode
# `json.dumps(signals, sort_keys=True)`'s text (`rewards_frame`'s): one encoder, where `json.dumps` with any option
# builds a new one each call (most of its cost on a dict of a few floats)
_signals_json = json.JSONEncoder(sort_keys=True).encode
decode_lines = msgspec.json.Decoder(list[RecordLine]).decode


def produce_lines(producer: Producer, settings: Settings, raw: Sequence[bytes], lines: Sequence[RecordLine]) -> None:
    """`produce_rewards` for records already encoded (`raw[i]` is `lines[i]`'s JSON)."""
    producer.send_all(
        [
            Outgoing(
                settings.rewards_topic, value, line.generation_id.encode(), (("record_id", line.record_id().encode()),)
            )
            for value, line in zip(raw, lines, strict=True)
        ]
    )


def write_lines(table: str, entries: Sequence[tuple[str, Sequence[RecordLine]]]) -> int | None:
    """`write_rewards` for `RecordLine`s, several named batches (the outbox entries of a flush) in one commit, each
    once per name (`Table.write_parts`): the frame built column-wise, `signals` as `rewards_frame` writes it."""
    lines = [line for _, batch in entries for line in batch]
    if not lines:
        return None
    # times as integer microseconds, cast: polars converts zoned datetimes one by one, several times slower
    times = {column for column, dtype in REWARDS.schema.items() if isinstance(dtype, pl.Datetime)}
    columns: dict[str, list[object] | pl.Series] = {
        column: [getattr(line, column) for line in lines]
        for column in REWARDS.schema
        if column not in times | {"signals"}
    }
    columns["signals"] = [_signals_json(line.signals) for line in lines]
    for column in times:
        us = [to_us(getattr(line, column)) for line in lines]
        columns[column] = pl.Series(column, us, pl.Int64).cast(REWARDS.schema[column])
    frame = pl.DataFrame(columns, schema=REWARDS.schema)
    parts, start = [], 0
    for name, batch in entries:
        parts.append((name, frame.slice(start, len(batch))))
        start += len(batch)
    return REWARDS.write_parts(table, parts)
