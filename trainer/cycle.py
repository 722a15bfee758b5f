"""One training cycle: champion + new rewards -> a registered candidate (or a reasoned skip).

Steps: read the champion, its watermark and the quarantine list from the registry, select
eligible samples since the watermark, report train / inference mismatch, train, round the
weights to the stored dtype (`TrainerConfig.save_dtype`), register the candidate with its
lineage. The watermark is the end of the champion's own data window (none for a base model), so
learning accumulates: every candidate trains on all eligible data since its parent champion was
trained, and a candidate that is rejected or still in its A/B test throws away nothing (the next
one sees that data again, plus what came since). It moves only when a candidate is promoted, so a
crash anywhere before registration changes nothing. Every cycle is one MLflow run.

Stopping (`stop`, set by the scheduler on SIGTERM): a cycle asked to stop registers nothing and returns
"stopped", saying how far it got. It looks at `stop` before it trains, between chunks of its scoring of the
champion (`_SCORE_CHUNK_BATCHES` batches), between own-sample prompts and after every optimizer step, so it
ends within one of those units (plus closing its MLflow run, marked KILLED). What it loses is bounded by the
cycle's own computation, nothing of its data: the watermark has not moved, so the next cycle trains on the same
samples and what came since. Loading the champion and selecting samples, and the tail after the last optimizer
step (the KL pass, saving and registering the candidate), are not interrupted: a cycle that has trained to the
end registers.

LoRA (`TrainerConfig.update="lora"`): the cycle trains an adapter on a frozen base instead of every weight:
a fresh one on a full-weights champion (which becomes its base), or the champion's own adapter continued. The
reference log-probs, the mismatch report and the KL are those of the policy, base + adapter, as for full
weights; the candidate registered is the adapter (`ModelRegistry.register_adapter`), naming its base.

Distributed (torchrun): every process selects the same samples and trains on its share of
each batch; process 0 alone logs to MLflow and registers.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal, TypeVar

import torch
import torch.distributed as dist
from mlflow.entities import Metric, Param, RunTag
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flywheel.contract import DataWindow, ModelLineage
from flywheel.lm import Policy, load_policy, round_parameters_to_bfloat16_
from flywheel.settings import Settings
from model_registry import ModelRegistry, ensure_experiment
from trainer.config import TrainerConfig
from trainer.data import Sample, Selection, load_selection, over_cap_reason, quarantined_versions
from trainer.loop import StepStats, kl_to_reference, mismatch_report, score_samples, train_policy
from trainer.retokenize import text_encoder
from trainer.reward_model import CpuBudget, cpu_seconds, own_samples
from trainer.scoring import Scorer, scorer_for

log = logging.getLogger(__name__)
T = TypeVar("T")
TRAINER_EXPERIMENT = "flywheel-trainer"
_METRIC_FLUSH_EVERY = 20
_SCORE_CHUNK_BATCHES = 8  # batches of the champion's scoring between two looks at `stop`


@dataclass(frozen=True)
class CycleResult:
    status: Literal["registered", "skipped", "stopped"]
    reason: str
    version: str | None = None
    parent_version: str | None = None
    sample_count: int = 0
    run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def over_budget_reason(config: TrainerConfig) -> str:
    """The `Selection.dropped` reason of samples a cycle did not reach within its time budget: says the rule."""
    return (f"not reached within time_budget_s={config.time_budget_s:g} (visited in a seeded random order, so "
            "the trained ones are a uniform sample)")  # fmt: skip


def over_kl_reason(config: TrainerConfig) -> str:
    """The `Selection.dropped` reason of samples a cycle did not reach because it stopped at `target_kl`."""
    return (f"not reached: stopped at target_kl={config.target_kl:g} nats to the champion (visited in a seeded "
            "random order, so the trained ones are a uniform sample)")  # fmt: skip


def watermark(registry: ModelRegistry, champion: str) -> datetime | None:
    """End of the data window `champion` was trained on: where its successor's new data starts (None: all)."""
    window = registry.lineage(champion).data_window
    return window.end if window else None


