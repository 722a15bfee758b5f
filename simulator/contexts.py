"""Where simulated users ask for completions: code the model was not pretrained on, cut mid-line.

A context is a prompt (up to `CONTEXT_LINES` lines, then the first part of the next line), the rest
of that line as the author really wrote it (`truth`, for the content population), and its kind:
`"comment"` when the cut line is a comment (the user is writing prose), else `"code"`.

The files are `flywheel.lm.corpus.held_out_files`: the standard library's test suites and the
library files the bootstrap's seeded sample did not pick, so no prompt was in the pretraining
corpus of a model bootstrapped with the same preset and seed. The same seed gives the same contexts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Literal

from flywheel.lm import PRESETS
from flywheel.lm.corpus import held_out_files

CONTEXT_LINES = 8
MIN_LINE_CHARS = 12
Kind = Literal["code", "comment"]


@dataclass(frozen=True)
class Context:
    prompt: str
    truth: str  # the real rest of the cut line, with its newline
    kind: Kind
    source: str = ""  # the file it was cut from


@dataclass(frozen=True)
class ContextPool:
    """Contexts of each kind, drawn from the same held-out files."""

    code: tuple[Context, ...]
    comment: tuple[Context, ...]

    def draw(self, rng: random.Random, comment_share: float) -> Context:
        """A context: a comment one with probability `comment_share` (when there are any)."""
        if self.comment and rng.random() < comment_share:
            return rng.choice(self.comment)
        return rng.choice(self.code)


def fit_prompts(pool: ContextPool, max_chars: int) -> ContextPool:
    """The pool with each prompt cut to its last `max_chars` characters, as an editor trims what it sends.

    A byte-level tokenizer spends at least one character per token, so `max_chars` of
    `context - max_tokens` characters always fits the model's context.
    """
    cut = lambda ctxs: tuple(replace(c, prompt=c.prompt[-max_chars:]) for c in ctxs)  # noqa: E731
    return ContextPool(cut(pool.code), cut(pool.comment))


def held_out_contexts(n: int = 200, seed: int = 0, *, preset: str = "default", train_seed: int = 0) -> ContextPool:
    """About `n` code contexts and `n // 2` comment ones from files a `preset`/`train_seed` bootstrap never saw."""
    # Codec tables (`encodings/`) are generated lists, not code anyone writes by hand.
    files = [f for f in held_out_files(PRESETS[preset].n_files, train_seed) if "encodings" not in f.parts]
    rng = random.Random(seed)
    code: list[Context] = []
    comment: list[Context] = []
    for path in rng.sample(files, len(files)):
        if len(code) >= n and len(comment) >= n // 2:
            break
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        # A few contexts per file, so the pool spans many files' styles.
        for _ in range(3):
            ctx = _cut(lines, rng, str(path))
            if ctx is None:
                break
            bucket = comment if ctx.kind == "comment" else code
            if len(bucket) < (n // 2 if ctx.kind == "comment" else n):
                bucket.append(ctx)
    if not code:
        raise RuntimeError("no held-out code to draw contexts from; the standard library's source is missing")
    return ContextPool(tuple(code), tuple(comment))


def _cut(lines: list[str], rng: random.Random, source: str) -> Context | None:
    candidates = [i for i, line in enumerate(lines) if len(line.strip()) >= MIN_LINE_CHARS]
    if not candidates:
        return None
    i = rng.choice(candidates)
    line = lines[i] if lines[i].endswith("\n") else lines[i] + "\n"
    indent = len(line) - len(line.lstrip())
    body = line.rstrip("\n")
    cut = indent + rng.randrange(2, max(3, (len(body) - indent) * 2 // 3))
    kind: Kind = "comment" if line.lstrip().startswith("#") else "code"
    return Context(prompt="".join(lines[max(0, i - CONTEXT_LINES) : i]) + line[:cut], truth=line[cut:], kind=kind,
                   source=source)
