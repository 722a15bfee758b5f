"""Weight-delta size: the registry's stored delta over the full safetensors file, on real trainer cycles.

For each configuration a fresh registry holds the bootstrapped embedded model as champion (saved in the
configuration's stored dtype, `save_dtype`, as a champion that was itself a candidate would be), the same
simulated feedback is in the lake, and `trainer.cycle.run_cycle` trains and registers a candidate exactly
as in production. Configurations: the trainer's default (trains in float32, stores bfloat16 rounded
stochastically) for one optimizer step and for whole cycles at each learning rate of the sweep; then, for
comparison, one step and one default cycle training in bfloat16 itself (the optimizer rounds to nearest)
and storing float32. Reported per configuration: the full safetensors size, the stored delta (weights
only, and the whole artifact with tokenizer and config), their ratio, the share of values whose bits
changed, for the stochastically rounded rows the share one step of exactly the learning rate would change
(mean of min(1, lr / bfloat16 step) over the champion's values: AdamW's first step moves every weight
with a gradient by the learning rate), which encodings won, the delta's apply (rebuild + verify on fetch)
time, and a bare baseline in the same run: zstd of the full file alone.

    python bench/registry_delta.py [--model DIR] [--samples 64] [--lrs 1e-6,2e-6,3e-6,5e-6,1e-5,1e-4]

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
from safetensors.torch import load_file

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


def plans(lrs: list[float]) -> list[tuple[str, TrainerConfig]]:
    """(label, config): the default config for one step and a cycle per learning rate, then one step and one
    default cycle training in bfloat16 and storing float32."""
    default = TrainerConfig()
    out = [("default", default.replace(max_steps=1))]
    out += [("default", default.replace(learning_rate=lr)) for lr in lrs]
    for label, config in (("bf16 train", default.replace(dtype="bfloat16")),
                          ("fp32 store", default.replace(save_dtype="float32"))):  # fmt: skip
        out += [(label, config.replace(max_steps=1)), (label, config)]
    return out


def share_one_step_changes(weights: Path, lr: float) -> float:
    """Share of bfloat16 values that one step of exactly `lr` changes under stochastic rounding: the mean
    of min(1, lr / step), where a value's step is 2**(exponent - 8) (frexp's mantissa is in [0.5, 1))."""
    tensors = [t.float().flatten() for t in load_file(weights).values()]
    values = torch.cat(tensors)
    step = torch.ldexp(torch.ones_like(values), torch.frexp(values).exponent - 8)
    return float((lr / step).clamp(max=1.0).mean())


def one_config(base: Path, lake: Path, model: Path, label: str, config: TrainerConfig) -> dict[str, Any]:
    root = base / f"{label.replace(' ', '-')}-lr{config.learning_rate:g}-steps{config.max_steps or 'cycle'}"
    s = settings_in(root)
    shutil.copytree(lake, s.lake_dir)
    champion_dir = load_policy(model, dtype=config.save_dtype).save(root / "champion")
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
    rounded = (config.dtype, config.save_dtype) == ("float32", "bfloat16")  # stochastic rounding at save
    return {
        "config": label, "dtype": config.dtype, "save_dtype": config.save_dtype, "lr": config.learning_rate,
        "steps": int(result.metrics["steps"]), "kind": art.kind,
        "full_safetensors": full_weights, "delta_weights": stored_weights, "artifact_bytes": art.stored_bytes,
        "ratio_weights": full_weights / stored_weights, "ratio_artifact": full_weights / art.stored_bytes,
        "baseline_zstd_ratio": full_weights / zstd_full, "changed_share": changed,
        "one_step_lr_share": share_one_step_changes(champion_dir / WEIGHTS, config.learning_rate) if rounded else None,
        "encodings": dict(encodings),
        "cycle_s": round(cycle_s, 2), "apply_s": round(apply_s, 3),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="A checkpoint (default: bootstrap the default preset).")
    ap.add_argument("--bootstrap-seconds", type=float, default=120.0)
    ap.add_argument("--samples", type=int, default=64, help="Feedback samples per cycle (batch 8: samples/8 steps).")
    ap.add_argument("--lrs", default="1e-6,2e-6,3e-6,5e-6,1e-5,1e-4", help="Learning rates of the default cycles.")
    ap.add_argument("--json", type=Path, help="Also write the rows here.")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as tmp:
        base = Path(tmp)
        model = args.model or bootstrap_model(base / "model", preset="default", max_seconds=args.bootstrap_seconds,
                                              progress=False)  # fmt: skip
        s = settings_in(base / "feedback")
        write_events(s, consent_events(USERS))
        # Served by the default champion: its bfloat16 values, computed in float32 (as serving does).
        policy = load_policy(load_policy(model, dtype="bfloat16").save(base / "served"))
        simulate_feedback(s, policy, PROMPTS, lambda g: 1.0 if g.finish_reason != "length" else -1.0,
                          model_version="1", n=args.samples, seed=1, users=USERS)  # fmt: skip
        rows = []
        for label, config in plans([float(lr) for lr in args.lrs.split(",")]):
            rows.append(one_config(base, s.lake_dir, model, label, config))
            print(json.dumps(rows[-1]), flush=True)
    print()
    print(f"{'config':10} {'train':8} {'store':8} {'lr':>7} {'steps':>5} {'full MB':>8} {'delta KB':>9} "
          f"{'ratio':>7} {'artifact':>8} {'zstd only':>9} {'changed':>8} {'lr/step':>8} {'apply s':>7}")  # fmt: skip
    for r in rows:
        lr_share = "-" if r["one_step_lr_share"] is None else f"{r['one_step_lr_share']:.2%}"
        print(f"{r['config']:10} {r['dtype']:8} {r['save_dtype']:8} {r['lr']:>7g} {r['steps']:>5} "
              f"{r['full_safetensors'] / 1e6:>8.2f} {r['delta_weights'] / 1e3:>9.1f} {r['ratio_weights']:>6.1f}x "
              f"{r['ratio_artifact']:>7.1f}x {r['baseline_zstd_ratio']:>8.2f}x {r['changed_share']:>8.2%} "
              f"{lr_share:>8} {r['apply_s']:>7.3f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
