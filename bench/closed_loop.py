"""Closed-loop benchmark, first stage: the base model's ground truth per population, through real serving.

Each population of `simulator.populations` sends `--requests` requests for held-out code contexts
to the real serving app (uvicorn on a local port, fixed champion split, every generation signed and
logged to the embedded broker) and sends its users' reactions to the real collector's Segment
`/v1/batch`; every event must be accepted (a refusal stops the run). Printed per population, from
the simulator's ground truth:

- shown rate: answers with a suggestion (not declined, not empty);
- accept rate: the mean accept probability of shown suggestions (and the sampled accepts);
- reward: Cursor's expected reward per request (+0.75 accepted, -0.25 rejected, 0 not shown);
- for the declining population, the shown rate where its users want no suggestion.

The reference beside each: the same requests answered by the better of two actions, the author's own
rest of the line (what the held-out file really says) or no suggestion (reward 0); the ratio
base / reference is how far the base model is from it.
Training cycles come next (the issue's closed loop); this stage measures where they start.

    python bench/closed_loop.py [--model DIR] [--requests 100] [--max-tokens 16] [--seed 0]

Without --model a default-preset model is bootstrapped for --bootstrap-seconds (120: `flywheel up`'s).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from flywheel.bus import ensure_topics, make_producer
from flywheel.bus.reader import read_topic
from flywheel.contract import TrafficSplit
from flywheel.lm import bootstrap_model
from flywheel.settings import Settings
from ingest.collector import create_app as create_collector
from launcher.embedded import free_port, start_broker
from serving.app import create_app as create_serving
from serving.pool import PolicyPool
from simulator.contexts import ContextPool, held_out_contexts
from simulator.populations import Population, default_populations
from simulator.product import Outcome, SimulatedProduct


def start(app: FastAPI) -> tuple[uvicorn.Server, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def run_population(pop: Population, serving: str, collector: str, key: str, contexts: ContextPool,
                   n: int, max_tokens: int, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    with httpx.Client(base_url=serving, timeout=300) as s, httpx.Client(base_url=collector, timeout=60) as c:
        product = SimulatedProduct(s, c, key, contexts, max_tokens=max_tokens)
        return [product.step(pop, f"bench-{pop.name}-{i % 10}", rng) for i in range(n)]


def reference(pop: Population, outcomes: list[Outcome]) -> float:
    """Mean expected reward had each request got the better of the author's own rest of the line and silence."""
    return statistics.fmean(
        max(0.0, pop.truth(o.context, o.context.truth.rstrip("\n"), "stop").expected_reward) for o in outcomes
    )


def report(pop: Population, outcomes: list[Outcome], ref: float) -> str:
    shown = [o for o in outcomes if o.truth.shown]
    accept = statistics.fmean(o.truth.p_accept for o in shown) if shown else 0.0
    sampled = sum(o.reaction.kept for o in shown) / len(shown) if shown else 0.0
    reward = statistics.fmean(o.truth.expected_reward for o in outcomes)
    unwanted = [o for o in outcomes if not o.truth.wanted]
    extra = f"  shown where unwanted {sum(o.truth.shown for o in unwanted) / len(unwanted):.2f} of {len(unwanted)}" \
        if unwanted else ""
    ratio = f"{reward / ref:+.2f}" if ref else "n/a"
    return (f"{pop.name:<10} n={len(outcomes):<4} shown {len(shown) / len(outcomes):.2f}  accept {accept:.3f}"
            f" (sampled {sampled:.3f})  reward {reward:+.3f}  reference {ref:+.3f}  base/reference {ratio}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--bootstrap-seconds", type=float, default=120.0)
    ap.add_argument("--requests", type=int, default=100, help="per population")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or bootstrap_model(Path(tmp) / "model", preset="default", seed=0,
                                              max_seconds=args.bootstrap_seconds, progress=False)
        port = free_port()
        broker = start_broker(port, Path(tmp) / "broker.log")
        try:
            settings = Settings(data_dir=Path(tmp) / "data", kafka_bootstrap_servers=f"127.0.0.1:{port}")
            ensure_topics(settings)
            pool = PolicyPool(lambda: TrafficSplit(champion_version="base"), lambda _: str(model))
            serving_app = create_serving(pool, make_producer(settings), settings.events_topic,
                                         signing_key=settings.serving_key.get_secret_value())
            servers = [start(serving_app), start(create_collector(settings))]
            (_, serving), (_, collector) = servers
            key = sorted(settings.write_key_set)[0]
            contexts = held_out_contexts(300, args.seed)
            pops = default_populations()
            started = time.perf_counter()
            with ThreadPoolExecutor(len(pops)) as threads:
                results = list(threads.map(
                    lambda ip: run_population(ip[1], serving, collector, key, contexts, args.requests,
                                              args.max_tokens, args.seed * 1000 + ip[0]),
                    enumerate(pops)))
            took = time.perf_counter() - started
            dead = read_topic(settings, settings.dead_letter_topic, timeout_s=5)
            print(f"model {model}  {args.requests} requests per population, max_tokens {args.max_tokens},"
                  f" {took:.0f}s; dead letters: {len(dead)}")
            for pop, outcomes in zip(pops, results, strict=True):
                print(report(pop, outcomes, reference(pop, outcomes)))
            for server, _ in servers:
                server.should_exit = True
        finally:
            broker.terminate()
            broker.wait(timeout=10)


if __name__ == "__main__":
    main()
