"""The four phases of a cycle that trains, after `trainer.cycle` has chosen its champion and samples.

- `prepare`: score the champion on the samples (the KL reference and the trainer's side of the train / inference
  mismatch report), check serving's scoring exactly, and with `own_samples` sample the champion's own (in process,
  or on the `sampling_backend` engine) and score them.
- `optimise`: train (DDP under torchrun) within the step, time and KL limits, and say which samples it left out.
- `finalise`: round the weights to the stored dtype, measure the KL to the champion, gather the cycle's metrics.
- `register` (process 0): store the candidate with its lineage and close the MLflow run.

A `CycleContext` is what every phase works from; each phase returns what the next needs (`Prepared`, `Trained`,
`Finalised`). A phase that looks at `stop` raises `CycleStopped` (`trainer.cycle` catches it).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flywheel.contract import DataWindow, ModelLineage
from flywheel.lm import Policy, round_parameters_to_bfloat16_
from flywheel.lm.engine import EngineChoice, Opened, open_engine
from flywheel.settings import Settings
from model_registry import ModelRegistry
from trainer.config import TrainerConfig
from trainer.data import Sample, Selection, over_cap_reason
from trainer.distributed import any_process
from trainer.loop import StepStats, kl_to_reference, mismatch_report, score_samples, train_policy
from trainer.reward_model import CpuBudget, cpu_seconds, own_samples
from trainer.scoring import Scorer, scorer_for
from trainer.tracking import CycleTracker

log = logging.getLogger(__name__)
_SCORE_CHUNK_BATCHES = 8  # batches of the champion's scoring between two looks at `stop`


class CycleStopped(Exception):
    """The cycle's `stop` was set: raised where it looked, caught by `trainer.cycle.run_cycle`."""

    def __init__(self, where: str, steps: int) -> None:
        super().__init__(f"stopped {where}")
        self.where, self.steps = where, steps


class Stopping:
    """Whether the cycle's `stop` is set, agreed by every process (they must all stop at the same point)."""

    def __init__(self, stop: threading.Event | None, model: torch.nn.Module, world: int) -> None:
        self._stop, self._model, self._world = stop, model, world

    def __call__(self) -> bool:
        if self._stop is None:
            return False
        if self._world == 1:
            return self._stop.is_set()
        return any_process(self._stop.is_set(), self._model)

    def check(self, where: str, steps: int = 0) -> None:
        if self():
            raise CycleStopped(where, steps)


@dataclass(frozen=True)
class CycleContext:
    """What every phase of a cycle works from: its champion, loaded and made trainable, and its samples."""

    settings: Settings
    config: TrainerConfig
    registry: ModelRegistry
    policy: Policy
    selection: Selection
    champion: str
    tracker: CycleTracker
    stopping: Stopping
    rank: int = 0
    world: int = 1


@dataclass(frozen=True)
class Prepared:
    """`prepare`'s result: what the cycle trains on, its reference log-probs, and when preparing began and ended."""

    logged: list[Sample]  # the selection's samples, whose rewards the cycle reads
    samples: list[Sample]  # what it trains on: `logged`, or the champion's own samples
    reference: list[list[float]]  # the champion's log-probs of `samples`
    scorer: Scorer
    mismatch_metrics: dict[str, float]
    own_note: str  # what own sampling did ("" without `own_samples`)
    started: float  # time.monotonic() and cpu_seconds() when the cycle began scoring ...
    cpu_started: float
    prepared: float  # ... and when the optimisation began
    prepared_cpu: float

    @property
    def on_own_samples(self) -> bool:
        return self.samples is not self.logged


@dataclass(frozen=True)
class Trained:
    """`optimise`'s result: one `StepStats` per optimizer step, and how many samples the steps reached."""

    history: list[StepStats]
    reached: int


@dataclass(frozen=True)
class Finalised:
    """`finalise`'s result: the cycle's metrics, and what it trained on, said in words."""

    metrics: dict[str, float]
    trained_on: str