def run_cycle(
    settings: Settings,
    config: TrainerConfig | None = None,
    *,
    progress: bool = True,
    on_step: Callable[[StepStats], None] | None = None,
    stop: threading.Event | None = None,
) -> CycleResult:
    """Train one candidate from the champion on the rewards since the champion's data window and register it.

    Under torchrun, process 0 decides (champion, samples, or a skip) and sends the plan to the
    others, so every process trains on exactly the same samples or skips together. `stop` set meanwhile ends
    the cycle early with nothing registered (the module docstring says where it looks and what is lost).
    """
    config = config or TrainerConfig()
    rank, world = distributed_rank_world()
    torch.manual_seed(config.seed)
    registry = ModelRegistry(settings)
    plan: tuple[str | None, Selection | None, str] = (None, None, "")
    policy = None
    if rank == 0:
        plan, policy = _plan(settings, config, registry)
    champion, selection, reason = broadcast_from_zero(plan, world)
    if champion is None or selection is None:
        return CycleResult("skipped", reason, parent_version=champion)
    if policy is None:  # other processes: process 0 has verified and cached the checkpoint
        policy = _load_champion(registry, champion, config)
    prepare_update(policy, config)
    tracker = _Tracker(settings, config, champion, selection.window.start if selection.window else None,
                       enabled=rank == 0)  # fmt: skip
    try:
        result = _train_and_register(
            settings, config, registry, policy, selection, champion, tracker, rank, world, progress, on_step,
            _Stopping(stop, policy.model, world),
        )  # fmt: skip
    except CycleStopped as stopped:
        reason = (f"stopped on request {stopped.where}, after {stopped.steps} optimizer steps; nothing registered"
                  f" (the watermark is unchanged: the next cycle trains on these {len(selection.samples)} samples"
                  " and what came since)")  # fmt: skip
        tracker.stopped(reason)
        log.warning("trainer cycle %s", reason, extra={"steps": stopped.steps})
        return CycleResult("stopped", reason, parent_version=champion, sample_count=len(selection.samples),
                           run_id=tracker.run_id, metrics={"steps": float(stopped.steps)})  # fmt: skip
    except BaseException as exc:
        tracker.failed(exc)
        raise
    return result


class CycleStopped(Exception):
    """The cycle's `stop` was set: raised where it looked, caught by `run_cycle`."""

    def __init__(self, where: str, steps: int) -> None:
        super().__init__(f"stopped {where}")
        self.where, self.steps = where, steps


class _Stopping:
    """Whether the cycle's `stop` is set, agreed by every process (they must all stop at the same point)."""

    def __init__(self, stop: threading.Event | None, model: torch.nn.Module, world: int) -> None:
        self._stop, self._model, self._world = stop, model, world

    def __call__(self) -> bool:
        if self._stop is None:
            return False
        if self._world == 1:
            return self._stop.is_set()
        return _any_process(self._stop.is_set(), self._model)

    def check(self, where: str, steps: int = 0) -> None:
        if self():
            raise CycleStopped(where, steps)


def _score_stoppable(
    model: torch.nn.Module, samples: list[Sample], scorer: Scorer, pad_id: int, batch_size: int, stopping: _Stopping
) -> list[list[float]]:
    """`score_samples`, looking at `stop` between chunks of whole batches (so the batches, and the scores, are
    those of one call)."""
    chunk = batch_size * _SCORE_CHUNK_BATCHES
    out: list[list[float]] = []
    for i in range(0, len(samples), chunk):
        stopping.check("while scoring the champion's log-probs")
        out.extend(score_samples(model, samples[i : i + chunk], scorer, pad_id, batch_size))
    return out


def select_samples(
    settings: Settings, config: TrainerConfig, registry: ModelRegistry, champion: str, policy: Policy
) -> Selection:
    """What a cycle from `champion` (loaded as `policy`) trains on: eligible samples since its data window."""
    return load_selection(
        settings, config, watermark=watermark(registry, champion), quarantined=quarantined_versions(registry),
        encode_prompt=lambda text: policy.encode_prompt(text, max_tokens=1), encode_text=text_encoder(policy),
    )  # fmt: skip


