"""Make the embedded policy model locally: no hub is reachable, so we train one.

A byte-level BPE tokenizer and a small Llama are trained on the Python standard library's
own source files (every machine with Python has them), plus, when asked, files of the installed
packages (`package_files`: a larger corpus for longer pretraining), then saved in Hugging Face format
(safetensors + tokenizer), so the rest of Flywheel treats it like any user checkpoint.
Trained in float32, saved in bfloat16 (rounded to nearest: there is no parent whose small
updates could be lost), the dtype the trainer stores its candidates in, so the first one is a
small delta against it rather than a full copy in another dtype.

Pretraining is resumable: the float32 weights, the optimizer, the step and the batch sampler's
state are kept beside the checkpoint (`pretrain_state_path`), and `resume=True` trains on from
there. The learning rate and the batches are functions of the step and that state, so N steps and
then M more give the same weights as N + M steps in one run.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from flywheel.lm.corpus import package_corpus, stdlib_corpus, token_stream, train_tokenizer

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedModel

METADATA_FILE = "flywheel_bootstrap.json"
SAVE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Preset:
    """Everything that decides the bootstrapped model, except the seed and the time budget."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    context: int  # max_position_embeddings
    seq_len: int  # training window
    batch_size: int
    max_steps: int
    peak_lr: float
    warmup_steps: int
    n_files: int  # stdlib files sampled for the corpus
    max_file_chars: int  # each file is cut to this many characters
    package_files: int = 0  # installed packages' files sampled besides (0: the standard library alone)
    # Share of every position's target moved to end-of-text (label smoothing toward it), so the model
    # gives about this probability to ending a completion at each token, its first included: it
    # declines that share of requests. Without it a model pretrained on whole files never ends a
    # suggestion before it starts, never declines, and so cannot learn when declining is right.
    decline_prior: float = 0.05
    # Intra-op threads while training; None is half the logical CPUs. A tiny model runs ~3x
    # faster on one thread than on two (hand-off costs more than the matmuls), and on a busy
    # machine every thread beyond the free cores makes OpenMP wait (4x slower measured here).
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}."
            )
        if self.seq_len > self.context:
            raise ValueError(f"seq_len {self.seq_len} must not exceed the context {self.context}.")
        if self.package_files < 0:
            raise ValueError(f"package_files must be >= 0, got {self.package_files}.")
        if not 0 <= self.decline_prior < 0.5:
            raise ValueError(f"decline_prior {self.decline_prior} must be in [0, 0.5).")


PRESETS: dict[str, Preset] = {
    # Seconds on 2 CPU cores; enough for indented, code-looking text, nothing more.
    "test": Preset(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        context=256,
        seq_len=64,
        batch_size=8,
        max_steps=120,
        peak_lr=1e-2,
        warmup_steps=8,
        n_files=40,
        max_file_chars=12_000,
        num_threads=1,
    ),
    # About 2.6M parameters, trained for `max_seconds` (default 180 s) by `flywheel up`. Wider
    # models learn less in a fixed CPU budget: this size measured 1.6k tokens/s on one core.
    "default": Preset(
        vocab_size=4096,
        hidden_size=192,
        intermediate_size=512,
        num_layers=4,
        num_heads=4,
        context=512,
        seq_len=128,
        batch_size=8,
        max_steps=100_000,
        peak_lr=3e-3,
        warmup_steps=30,
        n_files=200,
        max_file_chars=30_000,
    ),
}
DEFAULT_SECONDS = 180.0


