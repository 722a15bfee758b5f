"""Held-out prompts and text: code the model was not trained on, picked deterministically.

The bootstrap model trains on a seeded sample of the standard library's source
(`flywheel.lm.corpus.stdlib_corpus`); its checkpoint records the preset and seed. The held-out
files are the standard library's test suites plus the library files that sample did not pick
(`flywheel.lm.corpus.held_out_files`). For a checkpoint Flywheel did not bootstrap, the default
preset's sample is assumed: "held out" then means held out from Flywheel's own training only.

A prompt is a file cut in the middle of a non-blank line (the preceding lines kept as context),
which is what the product asks serving for: the rest of the line. A text window is a run of
whole lines from another file.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from flywheel.lm import METADATA_FILE, PRESETS
from flywheel.lm.adapter_info import adapter_base_dir, is_adapter_dir
from flywheel.lm.corpus import held_out_files

_CONTEXT_LINES = 12
_DEFAULT_PRESET = "default"


@dataclass(frozen=True)
class HeldOut:
    prompts: list[str]
    texts: list[str]
    source: str  # where they came from, in words (recorded with the results)


def training_sample_of(checkpoint: Path) -> tuple[int, int]:
    """(files sampled, seed) of the bootstrap corpus `checkpoint` was trained on (a LoRA adapter's: its base's)."""
    if is_adapter_dir(checkpoint):
        checkpoint = adapter_base_dir(checkpoint)
    meta_path = checkpoint / METADATA_FILE
    preset, seed = _DEFAULT_PRESET, 0
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        preset, seed = str(meta.get("preset", preset)), int(meta.get("seed", seed))
    return PRESETS.get(preset, PRESETS[_DEFAULT_PRESET]).n_files, seed


def held_out(checkpoint: Path, n_prompts: int, n_texts: int, text_chars: int, seed: int) -> HeldOut:
    """`n_prompts` prompts and `n_texts` texts of about `text_chars` characters, the same for the same seed."""
    n_files, train_seed = training_sample_of(checkpoint)
    files = held_out_files(n_files, train_seed)
    rng = random.Random(seed)
    order = rng.sample(files, len(files))  # a seeded shuffle; files that yield nothing are skipped
    prompts: list[str] = []
    texts: list[str] = []
    for path in order:
        if len(prompts) >= n_prompts and len(texts) >= n_texts:
            break
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        if len(prompts) < n_prompts:
            prompt = _prompt(lines, rng)
            if prompt is not None:
                prompts.append(prompt)
                continue
        if len(texts) < n_texts:
            text = _text(lines, rng, text_chars)
            if text is not None:
                texts.append(text)
    source = f"{len(prompts)} prompts and {len(texts)} texts from standard-library files not in the training sample"
    return HeldOut(prompts, texts, source)


def _prompt(lines: list[str], rng: random.Random) -> str | None:
    candidates = [i for i, line in enumerate(lines) if len(line.strip()) >= 12 and not line.lstrip().startswith("#")]
    if not candidates:
        return None
    i = rng.choice(candidates)
    line = lines[i].rstrip("\n")
    indent = len(line) - len(line.lstrip())
    cut = indent + (len(line) - indent) // 2
    return "".join(lines[max(0, i - _CONTEXT_LINES) : i]) + line[:cut]


def _text(lines: list[str], rng: random.Random, chars: int) -> str | None:
    if sum(len(line) for line in lines) < chars:
        return None
    start = rng.randrange(len(lines))
    out: list[str] = []
    for line in lines[start:]:
        out.append(line)
        if sum(len(x) for x in out) >= chars:
            return "".join(out)
    return None
