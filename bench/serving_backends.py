"""Serving throughput on the vLLM back end against the in-process Hugging Face back end, 1 and 16 clients.

Both run behind the real serving app (serving.app under uvicorn, a fixed champion-only split, every
completion signed and logged to the embedded Kafka broker before it is answered); only the pool's loader
differs: `load_policy` (HF, in process) or `flywheel.lm.vllm.VLLMBackend` (a managed vLLM server from
.venv-vllm, fp32, eager). Same checkpoint, same prompts, same seeds; completions are one line, so both
count only the tokens actually produced. Prints completion tokens/s and requests/s, the vLLM/HF ratio at
each concurrency, and the measured |vLLM - trainer| behaviour log-prob difference on the served samples
(the figure the trainer's mismatch report shows for a vLLM-served version).

    python bench/serving_backends.py [--path DIR] [--requests 64] [--max-tokens 32] [--clients 16] [--threads 1]

vLLM's CPU attention takes head sizes of 32, 64, 80, ... only, and the embedded presets have 48 (default)
and 16 (test). Without --path a default-preset model is bootstrapped for a few seconds and its heads are
regrouped to 32 wide (`vllm_shaped`: the same weights and parameter count, 6 heads instead of 4).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from serving_throughput import load, serve  # noqa: E402

from flywheel.bus import ensure_topics  # noqa: E402
from flywheel.lm import bootstrap_model, load_policy, token_logprobs  # noqa: E402
from flywheel.lm.policy import GenerationRequest  # noqa: E402
from flywheel.lm.vllm import ServerOptions, VLLMBackend, VLLMGenerator, vllm_unavailable  # noqa: E402
from flywheel.settings import Settings  # noqa: E402
from launcher.embedded import free_port, start_broker  # noqa: E402

VLLM_HEAD_DIM = 32


def vllm_shaped(checkpoint: Path, out: Path, head_dim: int = VLLM_HEAD_DIM) -> Path:
    """A copy of a Llama-shaped checkpoint with its attention regrouped into `head_dim`-wide heads: the same
    weight matrices (so the same parameters, the trained embeddings and MLPs), a model vLLM's CPU attention
    runs. It is another model than the original (heads mix differently), which is all a test of the back end
    or a throughput measurement needs."""
    shutil.copytree(checkpoint, out)
    config = json.loads((out / "config.json").read_text())
    heads, rest = divmod(config["hidden_size"], head_dim)
    if rest:
        raise ValueError(f"hidden_size {config['hidden_size']} is not a multiple of {head_dim}")
    config.update(num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim, dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def logprob_difference(generator: VLLMGenerator, checkpoint: Path, n: int, max_tokens: int) -> tuple[int, float, float]:
    """Tokens, mean and max |vLLM - trainer| log-prob over `n` seeded completions served by vLLM."""
    policy = load_policy(checkpoint, dtype="float32")
    prompts = ["def ", "import os\n\nclass Config:\n    def __init__(self", "x = ", "    for key, value in "]
    gens = generator.generate_batch(
        [GenerationRequest(prompts[i % len(prompts)], max_tokens, seed=i) for i in range(n)]
    )
    diffs: list[float] = []
    for g in gens:
        lp, mask = token_logprobs(policy.model, [g.prompt_token_ids], [g.completion_token_ids], policy.pad_id)
        diffs.extend(abs(a - b) for a, b in zip(lp[0][mask[0].bool()].tolist(), g.logprobs, strict=True))
    return len(diffs), sum(diffs) / len(diffs), max(diffs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, help="a HF checkpoint vLLM can run (default: bootstrap one)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the HF back end")
    parser.add_argument("--kv-cache-gb", type=int, default=1)
    args = parser.parse_args()
    reason = vllm_unavailable()
    if reason:
        raise SystemExit(f"vLLM back end unavailable: {reason}")
    torch.set_num_threads(args.threads)
    results: dict[str, dict[int, tuple[float, int, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.path is None:
            trained = bootstrap_model(Path(tmp) / "trained", preset="default", max_seconds=5, progress=False)
            path = vllm_shaped(trained, Path(tmp) / "model")
        else:
            path = args.path
        torch.set_num_threads(args.threads)
        n_params = sum(p.numel() for p in load_policy(path).model.parameters())
        port = free_port()
        broker = start_broker(port, Path(tmp) / "broker.log")
        backend = VLLMBackend(options=ServerOptions(kv_cache_gb=args.kv_cache_gb))
        try:
            settings = Settings(data_dir=Path(tmp) / "data", kafka_bootstrap_servers=f"127.0.0.1:{port}",
                                events_topic="bench-events")  # fmt: skip
            ensure_topics(settings)
            # as build_serving_app runs each: HF one batch at a time after a 2 ms wait, vLLM 8 in flight, no wait
            for name, loader, wait_s, workers in (("hf", None, 0.002, 1), ("vllm", backend.load, 0.0, 8)):
                server, url = serve(path, settings, wait_s, loader=loader, workers=workers)
                load(url, 1, 4, args.max_tokens)  # warm-up (loads the model or starts the engine)
                results[name] = {c: load(url, c, args.requests, args.max_tokens) for c in (1, args.clients)}
                server.should_exit = True
            tokens, mean_diff, max_diff = logprob_difference(backend.load("1", path), path, 32, args.max_tokens)
        finally:
            backend.close()
            broker.terminate()
            broker.wait(timeout=10)

    seconds = {name: {c: tok / rate for c, (rate, tok, _) in r.items()} for name, r in results.items()}
    print(f"model: {n_params / 1e6:.1f}M parameters, fp32, HF torch threads {args.threads}, vLLM OMP threads "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')}, {args.requests} requests, max_tokens {args.max_tokens}")
    for c in (1, args.clients):
        for name in ("hf", "vllm"):
            rate, tok, latency = results[name][c]
            print(f"{name:4s} {c:2d} client(s): {rate:8.1f} tokens/s {args.requests / seconds[name][c]:7.1f} "
                  f"requests/s ({tok} tokens, mean latency {latency * 1000:.0f} ms)")
        print(f"ratio vLLM / HF at {c} client(s): {results['vllm'][c][0] / results['hf'][c][0]:.2f}x tokens/s")
    print(f"|vLLM - trainer| log-prob over {tokens} served tokens: mean {mean_diff:.2e}, max {max_diff:.2e}")


if __name__ == "__main__":
    main()
