"""The Kafka interface's batch helpers, and the client set-up that its throughput depends on."""

from __future__ import annotations

from flywheel.bus import RecordBatch


def test_offset_range_per_partition_whatever_the_order():
    batch = RecordBatch(
        topics=["a", "a", "b", "a", "b"], partitions=[0, 1, 0, 0, 0], offsets=[7, 3, 10, 5, 11], values=[b""] * 5
    )
    assert batch.offset_range() == {("a", 0): (5, 8), ("a", 1): (3, 4), ("b", 0): (10, 12)}
    assert batch.first_offsets() == {("a", 0): 5, ("a", 1): 3, ("b", 0): 10}
    assert batch.next_offsets() == {("a", 0): 8, ("a", 1): 4, ("b", 0): 12}
    assert RecordBatch([], [], [], []).offset_range() == {}


def test_kafka_python_checks_batch_crcs_in_c():
    """Without the `crc32c` package kafka-python computes every fetched batch's CRC in pure Python,
    five times slower to consume (README, benchmarks)."""
    import crc32c
    from kafka.record import util

    assert util._crc32c is crc32c.crc32c  # kafka-python picks the C implementation when it imports
