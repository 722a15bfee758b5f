"""The reward definitions live with the lake's tables, on a disk or on S3-compatible storage: a process that
shares only the lake (no volume, no Redis state) finds every stored definition and the active pointer.

S3 is moto's server mode, started by `tests.test_lake_concurrency`'s fixtures on a loopback port (no S3
is reachable here).
"""

from __future__ import annotations

import dataclasses
import uuid

import polars as pl

from flywheel.connections import redis_client
from flywheel.lake import files
from flywheel.lake.tables import REWARD_DEFINITIONS_PATH, REWARDS
from flywheel.reward_versions import read_active, versions_to_read, write_active
from flywheel.settings import Settings
from signals.definitions import DefinitionStore
from signals.reward import DEFAULT_DEFINITION, RuleWeights
from tests.test_lake_concurrency import moto_endpoint, s3_lake  # noqa: F401  (the S3 server's fixtures)


def test_definitions_and_the_active_pointer_live_on_the_lakes_object_storage(settings: Settings, s3_lake: str) -> None:  # noqa: F811
    s3 = settings.model_copy(update={"lake_uri": s3_lake})
    assert read_active(s3_lake) is None and files.names(s3_lake, REWARD_DEFINITIONS_PATH) == []
    mine = dataclasses.replace(DEFAULT_DEFINITION, version="rules-v2", weights=RuleWeights(accept=0.9))
    store = DefinitionStore(s3, redis_client(s3))
    store.ensure_pointer()
    store.put(mine)
    assert store.set_active("rules-v2") == "code-completion"

    # Another process, with nothing but the lake in common: Redis under another prefix, another data folder.
    elsewhere = s3.model_copy(update={"redis_prefix": f"test:{uuid.uuid4().hex[:8]}:", "data_dir": s3.data_dir / "x"})
    other = DefinitionStore(elsewhere, redis_client(elsewhere))
    assert other.get("rules-v2") == mine
    assert "rules-v2" in other.versions()
    assert other.active("code-completion") == mine
    assert read_active(s3_lake) == {"chat": "chat-rules-v1", "code-completion": "rules-v2"}
    empty = pl.LazyFrame(schema=REWARDS.schema)
    assert versions_to_read(s3_lake, empty) == ["chat-rules-v1", "rules-v2"]
    assert files.names(s3_lake, REWARD_DEFINITIONS_PATH, suffix=".json") == ["active.json", "rules-v2.json"]
    assert not settings.lake_dir.exists(), "nothing of the lake's may land on the local disk"


def test_on_a_disk_the_pointer_is_replaced_whole_and_no_staging_file_stays(settings: Settings) -> None:
    write_active(settings.lake_dir, {"code-completion": "rules-v1"})
    write_active(settings.lake_root, {"code-completion": "rules-v1", "docs": "docs-rules-v1"})
    assert read_active(settings.lake_dir) == {"code-completion": "rules-v1", "docs": "docs-rules-v1"}
    folder = settings.lake_dir / REWARD_DEFINITIONS_PATH
    assert sorted(p.name for p in folder.iterdir()) == ["active.json"]
    assert files.read_bytes(settings.lake_root, REWARD_DEFINITIONS_PATH, "missing.json") is None