def _plan(
    settings: Settings, config: TrainerConfig, registry: ModelRegistry
) -> tuple[tuple[str | None, Selection | None, str], Policy | None]:
    """(champion, selection, "") to train, or (champion or None, None, reason) to skip."""
    champion = registry.alias("champion")
    if champion is None:
        return (None, None, "no champion: register a model and set the 'champion' alias first"), None
    mark = watermark(registry, champion)
    policy = _load_champion(registry, champion, config)
    selection = select_samples(settings, config, registry, champion, policy)
    minimum = config.min_samples if config.min_samples is not None else settings.min_train_samples
    if len(selection.samples) < minimum:
        reason = (
            f"too little new data: {len(selection.samples)} eligible samples since "
            f"{mark.isoformat() if mark else 'the beginning'}, need {minimum} "
            f"({selection.reward_rows} new rewards; left out: {selection.describe_drops()})"
        )
        _Tracker(settings, config, champion, mark, enabled=True).skipped(reason)
        log.info("trainer cycle skipped: %s", reason)
        return (champion, None, reason), None
    return (champion, selection, ""), policy


def _load_champion(registry: ModelRegistry, champion: str, config: TrainerConfig) -> Policy:
    """The champion as the cycle trains it: a LoRA champion with its adapter trainable under update="lora"."""
    return load_policy(registry.fetch(champion), device=_local_device(config.device), dtype=config.dtype,
                       trainable=config.update == "lora")  # fmt: skip


def prepare_update(policy: Policy, config: TrainerConfig) -> None:
    """Make `policy` train what `config.update` says, before anything scores it.

    "lora" on full weights: a fresh adapter (peft zero-initialises B, so base + adapter computes exactly what
    the base did; the reference log-probs are unchanged). "full" on an adapter: merged into the base (the
    mismatch report then measures the merged weights against serving's unmerged ones). Otherwise nothing.
    """
    if config.update == "lora" and policy.adapter is None:
        from peft import get_peft_model

        policy.model = get_peft_model(policy.model, config.lora_config())  # type: ignore[arg-type]
        policy.model.eval()
    elif config.update == "full" and policy.adapter is not None:
        policy.model = policy.model.merge_and_unload()  # type: ignore[operator]
        policy.model.requires_grad_(True)  # peft froze the base when it loaded the adapter
        policy.adapter = None


