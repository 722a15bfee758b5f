"""Live swap under load: request latency p99 while serving swaps versions, over p99 without a swap.

Serving (`serving.app.create_app` with the real `PolicyPool`, registry and Redis split, uvicorn in this
process) answers a steady closed-loop load from *another process* (`--clients` threads, each posting
completions back to back). The run has two halves of `--seconds` each: the first without a swap (the bare
baseline), the second with a swap every `--every` seconds, alternating the champion between the base
model and a delta child; each swap deletes the cached copy first, so it includes the whole push: download
the delta, apply it to the cached parent, verify every file and tensor, load into a second copy, swap.
Reported: p50 / p99 of each half and their ratio, failed requests, the delta's apply time (fetch) and
the swap pause (how long the routing lock was held), and which version answered in each half.

Generation events are dropped by a stand-in producer (no Kafka here): the bench measures serving, not
the broker.

    python bench/serving_swap.py [--model DIR] [--clients 4] [--seconds 20] [--every 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flywheel.bus import Outgoing
from flywheel.connections import redis_client
from flywheel.contract import ModelLineage, TrafficSplit
from flywheel.lm import bootstrap_model, load_policy
from flywheel.settings import Settings
from flywheel.traffic import TrafficSplitStore
from model_registry import ModelRegistry
from serving.app import create_app
from serving.pool import PolicyPool, watch_split

LOAD = r"""
import json, sys, threading, time, httpx
url, clients, until = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
out, lock = [], threading.Lock()
def run(i):
    with httpx.Client(timeout=30) as c:
        n = 0
        while time.time() < until:
            t0 = time.time()
            try:
                r = c.post(url, json={"prompt": "def f(", "user": f"u{i}-{n}", "max_tokens": 8, "seed": n})
                status, model = r.status_code, r.json().get("model", "")
            except Exception as e:
                status, model = 0, type(e).__name__
            with lock:
                out.append((t0, time.time() - t0, status, model))
            n += 1
ts = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
[t.start() for t in ts]; [t.join() for t in ts]
json.dump(out, sys.stdout)
"""


class DroppingProducer:
    def send_all(self, messages: Sequence[Outgoing], timeout_s: float = 10.0) -> None:
        return None

    def close(self) -> None:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(src: Path, out: Path, dtype: str) -> Path:
    """One AdamW step's worth of change: every value moved by lr 1e-5 in its sign's direction."""
    policy = load_policy(src, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_((torch.randint(0, 2, p.shape, generator=gen) * 2 - 1).to(p.dtype) * 1e-5)
    return policy.save(out)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--dtype", default="float32", help="Serving and stored dtype (float32 or bfloat16).")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0, help="Length of each half.")
    ap.add_argument("--every", type=float, default=2.0, help="Seconds between swaps in the second half.")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()
    import uvicorn

    with tempfile.TemporaryDirectory(prefix="bench-swap-") as tmp:
        root = Path(tmp)
        model = args.model or bootstrap_model(root / "model", preset="default", max_seconds=120, progress=False)
        s = Settings(data_dir=root / "data", mlflow_tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
                     redis_url=args.redis_url, redis_prefix=f"bench-swap:{root.name}:")  # fmt: skip
        registry = ModelRegistry(s)
        base = load_policy(model, dtype=args.dtype).save(root / "v1")
        v1 = registry.register(base, ModelLineage(base="bootstrap"))
        v2 = registry.register(_child(base, root / "v2", args.dtype), ModelLineage(base="bootstrap", parent_version=v1))
        art = registry.artifact(v2)
        redis = redis_client(s)
        store = TrafficSplitStore(redis, s)
        fetch_s: list[float] = []

        def source(version: str) -> str:
            shutil.rmtree(s.data_dir / "models" / version, ignore_errors=True)  # the whole push, every swap
            started = time.perf_counter()
            path = str(registry.fetch(version))
            fetch_s.append(time.perf_counter() - started)
            return path

        pool = PolicyPool(store.get, source, dtype=args.dtype)
        store.put(TrafficSplit(champion_version=v1))
        app = create_app(pool, DroppingProducer(), "events", signing_key="bench", refresh_interval_s=1.0)
        stop = threading.Event()
        watch_split(redis, store.channel, pool.refresh, stop)
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        start = time.time() + 3.0  # the load process starts (imports) meanwhile
        middle, end = start + args.seconds, start + 2 * args.seconds
        load = subprocess.Popen([sys.executable, "-c", LOAD, f"http://127.0.0.1:{port}/v1/completions",
                                 str(args.clients), str(end)], stdout=subprocess.PIPE)  # fmt: skip
        pauses: list[float] = []
        loads: list[float] = []
        time.sleep(max(0.0, middle - time.time()))
        current = v1
        while time.time() + args.every < end:
            current = v2 if current == v1 else v1
            store.put(TrafficSplit(champion_version=current))
            deadline = time.time() + 60
            while (pool.split is None or pool.split.champion_version != current) and time.time() < deadline:
                time.sleep(0.01)
            pauses.append(pool.last_swap_s or 0.0)
            loads.append(pool.last_load_s or 0.0)
            time.sleep(max(0.0, args.every - (time.time() % args.every)))
        out, _ = load.communicate()
        stop.set()
        server.should_exit = True
    rows: list[Any] = json.loads(out)
    warm = [r for r in rows if start <= r[0] < middle]
    swapping = [r for r in rows if r[0] >= middle]
    p99 = {name: _pct([r[1] for r in part], 0.99) for name, part in (("none", warm), ("swap", swapping))}
    p50 = {name: _pct([r[1] for r in part], 0.50) for name, part in (("none", warm), ("swap", swapping))}
    failed = sum(r[2] != 200 for r in rows)
    print(json.dumps({
        "dtype": args.dtype, "clients": args.clients, "requests": {"no_swap": len(warm), "swapping": len(swapping)},
        "failed": failed, "swaps": len(pauses),
        "models_no_swap": sorted({r[3] for r in warm}), "models_swapping": sorted({r[3] for r in swapping}),
        "p50_ms": {k: round(v * 1000, 1) for k, v in p50.items()},
        "p99_ms": {k: round(v * 1000, 1) for k, v in p99.items()},
        "p99_ratio": round(p99["swap"] / p99["none"], 3),
        "delta_stored_bytes": art.stored_bytes, "checkpoint_bytes": art.checkpoint_bytes,
        "fetch_apply_verify_s": round(_pct(fetch_s[1:], 0.5), 3),
        "load_s_median": round(_pct(loads, 0.5), 3),
        "swap_pause_ms_max": round(max(pauses) * 1000, 3) if pauses else None,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
