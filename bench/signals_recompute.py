"""Batch recompute throughput: feedback rows/s, as a ratio over a bare polars group-by of the same rows.

Builds a synthetic events frame in the lake's schema (built column-wise with numpy, so 10M rows take
seconds): each generation has a `generation` event and 0-8 feedback events drawn from the product's mix
(shown, accepted with partial chars, rejected, retained checks, edited, undone, copied, follow-ups with
text, thumbs with comments), a share arriving late, a share duplicated, over several Kafka partitions.
Then times, on the same in-memory frame:
(a) bare: `group_by(generation_id)` with a count and a max, the least any per-generation reward reads;
(b) recompute: `signals.recompute.recompute_scores` with the built-in rules (dedup, watermark replay,
    revisions, every signal and the reward, column-wise: `signals.columns`), to its scored frame.
Each is run once untimed first (`--warmup`: a polars plan's first run in a process takes up to twice its next
ones, the bare group-by's most), then timed `--repeat` times, its best kept: the ratio compares warm runs.
Prints both rates, their ratio, each phase's first (cold) time, and the process's peak memory (max RSS) after
each phase.

    python bench/signals_recompute.py [--feedback 1000000] [--partitions 4] [--repeat 2] [--warmup 1]
"""

from __future__ import annotations

from flywheel.allocator import keep_freed_pages

# polars' allocator as the `flywheel` command sets it (`flywheel.allocator`), before polars loads: the recompute and
# the bare group-by both run with it
keep_freed_pages()

import argparse
import resource
import time
from datetime import timedelta

import numpy as np
import polars as pl

from flywheel.contract import utcnow
from flywheel.settings import Settings
from signals.config import SignalsConfig
from signals.recompute import recompute_scores
from signals.reward import DEFAULT_DEFINITION

# (type, properties JSON) of feedback events, with how often each comes
FEEDBACK = [
    ("shown", "{}", 0.30),
    ("accepted", '{"accepted_chars":12,"total_chars":20}', 0.15),
    ("rejected", "{}", 0.08),
    ("ignored", "{}", 0.05),
    ("retained", '{"seconds_after_accept":30,"fraction_present":0.8}', 0.12),
    ("edited", '{"edit_distance":4}', 0.06),
    ("undone", '{"seconds_after_accept":3.5}', 0.03),
    ("copied", "{}", 0.05),
    ("regenerated", "{}", 0.03),
    ("followup", '{"text":"thanks, that works great"}', 0.06),
    ("thumbs", '{"value":"up","comment":"nice"}', 0.04),
    ("thumbs", '{"value":"down"}', 0.03),
]
GENERATION_PROPS = (
    '{"model_version":"3","arm":"champion","experiment":"e1","completion":"return x + 1","finish_reason":"stop"}'
)


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def events_frame(n_feedback: int, partitions: int, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    n_gen = max(1, n_feedback // 4)
    window_us, start_us = 600_000_000, int((utcnow() - timedelta(days=1)).timestamp() * 1e6)
    gen_ts = start_us + np.arange(n_gen, dtype=np.int64) * 20_000  # 50 generations/s of event time
    owner = rng.integers(0, n_gen, n_feedback)
    fb_ts = gen_ts[owner] + rng.integers(0, window_us, n_feedback)
    late = rng.random(n_feedback) < 0.02  # arrives 3 windows after its time
    weights = np.array([w for *_, w in FEEDBACK])
    kind = rng.choice(len(FEEDBACK), n_feedback, p=weights / weights.sum())
    types = np.array([t for t, _, _ in FEEDBACK])
    props = np.array([p for _, p, _ in FEEDBACK])
    gens = pl.DataFrame({
        "event_id": "gen-" + pl.Series(np.arange(n_gen)).cast(pl.String),
        "type": "generation",
        "generation_id": "g" + pl.Series(np.arange(n_gen)).cast(pl.String),
        "ts_us": gen_ts,
        "arrive_us": gen_ts,
        "properties": GENERATION_PROPS,
    })  # fmt: skip
    feedback = pl.DataFrame({
        "event_id": "fb-" + pl.Series(np.arange(n_feedback)).cast(pl.String),
        "type": types[kind],
        "generation_id": "g" + pl.Series(owner).cast(pl.String),
        "ts_us": fb_ts,
        "arrive_us": np.where(late, fb_ts + 3 * window_us, fb_ts),
        "properties": props[kind],
    })  # fmt: skip
    dup = feedback.sample(fraction=0.01, seed=seed).with_columns(pl.col("arrive_us") + 1_000_000)
    return (
        pl.concat([gens, feedback, dup])
        .with_columns(
            pl.col("generation_id").hash(seed).mod(partitions).cast(pl.Int32).alias("kafka_partition"),
            (pl.lit("user") + pl.col("generation_id").str.slice(1, 4)).alias("user_id"),
            pl.from_epoch("ts_us", "us").dt.replace_time_zone("UTC").alias("ts"),
            pl.from_epoch("arrive_us", "us").dt.replace_time_zone("UTC").alias("received_at"),
        )
        .sort("kafka_partition", "arrive_us")
        .with_columns(pl.int_range(pl.len()).over("kafka_partition").cast(pl.Int64).alias("kafka_offset"))
        .select("event_id", "type", "generation_id", "user_id", "ts", "received_at", "properties",
                "kafka_partition", "kafka_offset")  # fmt: skip
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--feedback", type=int, default=1_000_000, help="feedback events (generations: a quarter as many)")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of each phase before its timed ones")
    args = ap.parse_args()
    settings = Settings(reward_window_s=600.0, allowed_lateness_s=5.0)
    t = time.perf_counter()
    events = events_frame(args.feedback, args.partitions)
    n_feedback = int((events["type"] != "generation").sum())
    print(f"built {events.height:,} event rows ({n_feedback:,} feedback) in {time.perf_counter() - t:.1f} s; "
          f"peak RSS {_peak_gib():.2f} GiB")  # fmt: skip

    def bare() -> int:
        return events.lazy().group_by("generation_id").agg(pl.len(), pl.col("ts").max()).collect().height

    def recompute() -> int:
        return recompute_scores(settings, DEFAULT_DEFINITION, events, config=SignalsConfig()).height

    timings = {}
    for name, fn in (("bare", bare), ("recompute", recompute)):
        runs, out = [], 0
        for _ in range(args.warmup + args.repeat):
            t = time.perf_counter()
            out = fn()
            runs.append(time.perf_counter() - t)
        best = min(runs[args.warmup :])
        timings[name] = (best, out, runs[0])
        print(f"{name}: {out:,} rows out, best of {args.repeat} {best:.2f} s after {args.warmup} untimed "
              f"(first run {runs[0]:.2f} s); peak RSS {_peak_gib():.2f} GiB")  # fmt: skip
    (tb, _, cold_b), (tr, records, cold_r) = timings["bare"], timings["recompute"]
    print(f"bare polars group_by: {n_feedback / tb:,.0f} feedback rows/s")
    print(f"signals recompute:    {n_feedback / tr:,.0f} feedback rows/s ({records:,} records)")
    print(f"ratio recompute/bare: {tb / tr:.3f} (warm; first runs: {cold_b / cold_r:.3f})")


if __name__ == "__main__":
    main()