def _train_and_register(
    settings: Settings,
    config: TrainerConfig,
    registry: ModelRegistry,
    policy: Policy,
    selection: Selection,
    champion: str,
    tracker: _Tracker,
    rank: int,
    world: int,
    progress: bool,
    on_step: Callable[[StepStats], None] | None,
    stopping: _Stopping,
) -> CycleResult:
    samples = selection.samples
    scorer = scorer_for(config.exact_logprobs)
    started, cpu_started = time.monotonic(), cpu_seconds()
    # The starting weights are the champion: their log-probs are both the KL reference and the
    # trainer's side of the train / inference comparison (with the scorer training uses).
    reference = _score_stoppable(policy.model, samples, scorer, policy.pad_id, config.batch_size, stopping)
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
    if rank == 0:
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
        spent = budget.exhausted if world == 1 else lambda: _any_process(budget.exhausted(), policy.model)
        own = own_samples(policy, logged, reference, config, scorer, budget=budget,
                          stop=lambda: spent() or stopping())  # fmt: skip
        stopping.check("while sampling its own samples")
        own_note = own.note
        if own.fresh:
            samples, reference = own.samples, own.reference
        tracker.log_metrics(own.metrics(), step=0)
        if rank == 0:
            log.info("%s", own_note)
    # The time budget bounds the optimisation: the scoring and sampling before it grow with the cycle's data and
    # the machine's load, and counted in, they could leave it a single step (seen in `flywheel up`).
    prepared, prepared_cpu = time.monotonic(), cpu_seconds()
    model: torch.nn.Module = policy.model
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    steps_per_epoch = math.ceil(len(samples) / (config.batch_size * world))
    total = steps_per_epoch * config.epochs
    total = min(total, config.max_steps) if config.max_steps else total
    with _progress_bar(progress and rank == 0, total, len(samples)) as advance:

        def _on_step(stats: StepStats) -> None:
            tracker.log_metrics(stats.metrics(), step=stats.step)
            advance(stats)
            if on_step is not None:
                on_step(stats)
            stopping.check("between optimizer steps", stats.step)

        deadline = prepared + config.time_budget_s if config.time_budget_s else None
        training = train_policy(
            model, samples, reference, config, scorer, policy.pad_id, rank=rank, world=world, on_step=_on_step,
            stop_ids=policy.stop_ids, deadline=deadline,
        )  # fmt: skip
    history, reached = training.history, training.samples_reached
    if reached < len(samples):
        # stopped early: train_policy says why (every process agrees: its checks are all-reduced)
        reason = {
            "max_steps": f"not reached within max_steps={config.max_steps} (visited in a seeded random order)",
            "deadline": over_budget_reason(config),
            "target_kl": over_kl_reason(config),
        }[training.stopped_at]
        # own samples left out are the champion's fresh samples: every logged one fitted the reward model
        selection.dropped[reason if samples is logged else f"own samples {reason}"] += len(samples) - reached
    if config.save_dtype == "bfloat16":
        # Before the KL, so it measures the weights that will be stored and served (a LoRA cycle's adapter
        # alone: the frozen base is stored already, as it is).
        trained = policy.model if config.update == "full" else _TrainableOnly(policy.model)
        round_parameters_to_bfloat16_(trained, rounding_seed(config, champion, selection.window))
    kl = kl_to_reference(policy.model, samples, reference, scorer, policy.pad_id, config.batch_size)
    tokens = sum(len(s.completion_token_ids) for s in samples)
    metrics = {
        "mean_reward": sum(s.reward for s in logged) / len(logged),
        "kl_to_champion": kl,
        "final_loss": history[-1].loss,
        "steps": float(len(history)),
        "samples_eligible": float(len(logged) + selection.dropped.get(over_cap_reason(config), 0)),
        "samples_trained": float(min(reached, len(samples))),
        "train_seconds": time.monotonic() - started,
        "prepare_seconds": prepared - started,
        "prepare_cpu_seconds": prepared_cpu - cpu_started,
        "replay_samples": float(sum(s.replay for s in logged)),
        "tokens": float(tokens),
        **{k: v for k, v in mismatch_metrics.items() if not math.isnan(v)},
        **selection.drop_metrics(),
    }
    kind = "samples" if samples is logged else f"of {len(samples)} own samples"
    trained_on = f"{min(reached, len(samples))} {kind}"
    if rank == 0:
        log.info("trained on %s (%d eligible logged) in %.0fs (%.0fs, %.0f CPU-s, of it scoring and sampling before"
                 " the first step); left out of this cycle: %s", trained_on, metrics["samples_eligible"],
                 metrics["train_seconds"], metrics["prepare_seconds"], metrics["prepare_cpu_seconds"],
                 selection.describe_drops())  # fmt: skip
    tracker.log_metrics(metrics, step=len(history))
    if rank != 0:
        _barrier(world)
        return CycleResult("registered", "trained (process 0 registers)", parent_version=champion,
                           sample_count=len(logged), metrics=metrics)  # fmt: skip
    lineage = ModelLineage(
        parent_version=champion,
        base=registry.lineage(champion).base,
        trainer_config=config.to_dict(),
        data_window=selection.window,
        sample_count=len(logged),
        metrics=metrics,
        run_id=tracker.run_id,
    )
    with tempfile.TemporaryDirectory(prefix="candidate-", dir=_scratch(settings)) as tmp:
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
                        step=len(history))  # fmt: skip
    tracker.finished(version)
    _barrier(world)
    log.info("registered candidate v%s from v%s on %d logged samples (%s artifact, %d bytes stored)", version,
             champion, len(logged), artifact.kind, artifact.stored_bytes)  # fmt: skip
    detail = f"; {own_note}" if own_note else ""
    return CycleResult(
        "registered", f"trained on {trained_on}; left out: {selection.describe_drops()}{detail}",
        version=version, parent_version=champion,
        sample_count=len(logged), run_id=tracker.run_id, metrics=metrics,
    )  # fmt: skip


