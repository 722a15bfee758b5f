"""LoRA adapters: the stored artifact against the full-weights delta, and adapter swaps under load.

Sizes. One simulated feedback set (the model's own samples and log-probs, rewards from a rule) is in the lake;
two fresh registries each hold the bootstrapped embedded model as champion (stored in bfloat16, as a champion
that was itself a candidate is) and `trainer.cycle.run_cycle` trains one cycle on it, exactly as in
production: `update="full"` (the default config: every weight, stored as a lossless delta against the
champion) and `update="lora"` (an adapter, rank `--rank` on every linear layer, stored as a peft directory).
Reported per row: what the registry stores (bytes), the full checkpoint's bytes, their ratio, the trained
parameters, the KL to the champion and the cycle's wall time. Then, counted rather than trained (no hub here), the
adapter of the same rank on a Qwen2-0.5B-shaped model against that model's bfloat16 weights.

Swap under load. Serving's pool (`serving.pool.PolicyPool` with its default in-process loader) and batcher
answer `--clients` closed-loop client threads (each submits a completion and waits for it, back to back),
in this process. The base is the champion, the challenger an adapter on it (half the users each). First half
(`--seconds`): no swap, the steady baseline. Second half: every `--every` seconds the challenger changes
between two adapters (the trained one and a second, seeded one), so each swap loads an adapter onto the
running base (`peft` `load_adapter`), routes new requests to it and frees the one left out once its last
request has finished. Reported: failed requests (goal 0), p50 / p99 latency of each half and their ratio
(goal p99 <= 1.5x), the adapter load time, and that the base weights stayed one copy.

    OMP_NUM_THREADS=1 python bench/lora_adapters.py [--model DIR] [--samples 64] [--clients 4] [--seconds 20]

Without --model the default preset is bootstrapped (`flywheel model bootstrap`, --bootstrap-seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from flywheel.contract import ModelLineage, TrafficSplit
from flywheel.lm import Policy, bootstrap_model, load_policy, write_adapter_info
from flywheel.lm.adapters import AdapterInfo, PolicyLoader, read_adapter_info, share_storage
from flywheel.settings import Settings
from model_registry import ModelRegistry
from serving.batching import Batcher
from serving.generator import GenerationRequest
from serving.pool import PolicyPool
from simulator.lake_feedback import consent_events, simulate_feedback
from simulator.telemetry import write_events
from trainer.config import TrainerConfig
from trainer.cycle import run_cycle

PROMPTS = ["def add(a, b):\n    return", "import os\n", "for i in range(", "x = ", "class Foo:\n    def",
           "print(", "if x is None:\n    ", "return ", "y = [", "while True:\n    "]  # fmt: skip
USERS = ("u0", "u1", "u2", "u3")


def settings_in(root: Path) -> Settings:
    root.mkdir(parents=True, exist_ok=True)
    return Settings(data_dir=root, mlflow_tracking_uri=f"sqlite:///{root / 'mlflow.db'}", min_train_samples=1,
                    redis_prefix=f"bench:{root.name}:")  # fmt: skip


def one_cycle(base: Path, lake: Path, model: Path, label: str, config: TrainerConfig) -> tuple[dict[str, Any], Path]:
    """Train and register one cycle from a fresh registry; (its row, the fetched candidate's directory)."""
    s = settings_in(base / label)
    shutil.copytree(lake, s.lake_dir)
    registry = ModelRegistry(s)
    champion = registry.register(load_policy(model, dtype="bfloat16").save(base / label / "champion"),
                                 ModelLineage(base="bootstrap"))  # fmt: skip
    registry.set_alias("champion", champion)
    registry.fetch(champion)  # cached, as on a trainer that trained from it
    started = time.perf_counter()
    result = run_cycle(s, config, progress=False)
    cycle_s = time.perf_counter() - started
    assert result.version, result.reason
    art = registry.artifact(result.version)
    fetched = registry.fetch(result.version)
    policy = load_policy(fetched, trainable=True)
    trained = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    return {
        "update": config.update, "lr": config.learning_rate, "steps": int(result.metrics["steps"]),
        "stored_bytes": art.stored_bytes, "checkpoint_bytes": registry.artifact(champion).checkpoint_bytes,
        "ratio": registry.artifact(champion).checkpoint_bytes / art.stored_bytes, "kind": art.kind,
        "trained_params": trained, "kl_to_champion": result.metrics["kl_to_champion"], "cycle_s": round(cycle_s, 1),
    }, fetched  # fmt: skip


def adapter_at_scale(rank: int) -> dict[str, Any]:
    """Parameters of a rank-`rank` all-linear adapter on a Qwen2-0.5B-shaped model (its published shape), counted
    on the meta device: no weights exist, nothing is downloaded. Bytes at bfloat16."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    peft_model = get_peft_model(model, TrainerConfig(lora_rank=rank).lora_config())
    adapter = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    return {"model": "Qwen2-0.5B shape", "params": total, "adapter_params": adapter, "rank": rank,
            "full_bf16_mb": round(total * 2 / 1e6, 1), "adapter_bf16_mb": round(adapter * 2 / 1e6, 1),
            "ratio": round(total / adapter, 1)}  # fmt: skip


def second_adapter(trained: Path, out: Path, seed: int) -> Path:
    """An adapter shaped like `trained`, its weights redrawn (seeded), naming the same base."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for name in ("adapter_config.json",):
        shutil.copyfile(trained / name, out / name)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(trained / "adapter_model.safetensors")
    save_file({k: (torch.randn(v.shape, generator=gen) * v.float().std()).to(v.dtype) for k, v in weights.items()},
              out / "adapter_model.safetensors")  # fmt: skip
    write_adapter_info(out, read_adapter_info(trained))
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _views(pool: PolicyPool) -> dict[str, Policy]:
    """Each loaded version's policy, found by routing users."""
    out: dict[str, Policy] = {}
    for i in range(1000):
        route = pool.route(f"probe{i}")
        if isinstance(route.policy, Policy):
            out.setdefault(route.version, route.policy)
    return out


def swap_under_load(cache: Path, clients: int, seconds: float, every: float) -> dict[str, Any]:
    """Clients against the pool's routes and batcher while the challenger adapter swaps (see the docstring)."""
    split = [TrafficSplit(champion_version="1", challenger_version="2", challenger_share=0.5, salt="bench")]
    loads: list[float] = []
    pool = PolicyPool(lambda: split[0], lambda v: str(cache / v))
    assert pool.refresh()
    batcher = Batcher(max_batch=16, max_wait_s=0.002)
    rows: list[tuple[float, float, bool, str]] = []
    lock = threading.Lock()
    start = time.monotonic() + 1.0
    middle, end = start + seconds, start + 2 * seconds

    def client(i: int) -> None:
        n = 0
        while time.monotonic() < end:
            t0 = time.monotonic()
            ok, version = True, ""
            try:
                route = pool.route(f"user{i}-{n}")
                version = route.version
                batcher.submit(route.policy, [GenerationRequest("def f(", max_tokens=8, seed=n)])[0].result(60)
            except Exception as exc:  # counted, never raised: the bench reports failures
                ok, version = False, type(exc).__name__
            with lock:
                rows.append((t0, time.monotonic() - t0, ok, version))
            n += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, middle - time.monotonic()))
    swaps, shared = 0, True
    while time.monotonic() + every < end:
        challenger = "3" if split[0].challenger_version == "2" else "2"
        split[0] = split[0].model_copy(update={"challenger_version": challenger})
        assert pool.refresh()
        swaps += 1
        loads.append(pool.last_load_s or 0.0)
        views = _views(pool)
        shared = shared and share_storage(views["1"], views[challenger])
        del views
        time.sleep(max(0.0, every - (time.monotonic() - start) % every))
    for t in threads:
        t.join()
    batcher.stop()
    loader = pool._loader
    steady = [r for r in rows if start <= r[0] < middle]
    swapping = [r for r in rows if r[0] >= middle]
    p50 = {k: _pct([r[1] for r in part], 0.5) for k, part in (("steady", steady), ("swapping", swapping))}
    p99 = {k: _pct([r[1] for r in part], 0.99) for k, part in (("steady", steady), ("swapping", swapping))}
    return {
        "clients": clients, "requests": {"steady": len(steady), "swapping": len(swapping)},
        "failed": sum(not r[2] for r in rows), "swaps": swaps,
        "versions_swapping": sorted({r[3] for r in swapping}),
        "p50_ms": {k: round(v * 1000, 1) for k, v in p50.items()},
        "p99_ms": {k: round(v * 1000, 1) for k, v in p99.items()},
        "p99_ratio": round(p99["swapping"] / p99["steady"], 3),
        "adapter_load_ms_median": round(_pct(loads, 0.5) * 1000, 1),
        "base_one_copy": shared,
        "adapters_in_memory_at_end": sorted(loader.adapters) if isinstance(loader, PolicyLoader) else None,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="A checkpoint (default: bootstrap the default preset).")
    ap.add_argument("--bootstrap-seconds", type=float, default=120.0)
    ap.add_argument("--samples", type=int, default=64, help="Feedback samples per cycle (batch 8: samples/8 steps).")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-lr", type=float, default=1e-4)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0, help="Length of each half of the swap run.")
    ap.add_argument("--every", type=float, default=2.0, help="Seconds between adapter swaps.")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        base = Path(tmp)
        model = args.model or bootstrap_model(base / "model", preset="default", max_seconds=args.bootstrap_seconds,
                                              progress=False)  # fmt: skip
        s = settings_in(base / "feedback")
        write_events(s, consent_events(USERS))
        policy = load_policy(load_policy(model, dtype="bfloat16").save(base / "served"))
        simulate_feedback(s, policy, PROMPTS, lambda g: 1.0 if g.finish_reason != "length" else -1.0,
                          model_version="1", n=args.samples, seed=1, users=USERS)  # fmt: skip
        full, _ = one_cycle(base, s.lake_dir, model, "full", TrainerConfig())
        lora, adapter = one_cycle(base, s.lake_dir, model, "lora",
                                  TrainerConfig(update="lora", lora_rank=args.rank, learning_rate=args.lora_lr))
        print(json.dumps(full), flush=True)
        print(json.dumps(lora), flush=True)
        print(f"\n{'update':6} {'lr':>7} {'steps':>5} {'checkpoint KB':>13} {'stored KB':>10} {'ratio':>7} "
              f"{'trained params':>14} {'KL':>9} {'cycle s':>7}")  # fmt: skip
        for r in (full, lora):
            print(f"{r['update']:6} {r['lr']:>7g} {r['steps']:>5} {r['checkpoint_bytes'] / 1e3:>13.1f} "
                  f"{r['stored_bytes'] / 1e3:>10.1f} {r['ratio']:>6.1f}x {r['trained_params']:>14,} "
                  f"{r['kl_to_champion']:>9.2e} {r['cycle_s']:>7}")  # fmt: skip
        print(f"adapter / full-weights delta: {lora['stored_bytes'] / full['stored_bytes']:.3f}x")
        print("at scale (counted, not trained):", json.dumps(adapter_at_scale(args.rank)))

        cache = base / "cache"
        info: AdapterInfo = read_adapter_info(adapter)
        shutil.copytree(adapter.parent / info.base_version, cache / "1")
        shutil.copytree(adapter, cache / "2")
        write_adapter_info(cache / "2", dataclasses.replace(info, base_version="1"))
        second_adapter(cache / "2", cache / "3", seed=3)
        swap = swap_under_load(cache, args.clients, args.seconds, args.every)
        print(json.dumps(swap, indent=1))


if __name__ == "__main__":
    main()
