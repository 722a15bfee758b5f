"""Serving throughput: completion tokens/s with 16 concurrent clients over one client, and over a bare
Hugging Face `generate` loop on the same model, in the same process.

- bare: `model.generate(do_sample=True, max_new_tokens=M)` on one prompt at a time (no log-probs, no
  logging, no HTTP): the floor any server is measured against;
- serving, 1 client / 16 clients: the real app (serving.app) under uvicorn on a local port, clients
  posting over HTTP with httpx; every completion is scored for its behaviour log-probs, signed and
  logged to the embedded Kafka broker before it is answered, as in production. The split is a fixed
  one (champion only), so Redis and MLflow are not involved.
Also `Policy.generate_batch` in process, one request at a time and `--clients` at a time, to show what
the HTTP server and the logging cost. Completions are one line (serving stops at a newline), the
bare loop runs to `max_new_tokens`, so both count only the tokens actually produced. Also prints
the mean batch size serving formed.

    python bench/serving_throughput.py [--path DIR] [--requests 96] [--max-tokens 32] [--clients 16] [--threads 1]
        [--wait-ms 2]

Without --path a default-preset model (the embedded one's shape) is bootstrapped for a few seconds:
its weights barely matter to throughput.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
import uvicorn

from flywheel.bus import ensure_topics, make_producer
from flywheel.contract import TrafficSplit
from flywheel.lm import Policy, bootstrap_model, load_policy
from flywheel.lm.policy import GenerationRequest
from flywheel.settings import Settings
from launcher.embedded import free_port, start_broker
from serving.app import create_app
from serving.pool import Loader, PolicyPool

PROMPTS = [
    "def ",
    "import os\n\nclass Config:\n    def __init__(self",
    "    for key, value in ",
    "# parse the header\nx = ",
    "    return ",
    "from collections import ",
]


def bare_generate(policy: Policy, n: int, max_tokens: int) -> tuple[float, int]:
    """Tokens/s of HF generate, one prompt at a time, and the tokens produced."""
    tokens = 0
    started = time.perf_counter()
    for i in range(n):
        ids = torch.tensor([policy.encode_prompt(PROMPTS[i % len(PROMPTS)], max_tokens)])
        torch.manual_seed(i)
        out = policy.model.generate(  # type: ignore[operator]
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=True,
            pad_token_id=policy.pad_id,
        )
        tokens += out.shape[1] - ids.shape[1]
    return tokens / (time.perf_counter() - started), tokens


def in_process(policy: Policy, n: int, max_tokens: int, batch: int) -> float:
    """Tokens/s of `Policy.generate_batch` in batches of `batch` (no HTTP, no logging)."""
    requests = [GenerationRequest(PROMPTS[i % len(PROMPTS)], max_tokens, seed=i) for i in range(n)]
    started = time.perf_counter()
    tokens = sum(
        len(g.completion_token_ids)
        for k in range(0, n, batch)
        for g in policy.generate_batch(requests[k : k + batch])
    )
    return tokens / (time.perf_counter() - started)


def serve(
    policy_dir: Path, settings: Settings, wait_s: float, loader: Loader | None = None, workers: int = 1
) -> tuple[uvicorn.Server, str]:
    """The app on a local port; `loader`: the pool's (None: the in-process HF back end)."""
    pool = PolicyPool(lambda: TrafficSplit(champion_version="1"), lambda _: str(policy_dir), loader=loader)
    app = create_app(pool, make_producer(settings), settings.events_topic, max_batch_wait_s=wait_s,
                     batch_workers=workers, signing_key=settings.serving_key.get_secret_value())  # fmt: skip
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    while not server.started:
        time.sleep(0.05)
    return server, url