def prepare(ctx: CycleContext) -> Prepared:
    """Score the champion, report the train / inference mismatch, and sample its own completions if asked."""
    config, policy, champion, tracker = ctx.config, ctx.policy, ctx.champion, ctx.tracker
    samples = ctx.selection.samples
    scorer = scorer_for(config.exact_logprobs)
    started, cpu_started = time.monotonic(), cpu_seconds()
    # The starting weights are the champion: their log-probs are both the KL reference and the
    # trainer's side of the train / inference comparison (with the scorer training uses).
    reference = _score_stoppable(policy.model, samples, scorer, policy.pad_id, config.batch_size, ctx.stopping)
    mismatch = mismatch_report(samples, reference, champion, config.mismatch_threshold)
    # Serving's own scoring function, per sample, must reproduce the logged numbers exactly;
    # anything else means a different device, dtype, kernel or checkpoint between the two.
    checked = [s for s in samples if s.model_version == champion and not s.prompt_redacted and not s.text_only]
    checked = checked[: config.exact_check_samples]
    exact = mismatch_report(
        checked, score_samples(policy.model, checked, scorer_for(True), policy.pad_id, config.batch_size),
        champion, config.mismatch_threshold,
    )  # fmt: skip
    mismatch_metrics = {**mismatch.metrics(), **{f"exact_{k}": v for k, v in exact.metrics().items()}}
    tracker.log_metrics(mismatch_metrics, step=0)
    if ctx.rank == 0:
        for name, m in (("training scorer", mismatch), ("serving's scorer", exact)):
            log.info(
                "train/inference mismatch (%s), %d tokens served by v%s: mean %.3g, max %.3g, %.1f%% > %g",
                name, m.tokens, champion, m.mean_abs, m.max_abs, 100 * m.share_over_threshold, m.threshold,
            )  # fmt: skip
    logged = samples
    own_note = ""
    if config.own_samples:
        # The logged rewards fit a reward model; the champion's own samples, scored by it, are trained on.
        # Sized to a CPU budget from the logged samples' scoring on: their scoring, the fit and the sampling.
        budget = CpuBudget(config.own_cpu_budget_s, cpu_started)
        spent = budget.exhausted if ctx.world == 1 else lambda: any_process(budget.exhausted(), policy.model)
        own = own_samples(policy, logged, reference, config, scorer, budget=budget,
                          stop=lambda: spent() or ctx.stopping(), engine=_sampling_engine(ctx))  # fmt: skip
        ctx.stopping.check("while sampling its own samples")
        own_note = own.note
        if own.fresh:
            samples, reference = own.samples, own.reference
        tracker.log_metrics(own.metrics(), step=0)
        if ctx.rank == 0:
            log.info("%s", own_note)
    # The time budget bounds the optimisation: the scoring and sampling before it grow with the cycle's data and
    # the machine's load, and counted in, they could leave it a single step (seen in `flywheel up`).
    prepared, prepared_cpu = time.monotonic(), cpu_seconds()
    return Prepared(logged, samples, reference, scorer, mismatch_metrics, own_note, started, cpu_started, prepared,
                    prepared_cpu)  # fmt: skip


def _sampling_engine(ctx: CycleContext) -> Callable[[], contextlib.AbstractContextManager[Opened]] | None:
    """What opens the engine the champion's own samples are drawn on (`Settings.sampling_backend`); None: the
    in-process loop. A vLLM server started for the cycle is one process's: under torchrun, only an operator's
    server (`vllm_url`) is shared, and without one every process samples in process."""
    choice = EngineChoice.from_settings(ctx.settings)
    if choice.backend == "hf":
        return None
    if ctx.world > 1 and not choice.vllm_url:
        log.warning("sampling_backend=vllm without vllm_url under torchrun: own samples are drawn in process")
        return None
    return lambda: open_engine(choice, ctx.champion, ctx.registry.fetch(ctx.champion), ctx.policy)


