"""Drive a running Flywheel from outside, as a small product would, and report what its users got.

Start the loop without its own simulated users, then point this at its HTTP doors:

    bash scripts/up.sh --users 0 --populations content            # terminal 1
    .venv/bin/python bench/outside_traffic.py --rate 3 --users 4000 --populations content --minutes 90

Requests arrive as a Poisson process at `--rate` a second from `--users` users (each drawn uniformly per
request, so most users come back a few times over an hour, as on a small product), each user in one
population (`simulator.populations`: hidden preferences the model never sees). Every request goes through
serving's `POST /v1/completions` and its reactions through the collector's Segment door; nothing else reaches
Flywheel. Every `--every` seconds it prints, per model version served, the ground-truth accept rate of shown
suggestions with a 95% Wilson interval, and the registry's versions with their gate state and the rollout's
last decision (from the gate's API). At the end: the accept rate before (the first champion's requests) and
after (the last champion's requests since its promotion), each promotion's ground truth against the champion
it replaced, and the decisions in order, written as markdown to `--out` with the command, the date and the
machine's load.

The baseline the figure is read against is in the same run: the first champion's users, served by the same
machine under the same load.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from scipy.stats import binomtest

from simulator.contexts import held_out_contexts
from simulator.populations import populations_named
from simulator.product import SimulatedProduct


class Tally:
    """Shown and kept suggestions per served model version, and when each version was first served."""

    def __init__(self) -> None:
        self.shown: Counter[str] = Counter()
        self.kept: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        self.first_seen: dict[str, float] = {}
        self.errors = 0
        self.lock = threading.Lock()

    def add(self, version: str, shown: bool, kept: bool) -> None:
        with self.lock:
            self.served[version] += 1
            self.first_seen.setdefault(version, time.monotonic())
            self.shown[version] += shown
            self.kept[version] += kept

    def rate(self, version: str) -> tuple[float, float, float, int]:
        n, k = self.shown[version], self.kept[version]
        if n == 0:
            return float("nan"), float("nan"), float("nan"), 0
        ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        return k / n, float(ci.low), float(ci.high), n


def gate_status(gate_url: str, token: str) -> dict[str, Any]:
    """The gate's versions, split and experiment, as its read API gives them ({} for what did not answer)."""
    out: dict[str, Any] = {}
    for key, path in (("versions", "/api/versions"), ("split", "/api/split"), ("experiment", "/api/experiment")):
        try:
            resp = httpx.get(f"{gate_url}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=10)
            resp.raise_for_status()
            out[key] = resp.json()
        except (httpx.HTTPError, ValueError):
            pass
    return out


def describe(status: dict[str, Any]) -> list[str]:
    return [f"v{v.get('version')}: {v.get('gate_state')} ({v.get('reason', '')[:300]})"
            for v in (status.get("versions") or [])[:12]]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serving", default="http://127.0.0.1:8000")
    ap.add_argument("--collector", default="http://127.0.0.1:8001")
    ap.add_argument("--gate", default="http://127.0.0.1:8002")
    ap.add_argument("--write-key", default="dev-write-key")
    ap.add_argument("--token", default="dev-approval-token", help="a gate token that may read /api/status")
    ap.add_argument("--rate", type=float, default=3.0, help="requests a second (Poisson)")
    ap.add_argument("--users", type=int, default=4000)
    ap.add_argument("--populations", default="content", help="comma-separated; user i is in population i mod k")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--every", type=float, default=60.0, help="seconds between reports")
    ap.add_argument("--threads", type=int, default=16, help="requests in flight at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="markdown report (default: print only)")
    args = ap.parse_args()

    populations = populations_named([p.strip() for p in args.populations.split(",") if p.strip()])
    contexts = held_out_contexts(200, args.seed)
    rng = random.Random(args.seed)
    tally = Tally()
    serving = httpx.Client(base_url=args.serving, timeout=120, limits=httpx.Limits(max_connections=args.threads))
    collector = httpx.Client(base_url=args.collector, timeout=120, limits=httpx.Limits(max_connections=args.threads))
    product = SimulatedProduct(serving, collector, args.write_key, contexts)
    started = time.monotonic()
    deadline = started + args.minutes * 60
    timeline: list[str] = []
    seen_states: dict[str, str] = {}

    def one(user: int, seed: int) -> None:
        population = populations[user % len(populations)]
        try:
            out = product.step(population, f"outside-{population.name}-{user:05d}", random.Random(seed))
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            with tally.lock:
                tally.errors += 1
            print(f"request failed: {exc}", file=sys.stderr)
            return
        tally.add(out.model_version, out.reaction.shown, out.reaction.kept)

    def report(final: bool = False) -> None:
        status = gate_status(args.gate, args.token)
        split = (status.get("split") or {}).get("split") or {}
        mins = (time.monotonic() - started) / 60
        with tally.lock:
            versions = sorted(tally.served, key=lambda v: tally.first_seen[v])
            rows = [(v, *tally.rate(v), tally.served[v]) for v in versions]
        print(f"--- {mins:.1f} min, {sum(tally.served.values())} requests, {tally.errors} failed; champion "
              f"v{split.get('champion_version')}, challenger v{split.get('challenger_version') or '-'} "
              f"({split.get('challenger_share', 0):.0%})")
        for v, rate, lo, hi, n, served in rows:
            print(f"  v{v}: accept {rate:.3f} [{lo:.3f}, {hi:.3f}] of {n} shown ({served} served)")
        experiment = status.get("experiment") or {}
        decision = ((experiment.get("analysis") or {}).get("decision") or {})
        if decision:
            print(f"  rollout: v{experiment.get('challenger')} {experiment.get('state')}: "
                  f"{decision.get('action')}: {str(decision.get('reason'))[:200]}")
        for v in status.get("versions") or []:
            state = str(v.get("gate_state"))
            if seen_states.get(str(v.get("version"))) != state:
                seen_states[str(v.get("version"))] = state
                timeline.append(f"{mins:.1f} min: v{v.get('version')} {state}: {v.get('reason', '')}")
                print(f"  decision: {timeline[-1]}")
        if final and args.out:
            write_report(args, rows, timeline, status)

    next_report = started + args.every
    with ThreadPoolExecutor(args.threads) as pool:
        t = time.monotonic()
        while t < deadline:
            t += rng.expovariate(args.rate)
            time.sleep(max(0.0, t - time.monotonic()))
            pool.submit(one, rng.randrange(args.users), rng.randrange(2**31))
            if time.monotonic() >= next_report:
                next_report += args.every
                threading.Thread(target=report, daemon=True).start()
    report(final=True)


def write_report(args: argparse.Namespace, rows: list[tuple[Any, ...]], timeline: list[str],
                 status: dict[str, Any]) -> None:  # fmt: skip
    load = os.getloadavg()
    lines = [
        f"# Outside traffic: {args.populations}, {args.rate}/s from {args.users} users, {args.minutes:g} min",
        "",
        f"`{' '.join(sys.argv)}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; load average at the end "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores.",
        "",
        "| version | accept rate of shown | 95% interval | shown | served |",
        "| --- | --- | --- | --- | --- |",
        *[f"| v{v} | {r:.3f} | [{lo:.3f}, {hi:.3f}] | {n} | {s} |" for v, r, lo, hi, n, s in rows],
        "",
        "Decisions, in order (the registry's gate state and its reason):",
        "",
        *[f"- {t}" for t in timeline],
        "",
        "Versions at the end:",
        "",
        *[f"- {d}" for d in describe(status)],
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