def llama_config(preset: Preset, vocab_size: int, eot_token_id: int | None = None) -> LlamaConfig:
    """The architecture of a preset's model; `eot_token_id` serves as its bos, eos and pad token."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_heads,
        max_position_embeddings=preset.context,
        bos_token_id=eot_token_id,
        eos_token_id=eot_token_id,
        pad_token_id=eot_token_id,
        tie_word_embeddings=True,
    )


def _lr_at(step: int, preset: Preset) -> float:
    # Warmup, then inverse-square-root decay: a function of the step alone, so a run cut short
    # by the time budget follows exactly the same trajectory as a longer one up to that step.
    if step < preset.warmup_steps:
        return preset.peak_lr * (step + 1) / preset.warmup_steps
    return preset.peak_lr * math.sqrt(preset.warmup_steps / (step + 1))


def _pretrain_loss(model: torch.nn.Module, batch: torch.Tensor, eot_id: int, decline_prior: float) -> torch.Tensor:
    """Next-token cross-entropy with `decline_prior` of each target's weight on end-of-text.

    The minimiser puts probability `decline_prior` on end-of-text and the rest on the data, so the
    model's chance of declining a request (end-of-text first) starts near `decline_prior`.
    """
    logits = model(input_ids=batch[:, :-1]).logits  # (B, T-1, V)
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, batch[:, 1:, None]).squeeze(-1)  # (B, T-1)
    if not decline_prior:
        return nll.mean()
    return ((1 - decline_prior) * nll - decline_prior * logp[..., eot_id]).mean()


@contextmanager
def _deterministic(seed: int, num_threads: int | None) -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    previous_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(num_threads or max(1, (os.cpu_count() or 2) // 2))
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)
        torch.set_num_threads(previous_threads)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' own tqdm bars (loading/saving shards): they clutter logs and ours."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _progress(enabled: bool) -> Progress | nullcontext[None]:
    if not enabled:
        return nullcontext(None)
    return Progress(
        TextColumn("[bold]pretraining[/]"),
        BarColumn(),
        TextColumn("step {task.fields[step]}"),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(),
    )


def pretrain_state_path(out_dir: Path) -> Path:
    """Where the pretraining state of the checkpoint at `out_dir` is kept: beside it, so registering the
    checkpoint never uploads it."""
    out_dir = Path(out_dir)
    return out_dir.with_name(f"{out_dir.name}.pretrain-state.pt")


@dataclass
class _Run:
    """What one bootstrap trains: corpus, tokenizer, stream, model, optimizer, sampler, and how far it is."""

    texts: list[str]
    tokenizer: Any
    stream: torch.Tensor
    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    windows: torch.Generator
    step: int = 0
    train_seconds: float = 0.0
    losses: deque[float] = field(default_factory=lambda: deque(maxlen=20))

    def state(self, key: dict[str, Any]) -> dict[str, Any]:
        return {"key": key, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "windows": self.windows.get_state(), "step": self.step, "train_seconds": self.train_seconds,
                "losses": list(self.losses), "stream_sha256": _digest(self.stream)}  # fmt: skip


def _digest(stream: torch.Tensor) -> str:
    return hashlib.sha256(stream.numpy().tobytes()).hexdigest()


def _corpus(cfg: Preset, seed: int) -> list[str]:
    texts = stdlib_corpus(cfg.n_files, cfg.max_file_chars, seed)
    return texts + package_corpus(cfg.package_files, cfg.max_file_chars, seed)


def _model_and_optimizer(cfg: Preset, tokenizer: Any) -> tuple[PreTrainedModel, torch.optim.Optimizer]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(cfg, len(tokenizer), tokenizer.eos_token_id))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.peak_lr, weight_decay=0.01, betas=(0.9, 0.95))
    return model, optimizer


def _new_run(cfg: Preset, seed: int) -> _Run:
    texts = _corpus(cfg, seed)
    tokenizer = train_tokenizer(texts, cfg.vocab_size, cfg.context)
    stream = token_stream(tokenizer, texts)  # (n_tokens,)
    model, optimizer = _model_and_optimizer(cfg, tokenizer)
    return _Run(texts, tokenizer, stream, model, optimizer, torch.Generator().manual_seed(seed))


def _resumed_run(cfg: Preset, seed: int, out_dir: Path, key: dict[str, Any]) -> _Run:
    from transformers import PreTrainedTokenizerFast

    path = pretrain_state_path(out_dir)
    if not path.exists():
        raise FileNotFoundError(
            f"{out_dir} has no pretraining state to resume ({path} is missing): it was bootstrapped before "
            "pretraining was resumable, or the state was deleted; bootstrap it again with --force."
        )
    saved = torch.load(path, weights_only=True)  # tensors and plain values only: nothing to unpickle
    if saved["key"] != key:
        changed = sorted(k for k in key if saved["key"].get(k) != key[k])
        raise ValueError(f"the pretraining state at {path} was made with other settings ({', '.join(changed)}); "
                         "resume with the same preset, seed, decline prior and package files, or --force.")  # fmt: skip
    texts = _corpus(cfg, seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    stream = token_stream(tokenizer, texts)
    if _digest(stream) != saved["stream_sha256"]:
        raise ValueError(f"the corpus changed since {out_dir} was pretrained (the installed files differ); "
                         "resuming would train on other data: bootstrap again with --force.")  # fmt: skip
    model, optimizer = _model_and_optimizer(cfg, tokenizer)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    windows = torch.Generator()
    windows.set_state(saved["windows"])
    return _Run(texts, tokenizer, stream, model, optimizer, windows, saved["step"], saved["train_seconds"],
                deque(saved["losses"], maxlen=20))  # fmt: skip


def bootstrap_model(
    out_dir: Path,
    *,
    preset: Literal["test", "default"] = "default",
    seed: int = 0,
    max_seconds: float | None = None,
    progress: bool = True,
    max_steps: int | None = None,
    force: bool = False,
    decline_prior: float | None = None,
    package_files: int | None = None,
    resume: bool = False,
) -> Path:
    """Train a tokenizer and a small Llama on stdlib source; save both in HF format to `out_dir`.

    `preset="test"` runs its fixed number of steps (seconds); `"default"` trains until
    `max_seconds` (default 180) or `max_steps`. Saved in `SAVE_DTYPE` (bfloat16: see the module
    docstring). Same seed and same number of steps give the same weights. A finished checkpoint
    already at `out_dir` with the same preset, seed and decline prior is reused unless `force`, or
    trained on for `max_seconds` more (up to `max_steps` in all) with `resume`.
    `decline_prior` overrides the preset's (the share of requests the model starts out declining);
    `package_files` how many installed packages' files join the corpus. Written to a temporary
    folder first and renamed, so an interrupted bootstrap never leaves a half checkpoint behind.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}.")
    if max_seconds is not None and max_seconds <= 0:
        raise ValueError(f"max_seconds must be positive, got {max_seconds}.")
    if resume and force:
        raise ValueError("resume continues the checkpoint that force would replace: pass one of them.")
    out_dir = Path(out_dir)
    cfg = PRESETS[preset]
    if decline_prior is not None:
        cfg = replace(cfg, decline_prior=decline_prior)
    if package_files is not None:
        cfg = replace(cfg, package_files=package_files)
    key = {"preset": preset, "seed": seed, "decline_prior": cfg.decline_prior, "package_files": cfg.package_files}
    existing = out_dir / METADATA_FILE
    resuming = resume and existing.exists()
    if existing.exists() and not force and not resume:
        meta = json.loads(existing.read_text())
        # A model made before the decline prior (or the package corpus) existed is reused as it is.
        prior = meta.get("config", {}).get("decline_prior", cfg.decline_prior)
        packages = meta.get("config", {}).get("package_files", 0)
        if meta.get("preset") == preset and meta.get("seed") == seed and (prior, packages) == (
            cfg.decline_prior, cfg.package_files
        ):
            return out_dir
        raise FileExistsError(
            f"{out_dir} already holds a model bootstrapped with preset={meta.get('preset')!r} "
            f"seed={meta.get('seed')!r} decline_prior={prior!r} package_files={packages!r}; pass force=True "
            "(--force) to replace it."
        )
    if max_seconds is None and preset == "default":
        max_seconds = DEFAULT_SECONDS
    step_cap = min(cfg.max_steps, max_steps) if max_steps is not None else cfg.max_steps

    started = time.perf_counter()
    with _deterministic(seed, cfg.num_threads):
        run = _resumed_run(cfg, seed, out_dir, key) if resuming else _new_run(cfg, seed)
        resumed_at = run.step
        _pretrain(run, cfg, step_cap, max_seconds, started, progress)
    _save(run, cfg, out_dir, key, resumed_at)
    return out_dir


