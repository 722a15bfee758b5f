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
champion (8 batches, `trainer.phases`), between own-sample prompts and after every optimizer step, so it
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

Rooms: this module plans a cycle (champion, samples, or a skip) and runs it; `trainer.phases` holds the phases of
a cycle that trains (prepare, optimise, finalise, register), `trainer.tracking` its MLflow run and
`trainer.distributed` what the processes of a torchrun cycle share.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

import torch

from flywheel.lm import Policy, load_policy
from flywheel.settings import Settings
from model_registry import ModelRegistry
from trainer.config import TrainerConfig
from trainer.data import Selection, load_selection, quarantined_versions
from trainer.distributed import barrier, broadcast_from_zero, distributed_rank_world, local_device
from trainer.loop import StepStats
from trainer.phases import CycleContext, CycleStopped, Stopping, finalise, optimise, prepare, register, rounding_seed
from trainer.retokenize import text_encoder
from trainer.tracking import TRAINER_EXPERIMENT, CycleTracker

# `rounding_seed` and `TRAINER_EXPERIMENT` live in the phases and the tracker; named here as well, where a cycle's
# reader looks for them first.
__all__ = ["TRAINER_EXPERIMENT", "CycleResult", "prepare_update", "rounding_seed", "run_cycle", "select_samples",
           "watermark"]  # fmt: skip
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CycleResult:
    status: Literal["registered", "skipped", "stopped"]
    reason: str
    version: str | None = None
    parent_version: str | None = None
    sample_count: int = 0
    run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


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
    tracker = CycleTracker(settings, config, champion, selection.window.start if selection.window else None,
                           enabled=rank == 0)  # fmt: skip
    ctx = CycleContext(settings, config, registry, policy, selection, champion, tracker,
                       Stopping(stop, policy.model, world), rank=rank, world=world)  # fmt: skip
    try:
        return _train_and_register(ctx, progress=progress, on_step=on_step)
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


def _train_and_register(
    ctx: CycleContext, *, progress: bool, on_step: Callable[[StepStats], None] | None
) -> CycleResult:
    """The phases in order (`trainer.phases`); process 0 registers while the others wait for it."""
    prepared = prepare(ctx)
    trained = optimise(ctx, prepared, progress=progress, on_step=on_step)
    done = finalise(ctx, prepared, trained)
    sample_count = len(prepared.logged)
    if ctx.rank != 0:
        barrier(ctx.world)
        return CycleResult("registered", "trained (process 0 registers)", parent_version=ctx.champion,
                           sample_count=sample_count, metrics=done.metrics)  # fmt: skip
    version = register(ctx, prepared, trained, done)
    barrier(ctx.world)
    detail = f"; {prepared.own_note}" if prepared.own_note else ""
    return CycleResult(
        "registered", f"trained on {done.trained_on}; left out: {ctx.selection.describe_drops()}{detail}",
        version=version, parent_version=ctx.champion,
        sample_count=sample_count, run_id=ctx.tracker.run_id, metrics=done.metrics,
    )  # fmt: skip


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
        CycleTracker(settings, config, champion, mark, enabled=True).skipped(reason)
        log.info("trainer cycle skipped: %s", reason)
        return (champion, None, reason), None
    return (champion, selection, ""), policy


def _load_champion(registry: ModelRegistry, champion: str, config: TrainerConfig) -> Policy:
    """The champion as the cycle trains it: a LoRA champion with its adapter trainable under update="lora"."""
    return load_policy(registry.fetch(champion), device=local_device(config.device), dtype=config.dtype,
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
