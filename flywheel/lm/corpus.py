"""The bootstrap corpus (the Python standard library's own source, optionally installed packages' too)
and its BPE tokenizer."""

from __future__ import annotations

import os
import random
import sysconfig
from pathlib import Path

import torch

EOT = "<|endoftext|>"

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"})


def _stdlib_files(skip: frozenset[str]) -> list[Path]:
    return _python_files(Path(sysconfig.get_paths()["stdlib"]), skip)


def _python_files(root: Path, skip: frozenset[str]) -> list[Path]:
    files: list[Path] = []
    for folder, subdirs, names in os.walk(root):
        # Pruned while walking: site-packages and the test suites are most of the tree.
        subdirs[:] = [d for d in subdirs if d not in skip]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    files.sort()
    return files


def _corpus_files(n_files: int, seed: int) -> list[Path]:
    files = _stdlib_files(_SKIP_DIRS)
    if not files:
        raise RuntimeError("no .py files in the standard library; the bootstrap corpus is the Python standard library.")
    return random.Random(seed).sample(files, min(n_files, len(files)))


def stdlib_corpus(n_files: int, max_chars: int, seed: int) -> list[str]:
    """A deterministic sample of the standard library's .py files (sorted, then seeded sample)."""
    texts = [f.read_text(encoding="utf-8", errors="replace")[:max_chars] for f in _corpus_files(n_files, seed)]
    return [t for t in texts if t.strip()]


def package_corpus(n_files: int, max_chars: int, seed: int) -> list[str]:
    """A deterministic sample of the installed packages' .py files (this interpreter's site-packages).

    Drawn apart from the standard-library sample, which stays the same with or without it, so the
    held-out files (`held_out_files`, standard library only) are the same too. Test suites are left out.
    """
    if n_files <= 0:
        return []
    roots = sorted({Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")})
    files = sorted({f for root in roots if root.is_dir() for f in _python_files(root, _SKIP_DIRS)})
    picked = random.Random(seed).sample(files, min(n_files, len(files)))
    texts = [f.read_text(encoding="utf-8", errors="replace")[:max_chars] for f in picked]
    return [t for t in texts if t.strip()]


def held_out_files(n_files: int, seed: int) -> list[Path]:
    """Standard-library .py files that `stdlib_corpus(n_files, _, seed)` never trains on, sorted.

    The test suites (`test/`, `idle_test/`, never in any bootstrap corpus; some slim images delete
    them) come first, then the library files the seeded sample did not pick.
    """
    corpus = set(_corpus_files(n_files, seed))
    everything = _stdlib_files(frozenset({"site-packages", "dist-packages", "__pycache__"}))
    is_test = [bool(_SKIP_DIRS & set(f.parts)) for f in everything]
    tests = [f for f, t in zip(everything, is_test, strict=True) if t]
    rest = [f for f, t in zip(everything, is_test, strict=True) if not t and f not in corpus]
    return tests + rest


def train_tokenizer(texts: list[str], vocab_size: int, context: int):  # -> PreTrainedTokenizerFast
    """Byte-level BPE (GPT-2 style) with one special token as BOS, EOS and padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # Every encoded text starts with EOT, as every training document does, so a prompt is
    # scored as "the start of a file" and an empty prompt still has a token to condition on.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, tok.token_to_id(EOT))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT, model_max_length=context
    )


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one stream, each preceded by EOT (the tokenizer adds it)."""
    ids: list[int] = []
    # The raw `tokenizers` object: fast, batched, and no "longer than the model" warning.
    for encoded in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(encoded.ids)
    ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)