def _pretrain(run: _Run, cfg: Preset, step_cap: int, max_seconds: float | None, started: float,
              progress: bool) -> None:  # fmt: skip
    """Train `run` until `step_cap` steps in all or `max_seconds` from `started` (at least one step)."""
    model, eot = run.model, run.tokenizer.eos_token_id
    model.train()
    n_starts = run.stream.numel() - cfg.seq_len - 1
    if n_starts <= 0:
        raise RuntimeError(f"the corpus has only {run.stream.numel()} tokens; it needs more than {cfg.seq_len}.")
    first, train_started = run.step, time.perf_counter()
    with _progress(progress) as bar:
        task = (bar.add_task("pretrain", total=max_seconds or step_cap, step=run.step, loss=float("nan"), tps=0.0)
                if bar else None)  # fmt: skip
        while run.step < step_cap:
            # The budget covers corpus and tokenizer too; at least one step is always taken.
            if run.step > first and max_seconds is not None and time.perf_counter() - started >= max_seconds:
                break
            starts = torch.randint(0, n_starts, (cfg.batch_size,), generator=run.windows)
            batch = torch.stack([run.stream[s : s + cfg.seq_len] for s in starts.tolist()])  # (B, seq_len)
            for group in run.optimizer.param_groups:
                group["lr"] = _lr_at(run.step, cfg)
            loss = _pretrain_loss(model, batch, eot, cfg.decline_prior)
            run.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            run.optimizer.step()
            run.step += 1
            run.losses.append(loss.item())
            if bar is not None and task is not None:
                elapsed = time.perf_counter() - train_started
                bar.update(task, completed=(time.perf_counter() - started) if max_seconds else run.step,
                           step=run.step, loss=sum(run.losses) / len(run.losses),
                           tps=(run.step - first) * cfg.batch_size * cfg.seq_len / max(elapsed, 1e-9))  # fmt: skip
    model.eval()
    run.train_seconds += time.perf_counter() - train_started