def optimise(
    ctx: CycleContext, prep: Prepared, *, progress: bool = True, on_step: Callable[[StepStats], None] | None = None
) -> Trained:
    """Train the policy on `prep.samples`; samples a limit kept it from reaching go to the selection's drops."""
    config, samples, world = ctx.config, prep.samples, ctx.world
    model: torch.nn.Module = ctx.policy.model
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    steps_per_epoch = math.ceil(len(samples) / (config.batch_size * world))
    total = steps_per_epoch * config.epochs
    total = min(total, config.max_steps) if config.max_steps else total
    with _progress_bar(progress and ctx.rank == 0, total, len(samples)) as advance:

        def _on_step(stats: StepStats) -> None:
            ctx.tracker.log_metrics(stats.metrics(), step=stats.step)
            advance(stats)
            if on_step is not None:
                on_step(stats)
            ctx.stopping.check("between optimizer steps", stats.step)

        deadline = prep.prepared + config.time_budget_s if config.time_budget_s else None
        training = train_policy(
            model, samples, prep.reference, config, prep.scorer, ctx.policy.pad_id, rank=ctx.rank, world=world,
            on_step=_on_step, stop_ids=ctx.policy.stop_ids, deadline=deadline,
        )  # fmt: skip
    reached = training.samples_reached
    if reached < len(samples):
        # stopped early: train_policy says why (every process agrees: its checks are all-reduced)
        reason = {
            "max_steps": f"not reached within max_steps={config.max_steps} (visited in a seeded random order)",
            "deadline": over_budget_reason(config),
            "target_kl": over_kl_reason(config),
        }[training.stopped_at]
        # own samples left out are the champion's fresh samples: every logged one fitted the reward model
        key = f"own samples {reason}" if prep.on_own_samples else reason
        ctx.selection.dropped[key] += len(samples) - reached
    return Trained(training.history, reached)


def finalise(ctx: CycleContext, prep: Prepared, trained: Trained) -> Finalised:
    """Round the trained weights as they will be stored, measure their KL to the champion, and gather the metrics."""
    config, policy, selection = ctx.config, ctx.policy, ctx.selection
    samples, logged, history, reached = prep.samples, prep.logged, trained.history, trained.reached
    if config.save_dtype == "bfloat16":
        # Before the KL, so it measures the weights that will be stored and served (a LoRA cycle's adapter
        # alone: the frozen base is stored already, as it is).
        rounded = policy.model if config.update == "full" else _TrainableOnly(policy.model)
        round_parameters_to_bfloat16_(rounded, rounding_seed(config, ctx.champion, selection.window))
    kl = kl_to_reference(policy.model, samples, prep.reference, prep.scorer, policy.pad_id, config.batch_size)
    tokens = sum(len(s.completion_token_ids) for s in samples)
    metrics = {
        "mean_reward": sum(s.reward for s in logged) / len(logged),
        "kl_to_champion": kl,
        "final_loss": history[-1].loss,
        "steps": float(len(history)),
        "samples_eligible": float(len(logged) + selection.dropped.get(over_cap_reason(config), 0)),
        "samples_trained": float(min(reached, len(samples))),
        "train_seconds": time.monotonic() - prep.started,
        "prepare_seconds": prep.prepared - prep.started,
        "prepare_cpu_seconds": prep.prepared_cpu - prep.cpu_started,
        "replay_samples": float(sum(s.replay for s in logged)),
        "tokens": float(tokens),
        **{k: v for k, v in prep.mismatch_metrics.items() if not math.isnan(v)},
        **selection.drop_metrics(),
    }
    kind = f"of {len(samples)} own samples" if prep.on_own_samples else "samples"
    trained_on = f"{min(reached, len(samples))} {kind}"
    if ctx.rank == 0:
        log.info("trained on %s (%d eligible logged) in %.0fs (%.0fs, %.0f CPU-s, of it scoring and sampling before"
                 " the first step); left out of this cycle: %s", trained_on, metrics["samples_eligible"],
                 metrics["train_seconds"], metrics["prepare_seconds"], metrics["prepare_cpu_seconds"],
                 selection.describe_drops())  # fmt: skip
    ctx.tracker.log_metrics(metrics, step=len(history))
    return Finalised(metrics, trained_on)