def load(url: str, clients: int, n: int, max_tokens: int) -> tuple[float, int, float]:
    """Tokens/s with `clients` concurrent clients sending `n` requests in all; tokens; mean latency (s)."""
    latencies: list[float] = []

    def client(k: int) -> int:
        produced = 0
        with httpx.Client(base_url=url, timeout=300) as http:
            for i in range(k, n, clients):
                sent = time.perf_counter()
                body = {"prompt": PROMPTS[i % len(PROMPTS)], "user": f"user-{i}", "max_tokens": max_tokens,
                        "seed": i}  # fmt: skip
                resp = http.post("/v1/completions", json=body)
                resp.raise_for_status()
                latencies.append(time.perf_counter() - sent)
                produced += resp.json()["usage"]["completion_tokens"]
        return produced

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as threads:
        tokens = sum(threads.map(client, range(clients)))
    return tokens / (time.perf_counter() - started), tokens, statistics.mean(latencies)


def batch_sizes(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    count = float(re.search(r"^flywheel_serving_batch_size_count (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
    total = float(re.search(r"^flywheel_serving_batch_size_sum (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
    return count, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, help="a HF checkpoint (default: bootstrap one)")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--wait-ms", type=float, default=2.0, help="serving's max_batch_wait_s, in ms")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: steadiest on a shared CPU, where extra threads spin)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.path or bootstrap_model(Path(tmp) / "model", preset="default", max_seconds=5, progress=False)
        torch.set_num_threads(args.threads)  # bootstrapping sets its own
        policy = load_policy(path)
        n_params = sum(p.numel() for p in policy.model.parameters())
        port = free_port()
        broker = start_broker(port, Path(tmp) / "broker.log")
        try:
            settings = Settings(data_dir=Path(tmp) / "data", kafka_bootstrap_servers=f"127.0.0.1:{port}",
                                events_topic="bench-events")  # fmt: skip
            ensure_topics(settings)
            bare_generate(policy, 4, args.max_tokens)  # warm-up
            bare_rate, bare_tokens = bare_generate(policy, args.requests, args.max_tokens)
            alone_rate = in_process(policy, args.requests, args.max_tokens, 1)
            batched_rate = in_process(policy, args.requests, args.max_tokens, args.clients)
            server, url = serve(path, settings, args.wait_ms / 1000)
            load(url, 1, 4, args.max_tokens)  # warm-up (loads the model, connects to Kafka)
            warm = batch_sizes(url)
            one_rate, one_tokens, one_latency = load(url, 1, args.requests, args.max_tokens)
            mid = batch_sizes(url)
            many_rate, many_tokens, many_latency = load(url, args.clients, args.requests, args.max_tokens)
            end = batch_sizes(url)
            server.should_exit = True
        finally:
            broker.terminate()
            broker.wait(timeout=10)

    print(f"model: {n_params / 1e6:.1f}M parameters, CPU threads {torch.get_num_threads()}, "
          f"{args.requests} requests, max_tokens {args.max_tokens}, batch wait {args.wait_ms} ms")  # fmt: skip
    print(f"bare HF generate loop:      {bare_rate:8.1f} tokens/s ({bare_tokens} tokens)")
    print(f"generate_batch, 1 at a time:{alone_rate:8.1f} tokens/s (in process: no HTTP, no logging)")
    print(f"generate_batch, {args.clients} at a time:{batched_rate:7.1f} tokens/s")
    print(f"serving, 1 client:          {one_rate:8.1f} tokens/s ({one_tokens} tokens, "
          f"mean latency {one_latency * 1000:.0f} ms, mean batch {(mid[1] - warm[1]) / (mid[0] - warm[0]):.1f})")
    print(f"serving, {args.clients} clients:        {many_rate:8.1f} tokens/s ({many_tokens} tokens, "
          f"mean latency {many_latency * 1000:.0f} ms, mean batch {(end[1] - mid[1]) / (end[0] - mid[0]):.1f})")
    print(f"ratio {args.clients} clients / 1 client:  {many_rate / one_rate:.2f}x")
    print(f"ratio {args.clients} clients / bare:      {many_rate / bare_rate:.2f}x")
    print(f"ratio 1 client / bare:        {one_rate / bare_rate:.2f}x")


if __name__ == "__main__":
    main()
