"""Where reward records go: the rewards topic and the lake's rewards table (`flywheel.lake.tables.REWARDS`).

`write_rewards` writes records in one commit named by the batch, so a batch written twice (a crash
between the lake write and the outbox pop) is committed once (`flywheel.lake.tables.Table.write`);
`read_rewards` reads them back.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from flywheel.bus import Outgoing, Producer
from flywheel.contract import RewardRecord
from flywheel.lake.tables import REWARDS, rewards_frame
from flywheel.settings import Settings


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
