"""History replayed through the collector: reward rows per generation, with and without the historical lane.

Builds months-old product telemetry (`simulator.telemetry.product_telemetry`: code-completion and
chat users, retention checks to 15 minutes) as the collector would stamp it (received now, in time
order, partitioned by generation id), writes it to a lake, and replays the worker's rules over it
with `recompute_records` twice: (a) as before the historical lane (every window closes by the
arrival clock, so on arrival: `backfill_after_s` beyond any delay) and (b) as now. Prints rows per
generation for both (the ratio is what to compare), and each run's time.

    python bench/signals_history_replay.py [--users 200]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import zlib
from datetime import timedelta
from pathlib import Path

from flywheel.contract import utcnow
from flywheel.settings import Settings
from signals.config import SignalsConfig
from signals.recompute import recompute_records
from signals.reward import builtin_definition
from simulator.telemetry import product_telemetry, write_events


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=200, help="code-completion users; half as many chat users")
    ap.add_argument("--partitions", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp))
        now = utcnow()
        tel = product_telemetry(start=now - timedelta(days=90), seed=0, code_users=args.users,
                                chat_users=args.users // 2, per_user=8, spacing_s=5.0)  # fmt: skip
        offsets = [0] * args.partitions
        events, positions, seen = [], [], set()
        for i, e in enumerate(tel.events):  # the collector stamps received_at as the replay goes
            p = zlib.crc32(e.generation_id.encode()) % args.partitions
            if e.event_id not in seen:
                seen.add(e.event_id)
                events.append(e.model_copy(update={"received_at": now + timedelta(microseconds=i)}))
                positions.append((settings.events_topic, p, offsets[p]))
            offsets[p] += 1
        write_events(settings, events, at=positions)
        rows = {}
        for name, config in (("arrival clock (before)", SignalsConfig(backfill_after_s=1e12)),
                             ("historical lane (now)", SignalsConfig())):  # fmt: skip
            t0 = time.perf_counter()
            records = [r for s in ("code-completion", "chat")
                       for r in recompute_records(settings, builtin_definition(s), config=config, now=now)]  # fmt: skip
            seconds = time.perf_counter() - t0
            gens = len({r.generation_id for r in records})
            rows[name] = len(records) / gens
            print(f"{name}: {len(records)} records for {gens} generations = {rows[name]:.2f} rows/generation "
                  f"({len(events)} events, {seconds:.1f} s)")  # fmt: skip
        before, after = rows.values()
        print(f"rows per generation, now over before: {after:.2f} / {before:.2f} = {after / before:.3f}")


if __name__ == "__main__":
    main()
