"""The ingest worker process: the events topic -> validated, de-duplicated rows in the lake, exactly once.

`loop` is the batch loop, `dedup` the partition ledger that makes it exactly once, `lake_sink` the rows it writes.
It shares only the dead-letter format and the metrics with the collector (`ingest.dead_letters`, `ingest.metrics`),
never the collector's code. Run it with `python -m ingest.worker` or `flywheel ingest worker`.
"""
