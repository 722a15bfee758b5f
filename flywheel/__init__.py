"""Flywheel's shared core: what every component agrees on and builds upon.

- `flywheel.contract`: the event envelope, generation, reward, model-version and traffic-split records;
- `flywheel.settings`: one `Settings` per process, read from the environment;
- `flywheel.bus`: the Kafka interface, one module per client;
- `flywheel.lake`: the lake's Delta tables (on a disk or S3), their maintenance and migration;
- `flywheel.lm`: the policy model (bootstrap, generation, scoring);
- `flywheel.connections`, `flywheel.traffic`: Redis and the traffic split.

Nothing here imports a component (`ingest`, `signals`, ...) or the launcher above them.
"""

__version__ = "0.1.0"
