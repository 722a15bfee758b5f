"""`flywheel model`: bootstrap the embedded policy model, make a tiny one of another family, or sample from any
checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True)


@app.command()
def bootstrap(
    out: Annotated[Path, typer.Option("--out", help="Directory to write the HF checkpoint to.")],
    preset: Annotated[str, typer.Option(help="'default' (a few M params) or 'test' (seconds).")] = "default",
    seconds: Annotated[
        float | None, typer.Option(help="Pretraining time budget (default preset: 180 s).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for corpus sampling, init and batches.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace a model already at --out.")] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Train the model at --out on for --seconds more (same trajectory).")
    ] = False,
    package_files: Annotated[
        int | None, typer.Option(min=0, help="Installed packages' .py files added to the corpus (default 0).")
    ] = None,
) -> None:
    """Train a tokenizer and a small Llama on the Python standard library (and installed packages, with
    --package-files); save in HF format. --resume continues an earlier bootstrap's pretraining."""
    from flywheel.lm import METADATA_FILE, PRESETS, bootstrap_model

    if preset not in PRESETS:
        raise typer.BadParameter(f"choose one of {sorted(PRESETS)}", param_hint="--preset")
    try:
        path = bootstrap_model(out, preset=preset, seed=seed, max_seconds=seconds, progress=True, force=force,  # type: ignore[arg-type]
                               resume=resume, package_files=package_files)  # fmt: skip
    except (FileExistsError, FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    meta = json.loads((path / METADATA_FILE).read_text())
    typer.echo(
        f"model at {path}: {meta['parameters']:,} parameters, {meta['steps']} steps"
        + (f" (resumed at step {meta['resumed_from_step']})" if meta.get("resumed_from_step") else "")
        + f", {meta['tokens_seen']:,} tokens seen of a {meta['corpus']['tokens']:,}-token corpus,"
        f" final loss {meta['final_loss']:.3f}"
    )


@app.command()
def tiny(
    family: Annotated[str, typer.Option("--family", help="llama, qwen2, mistral, phi3 or gpt2.")],
    out: Annotated[Path, typer.Option("--out", help="Directory to write the HF checkpoint to.")],
    seed: Annotated[int, typer.Option(help="Seed for the tokenizer's corpus sample and the weights.")] = 0,
) -> None:
    """Write a tiny, randomly initialised checkpoint of a model family, its tokenizer trained here with the
    family's quirks (BOS/EOS, padding, chat template): to run the loop on that architecture without the hub."""
    from flywheel.lm.families import FAMILIES, tiny_checkpoint

    if family not in FAMILIES:
        raise typer.BadParameter(f"choose one of {', '.join(FAMILIES)}", param_hint="--family")
    path = tiny_checkpoint(family, out, seed=seed)
    typer.echo(f"{family} model at {path}")


@app.command()
def generate(
    path: Annotated[Path, typer.Option("--path", help="A local HF causal-LM checkpoint.")],
    prompt: Annotated[
        str, typer.Option("--prompt", help="Text to complete (escape sequences like \\n allowed).")
    ],
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1)] = 16,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy.")] = 1.0,
    seed: Annotated[int | None, typer.Option()] = None,
    samples: Annotated[int, typer.Option("-n", "--samples", min=1, help="How many completions.")] = 1,
    device: Annotated[str, typer.Option()] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
) -> None:
    """Sample completions and print them with their behaviour log-probs as JSON lines."""
    from flywheel.lm import CheckpointError, load_policy

    try:
        policy = load_policy(path, device=device, dtype=dtype)
    except (CheckpointError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    text = prompt.encode("utf-8").decode("unicode_escape")
    for i in range(samples):
        gen = policy.generate(
            text, max_tokens=max_tokens, temperature=temperature, seed=None if seed is None else seed + i
        )
        typer.echo(
            json.dumps(
                {
                    "completion": gen.completion,
                    "finish_reason": gen.finish_reason,
                    "completion_token_ids": gen.completion_token_ids,
                    "logprobs": [round(x, 4) for x in gen.logprobs],
                }
            )
        )