class _TrainableOnly(torch.nn.Module):
    """A module whose parameters are `model`'s trainable ones (a LoRA adapter's), for in-place rounding."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self._params = [p for p in model.parameters() if p.requires_grad]

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return iter(self._params)


class _Tracker:
    """The cycle's MLflow run (process 0 only); metrics are buffered and sent in batches."""

    def __init__(self, settings: Settings, config: TrainerConfig, champion: str, mark: datetime | None,
                 *, enabled: bool) -> None:  # fmt: skip
        self.run_id: str | None = None
        self._pending: list[Metric] = []
        if not enabled:
            return
        self._client = ModelRegistry(settings).client
        exp = ensure_experiment(self._client, settings, TRAINER_EXPERIMENT)
        tags = {"flywheel.parent_version": champion, "flywheel.watermark": mark.isoformat() if mark else ""}
        run = self._client.create_run(exp, run_name=f"cycle from v{champion}", tags=tags)
        self.run_id = run.info.run_id
        params = [Param(k, str(v)) for k, v in config.to_dict().items()]
        self._client.log_batch(self.run_id, params=params)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        if self.run_id is None:
            return
        now = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), now, step) for k, v in values.items() if not math.isnan(v))
        if len(self._pending) >= _METRIC_FLUSH_EVERY * 8:
            self.flush()

    def flush(self) -> None:
        if self.run_id is not None and self._pending:
            for i in range(0, len(self._pending), 900):  # MLflow caps one batch at 1000 metrics
                self._client.log_batch(self.run_id, metrics=self._pending[i : i + 900])
            self._pending = []

    def skipped(self, reason: str) -> None:
        if self.run_id is None:
            return
        self._client.log_batch(self.run_id, tags=[RunTag("flywheel.status", "skipped"),
                                                  RunTag("flywheel.reason", reason[:4000])])  # fmt: skip
        self._client.set_terminated(self.run_id, "FINISHED")

    def finished(self, version: str) -> None:
        if self.run_id is None:
            return
        self.flush()
        self._client.log_batch(self.run_id, tags=[RunTag("flywheel.status", "registered"),
                                                  RunTag("flywheel.version", version)])  # fmt: skip
        self._client.set_terminated(self.run_id, "FINISHED")

    def stopped(self, reason: str) -> None:
        if self.run_id is None:
            return
        with contextlib.suppress(Exception):  # stopping must not wait on a registry that does not answer
            self.flush()
            self._client.log_batch(self.run_id, tags=[RunTag("flywheel.status", "stopped"),
                                                      RunTag("flywheel.reason", reason[:4000])])  # fmt: skip
            self._client.set_terminated(self.run_id, "KILLED")

    def failed(self, exc: BaseException) -> None:
        if self.run_id is None:
            return
        with contextlib.suppress(Exception):  # report the original error, not a logging failure
            self.flush()
            self._client.set_tag(self.run_id, "flywheel.status", "failed")
            self._client.set_tag(self.run_id, "flywheel.reason", f"{type(exc).__name__}: {exc}"[:4000])
            self._client.set_terminated(self.run_id, "FAILED")


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


def rounding_seed(config: TrainerConfig, champion: str, window: DataWindow | None) -> int:
    """The seed of the candidate's stochastic rounding to bfloat16: `config.seed`, the champion and the data.

    The same cycle rounds the same way (reproducible), and each cycle draws afresh: with the same draws
    every cycle, a weight whose draw is small would round down cycle after cycle, and the small updates
    stochastic rounding is there to keep would be lost for it after all.
    """
    key = f"{config.seed}:{champion}:{window.generation_ids_sha256 if window else ''}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def distributed_rank_world() -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group (gloo on CPU, NCCL on CUDA) under torchrun."""
    if not (dist.is_available() and dist.is_initialized()):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and dist.is_available():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        else:
            return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _local_device(device: str) -> str:
    if device == "cuda" and dist.is_available() and dist.is_initialized():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def broadcast_from_zero(obj: T, world: int) -> T:
    """Process 0's `obj` on every process (identity when not distributed)."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _any_process(flag: bool, model: torch.nn.Module) -> bool:
    """Whether `flag` holds on any process: every process must stop sampling at the same prompt, or they would
    train on different samples (and DDP would hang)."""
    out = torch.tensor([float(flag)], device=next(model.parameters()).device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return bool(out.item())


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _scratch(settings: Settings) -> Path:
    path = settings.data_dir / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return path
