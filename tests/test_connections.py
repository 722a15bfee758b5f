"""`flywheel.connections.delete_prefix` against the real Redis (or the embedded Valkey): only its prefix goes."""

from __future__ import annotations

import uuid

import redis

from flywheel.connections import delete_prefix


def test_delete_prefix_removes_every_key_under_it_and_nothing_else(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    tag = uuid.uuid4().hex[:8]
    mine, other = f"test:{tag}:", f"test:{tag}-other:"
    client.mset({f"{mine}{i}": i for i in range(10_005)})  # more than one UNLINK chunk
    client.set(f"{other}kept", 1)
    assert delete_prefix(client, mine) == 10_005
    assert not list(client.scan_iter(match=f"{mine}*", count=10_000))
    assert client.get(f"{other}kept") == b"1"
    assert delete_prefix(client, other) == 1
