"""Weight-delta size: the registry's stored delta over the full safetensors file, on real trainer cycles.

For each configuration a fresh registry holds the bootstrapped embedded model as champion (saved in the
configuration's dtype), the same simulated feedback is in the lake, and `trainer.cycle.run_cycle` trains
and registers a candidate exactly as in production. Reported per configuration: the full safetensors
size, the stored delta (weights only, and the whole artifact with tokenizer and config), their ratio,
the share of values whose bits changed, which encodings won, the delta's encode (register) and apply
(rebuild + verify on fetch) times, and a bare baseline in the same run: zstd of the full file alone.

    python bench/registry_delta.py [--model DIR] [--samples 64] [--lrs 1e-6,1e-5,1e-4]

Without --model the default preset is bootstrapped (`flywheel model bootstrap`, --bootstrap-seconds).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import zstandard

from flywheel.contract import ModelLineage
from flywheel.lm import bootstrap_model, load_policy
from flywheel.settings import Settings
from model_registry import ModelRegistry
from model_registry.delta import describe_delta
from simulator.lake_feedback import consent_events, simulate_feedback
from simulator.telemetry import write_events
from trainer.config import TrainerConfig
from trainer.cycle import run_cycle

PROMPTS = ["def add(a, b):\n    return", "import os\n", "for i in range(", "x = ", "class Foo:\n    def",
           "print(", "if x is None:\n    ", "return ", "y = [", "while True:\n    "]  # fmt: skip
USERS = ("u0", "u1", "u2", "u3")
WEIGHTS = "model.safetensors"


def settings_in(root: Path) -> Settings:
    root.mkdir(parents=True, exist_ok=True)
    return Settings(data_dir=root, mlflow_tracking_uri=f"sqlite:///{root / 'mlflow.db'}", min_train_samples=1,
                    redis_prefix=f"bench:{root.name}:")  # fmt: skip


def one_config(base: Path, lake: Path, model: Path, dtype: str, config: TrainerConfig) -> dict[str, Any]:
    root = base / f"{dtype}-lr{config.learning_rate:g}-steps{config.max_steps or 'cycle'}"
    s = settings_in(root)
    shutil.copytree(lake, s.lake_dir)
    champion_dir = load_policy(model, dtype=dtype).save(root / "champion")
    registry = ModelRegistry(s)
    champion = registry.register(champion_dir, ModelLineage(base="bootstrap"))
    registry.set_alias("champion", champion)
    registry.fetch(champion)  # cached, as on a trainer that trained from it

    started = time.perf_counter()
    result = run_cycle(s, config, progress=False)
    cycle_s = time.perf_counter() - started
    assert result.version, result.reason
    art = registry.artifact(result.version)
    manifest = registry.manifest(result.version)
    full_weights = manifest["files"][WEIGHTS]["bytes"]
    stored = manifest["artifact"]["stored"]
    stored_weights = stored[WEIGHTS]["bytes"] if art.kind == "full" else stored[WEIGHTS + ".fwdelta"]["bytes"]
    shutil.rmtree(s.data_dir / "models" / result.version, ignore_errors=True)
    started = time.perf_counter()
    rebuilt = registry.fetch(result.version)  # download, apply to the cached parent, verify files and tensors
    apply_s = time.perf_counter() - started
    encodings: Counter[str] = Counter()
    stored_dir = next(p for p in (root / "mlflow").rglob(WEIGHTS + ".fwdelta")) if art.kind == "delta" else None
    if stored_dir is not None:
        encodings.update(d["enc"] for d in describe_delta(stored_dir.read_bytes()).values())
    diff = registry.diff(champion, result.version)
    changed = sum(d.changed for d in diff) / sum(d.elements for d in diff)
    zstd_full = len(zstandard.ZstdCompressor(level=10).compress((rebuilt / WEIGHTS).read_bytes()))
    return {
        "dtype": dtype, "lr": config.learning_rate, "steps": int(result.metrics["steps"]), "kind": art.kind,
        "full_safetensors": full_weights, "delta_weights": stored_weights, "artifact_bytes": art.stored_bytes,
        "ratio_weights": full_weights / stored_weights, "ratio_artifact": full_weights / art.stored_bytes,
        "baseline_zstd_ratio": full_weights / zstd_full, "changed_share": changed, "encodings": dict(encodings),
        "cycle_s": round(cycle_s, 2), "apply_s": round(apply_s, 3),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="A checkpoint (default: bootstrap the default preset).")
    ap.add_argument("--bootstrap-seconds", type=float, default=120.0)
    ap.add_argument("--samples", type=int, default=64, help="Feedback samples per cycle (batch 8: samples/8 steps).")
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4", help="Learning rates to sweep on the whole cycle.")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--json", type=Path, help="Also write the rows here.")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as tmp:
        base = Path(tmp)
        model = args.model or bootstrap_model(base / "model", preset="default", max_seconds=args.bootstrap_seconds,
                                              progress=False)  # fmt: skip
        s = settings_in(base / "feedback")
        write_events(s, consent_events(USERS))
        policy = load_policy(model)
        simulate_feedback(s, policy, PROMPTS, lambda g: 1.0 if g.finish_reason != "length" else -1.0,
                          model_version="1", n=args.samples, seed=1, users=USERS)  # fmt: skip
        default = TrainerConfig()
        rows = []
        for dtype in args.dtypes.split(","):
            plans = [TrainerConfig(dtype=dtype, max_steps=1)]  # type: ignore[arg-type]
            plans += [TrainerConfig(dtype=dtype, learning_rate=float(lr)) for lr in args.lrs.split(",")]  # type: ignore[arg-type]
            for config in plans:
                row = one_config(base, s.lake_dir, model, dtype, config)
                row["default_lr"] = config.learning_rate == default.learning_rate
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(f"{'dtype':9} {'lr':>7} {'steps':>5} {'full MB':>8} {'delta KB':>9} {'ratio':>7} {'artifact':>8} "
          f"{'zstd only':>9} {'changed':>8} {'apply s':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['dtype']:9} {r['lr']:>7g} {r['steps']:>5} {r['full_safetensors'] / 1e6:>8.2f} "
              f"{r['delta_weights'] / 1e3:>9.1f} {r['ratio_weights']:>6.1f}x {r['ratio_artifact']:>7.1f}x "
              f"{r['baseline_zstd_ratio']:>8.2f}x {r['changed_share']:>8.2%} {r['apply_s']:>7.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