def _save(run: _Run, cfg: Preset, out_dir: Path, key: dict[str, Any], resumed_at: int) -> None:
    """The checkpoint (bfloat16, HF format) and, beside it, the state to resume pretraining from."""
    state = run.state(key)  # float32, taken before the cast below
    tmp = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with quiet_transformers():
        run.model.to(SAVE_DTYPE)  # type: ignore[arg-type]  # transformers wraps .to; the stub drops self
        run.model.save_pretrained(tmp)
        run.tokenizer.save_pretrained(tmp)
    metadata = {
        "made_by": "flywheel.lm.bootstrap_model",
        "preset": key["preset"],
        "seed": key["seed"],
        "steps": run.step,
        "resumed_from_step": resumed_at or None,
        "final_loss": sum(run.losses) / len(run.losses),  # mean of the last 20 batches
        "train_seconds": round(run.train_seconds, 3),
        "tokens_seen": run.step * cfg.batch_size * cfg.seq_len,
        "corpus": {"source": "python stdlib" + (" + installed packages" if cfg.package_files else ""),
                   "files": len(run.texts), "tokens": int(run.stream.numel())},  # fmt: skip
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "dtype": str(SAVE_DTYPE).removeprefix("torch."),
        "config": asdict(cfg),
        "torch": torch.__version__,
    }
    (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    state_tmp = pretrain_state_path(tmp)
    torch.save(state, state_tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    state_tmp.replace(pretrain_state_path(out_dir))