def register(ctx: CycleContext, prep: Prepared, trained: Trained, done: Finalised) -> str:
    """Store the candidate with its lineage (process 0 alone) and close the MLflow run; its version."""
    config, policy, registry, champion, tracker = ctx.config, ctx.policy, ctx.registry, ctx.champion, ctx.tracker
    steps = len(trained.history)
    lineage = ModelLineage(
        parent_version=champion,
        base=registry.lineage(champion).base,
        trainer_config=config.to_dict(),
        data_window=ctx.selection.window,
        sample_count=len(prep.logged),
        metrics=done.metrics,
        run_id=tracker.run_id,
    )
    with tempfile.TemporaryDirectory(prefix="candidate-", dir=_scratch(ctx.settings)) as tmp:
        policy.model.to(getattr(torch, config.save_dtype))  # exact: rounded above, or an upcast
        if config.update == "lora":
            # The adapter alone (a standard peft directory), naming its base: the champion's base, or the
            # champion itself when it is full weights.
            base_version = policy.adapter.base_version if policy.adapter is not None else champion
            policy.model.save_pretrained(tmp)
            Path(tmp, "README.md").unlink(missing_ok=True)  # peft's model-card stub
            version = registry.register_adapter(Path(tmp), lineage, base_version)
        else:
            policy.save(Path(tmp))
            # Stored as a lossless delta against the champion when the chain allows (model_registry).
            version = registry.register(Path(tmp), lineage)
    artifact = registry.artifact(version)
    tracker.log_metrics({"artifact_stored_bytes": float(artifact.stored_bytes),
                         "artifact_chain_length": float(artifact.chain_length),
                         "artifact_ratio": artifact.checkpoint_bytes / max(artifact.stored_bytes, 1)},
                        step=steps)  # fmt: skip
    tracker.finished(version)
    log.info("registered candidate v%s from v%s on %d logged samples (%s artifact, %d bytes stored)", version,
             champion, len(prep.logged), artifact.kind, artifact.stored_bytes)  # fmt: skip
    return version


def over_budget_reason(config: TrainerConfig) -> str:
    """The `Selection.dropped` reason of samples a cycle did not reach within its time budget: says the rule."""
    return (f"not reached within time_budget_s={config.time_budget_s:g} (visited in a seeded random order, so "
            "the trained ones are a uniform sample)")  # fmt: skip


def over_kl_reason(config: TrainerConfig) -> str:
    """The `Selection.dropped` reason of samples a cycle did not reach because it stopped at `target_kl`."""
    return (f"not reached: stopped at target_kl={config.target_kl:g} nats to the champion (visited in a seeded "
            "random order, so the trained ones are a uniform sample)")  # fmt: skip


def rounding_seed(config: TrainerConfig, champion: str, window: DataWindow | None) -> int:
    """The seed of the candidate's stochastic rounding to bfloat16: `config.seed`, the champion and the data.

    The same cycle rounds the same way (reproducible), and each cycle draws afresh: with the same draws
    every cycle, a weight whose draw is small would round down cycle after cycle, and the small updates
    stochastic rounding is there to keep would be lost for it after all.
    """
    key = f"{config.seed}:{champion}:{window.generation_ids_sha256 if window else ''}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def _score_stoppable(
    model: torch.nn.Module, samples: list[Sample], scorer: Scorer, pad_id: int, batch_size: int, stopping: Stopping
) -> list[list[float]]:
    """`score_samples`, looking at `stop` between chunks of whole batches (so the batches, and the scores, are
    those of one call)."""
    chunk = batch_size * _SCORE_CHUNK_BATCHES
    out: list[list[float]] = []
    for i in range(0, len(samples), chunk):
        stopping.check("while scoring the champion's log-probs")
        out.extend(score_samples(model, samples[i : i + chunk], scorer, pad_id, batch_size))
    return out


class _TrainableOnly(torch.nn.Module):
    """A module whose parameters are `model`'s trainable ones (a LoRA adapter's), for in-place rounding."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self._params = [p for p in model.parameters() if p.requires_grad]

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return iter(self._params)


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int, samples: int) -> Iterator[Callable[[StepStats], None]]:
    if not enabled:
        yield lambda stats: None
        return
    columns = (TextColumn("[bold]training[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}"))  # fmt: skip
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("train", total=total, info=f"{samples} samples")

        def advance(stats: StepStats) -> None:
            info = f"loss {stats.loss:.4f}  kl {stats.kl:.4f}  clip {stats.clip_fraction:.2f}"
            bar.update(task, advance=1, info=info)

        yield advance


def _scratch(settings: Settings) -> Path:
    path = settings.data_dir / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return path
