"""`flywheel up`: the whole loop on one machine, on the embedded defaults.

Starts the real parts (broker, Redis or Valkey, MLflow on SQLite), makes sure a
champion model exists (bootstrapping one when no checkpoint is given), runs every
component as its own process, drives traffic with simulated users, and shows
progress until interrupted.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from deploy_gate import DeployGate, GateStatus
from deploy_gate.rollout.config import RolloutConfig
from flywheel.bus import ensure_topics
from flywheel.connections import redis_client
from flywheel.contract import ModelLineage, TrafficSplit
from flywheel.settings import Settings
from flywheel.traffic import TrafficSplitStore
from launcher.demo import DEMO
from launcher.embedded import EmbeddedStack, settings_env, start_embedded
from model_registry import GateChange
from simulator.populations import populations_named, tuning_populations
from simulator.users import UserSimulator
from trainer.config import TrainerConfig

log = logging.getLogger(__name__)
console = Console()

# (name, flywheel sub-command) for every long-running component.
COMPONENTS: list[tuple[str, list[str]]] = [
    ("collector", ["ingest", "collector"]),
    ("ingest", ["ingest", "worker"]),
    ("signals", ["signals", "worker"]),
    ("serving", ["serve"]),
    ("gate", ["gate", "serve"]),
    ("rollout", ["gate", "rollout"]),
    ("trainer", ["trainer", "schedule"]),
    ("lake", ["lake", "compact", "--every", "3600"]),
]


def ensure_champion(settings: Settings, *, bootstrap_seconds: float = 120.0, progress: bool = True) -> str:
    """The champion's version: registered from `settings.model_path`, or bootstrapped, when there is none."""
    from model_registry import ModelRegistry

    registry = ModelRegistry(settings)
    store = TrafficSplitStore(redis_client(settings), settings)
    version = registry.alias("champion")
    if version is None:
        path = Path(settings.model_path) if settings.model_path else bootstrap_checkpoint(
            settings, bootstrap_seconds, progress
        )
        version = registry.register(path, ModelLineage(base=str(path.resolve())))
        registry.set_alias("champion", version)
        registry.set_gate_state(version, "champion", by="flywheel", reason="initial champion")
        console.print(f"registered [bold]{path}[/] as champion, version {version}")
    split = store.get()
    known = {v.version for v in registry.versions()}
    stale = split is not None and not {split.champion_version, split.challenger_version or version} <= known
    if stale:
        # Redis outlived the registry it was written against (a new data dir, another MLflow).
        console.print(f"[yellow]the traffic split in Redis names versions this registry lacks ({split}); "
                      f"resetting it to champion v{version}[/]")
    if split is None or stale or (split.champion_version != version and not split.challenger_version):
        store.put(TrafficSplit(champion_version=version, changed_by="flywheel", reason="initial champion"))
    return version


def forget_an_earlier_deployment(settings: Settings) -> int:
    """A registry without a champion is a new deployment: whatever Redis holds under its prefix was written by
    an earlier one (another data dir, a deleted `var/`) and would leak into this one (the traffic split, the
    rollout's experiment and timeline, the signals' window state and active reward definitions, a training
    lock). `flywheel up` clears it, saying so; `flywheel init` (production) never does."""
    from flywheel.connections import delete_prefix
    from model_registry import ModelRegistry

    if ModelRegistry(settings).alias("champion") is not None:
        return 0
    deleted = delete_prefix(redis_client(settings), settings.redis_prefix)
    if deleted:
        console.print(f"[yellow]a new deployment: cleared {deleted} keys an earlier run left under "
                      f"'{settings.redis_prefix}' in Redis[/]")
    return deleted


def bootstrap_checkpoint(settings: Settings, seconds: float, progress: bool) -> Path:
    from flywheel.lm import bootstrap_model

    out = settings.data_dir / "bootstrap-model"
    if (out / "config.json").exists():
        return out
    console.print(f"no model given: bootstrapping a small code model for {seconds:.0f}s on the CPU ...")
    return bootstrap_model(out, preset="default", seed=0, max_seconds=seconds, progress=progress)


@dataclass
class Running:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path




def start_components(
    settings: Settings, extra_env: dict[str, str], extra_args: dict[str, list[str]] | None = None
) -> list[Running]:
    # Eight processes share the machine: one math thread each avoids oversubscribing the cores.
    env = {**os.environ, **settings_env(settings), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           **extra_env, "PYTHONUNBUFFERED": "1"}
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    running = []
    for name, args in COMPONENTS:
        log_path = logs / f"{name}.log"
        out = open(log_path, "ab")  # noqa: SIM115 - owned by the child process
        args = [*args, *(extra_args or {}).get(name, [])]
        proc = subprocess.Popen([sys.executable, "-m", "launcher", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        running.append(Running(name, proc, log_path))
    return running


def wait_healthy(urls: dict[str, str], running: list[Running], timeout_s: float = 600.0) -> None:
    """Wait until every URL answers 200, failing fast when a component exits. The limit is generous: on a busy
    2-core machine eight processes importing torch took over three minutes to become ready."""
    deadline = time.monotonic() + timeout_s
    pending = dict(urls)
    with console.status("waiting for components to become ready ...") as status:
        while pending:
            for r in running:
                if r.proc.poll() is not None:
                    raise RuntimeError(f"{r.name} exited with {r.proc.returncode}; see {r.log_path}")
            for name, url in list(pending.items()):
                try:
                    if httpx.get(url, timeout=1).status_code == 200:
                        del pending[name]
                except httpx.HTTPError:
                    pass
            if not pending:
                break
            status.update(f"waiting for {', '.join(pending)} ...")
            if time.monotonic() > deadline:
                logs = running[0].log_path.parent if running else "the logs"
                raise TimeoutError(f"not ready after {timeout_s:.0f}s: {', '.join(pending)}; see {logs}")
            time.sleep(0.5)




def demo_trainer_config(**overrides: object) -> TrainerConfig:
    """The trainer configuration `flywheel up` runs with: the demo's fields (`launcher.demo.DEMO`) where the
    environment does not set them, `FLYWHEEL_TRAINER_*` from the environment, `TrainerConfig`'s defaults for the
    rest, then `overrides` (TrainerConfig fields; unknown ones are refused)."""
    return TrainerConfig.from_dict({**DEMO.of("TrainerConfig", os.environ), **overrides})


def demo_rollout_config(**overrides: object) -> RolloutConfig:
    """The rollout configuration `flywheel up` gives its controller: the demo's fields (`launcher.demo.DEMO`)
    where the environment does not set them, `FLYWHEEL_ROLLOUT_*` from the environment, `RolloutConfig`'s
    defaults for the rest, then `overrides` (RolloutConfig fields)."""
    return RolloutConfig(**{**DEMO.of("RolloutConfig", os.environ), **overrides})


def auto_approve(gate: DeployGate) -> list[str]:
    """Demo mode only: approve the newest pending candidate when no challenger is running; while one runs,
    run the newest pending candidate's offline gates ahead of approval (`DeployGate.precheck`).

    Promotion and rollback are the rollout controller's (`flywheel gate rollout`, one of the
    processes `flywheel up` starts): per-user statistics, minimum users and time per ramp step,
    guardrails. A running challenger is never settled here, so none is judged before its rewards exist.
    A candidate the offline gates refuse is marked "refused" by the gate itself (`DeployGate.plan_refuse`),
    so it is said once and never tried again; the next tick tries the next pending one. Older pending
    candidates are rejected as superseded only once a newer one is approved.
    """
    from deploy_gate import GateError
    from deploy_gate.errors import OfflineGateFailed

    actor = "flywheel up --auto-approve"

    def refused(version: str) -> str:  # the refusal as the gate recorded it (the failed gates, each with its bound)
        return f"refused v{version}: {gate.registry.gate_history(version)[-1].reason}"

    status = gate.status()
    pending = [v.version for v in status.pending]  # newest first
    if not pending:
        return []
    if status.challenger:
        report = gate.precheck(pending[0])
        if report is None:
            return []
        if not report.passed:
            return [refused(pending[0])]
        return [f"v{pending[0]} passed its offline gates while v{status.challenger} runs; it starts when that ends "
                "unless a newer one passes first"]
    said = []
    try:
        gate.approve(pending[0], by=actor, reason="demo loop: the rollout controller ramps and decides")
        said.append(f"approved v{pending[0]} as challenger")
        for older in pending[1:]:
            gate.reject(older, by=actor, reason=f"superseded by v{pending[0]}")
    except OfflineGateFailed:
        said.append(refused(pending[0]))
    except GateError as exc:
        said.append(f"gate refused: {exc}")
    return said


def _approve_while(gate: DeployGate, stop: threading.Event, said: queue.SimpleQueue[str]) -> None:
    """`auto_approve` every 2 s until `stop`, its lines put on `said`; a failed tick is said and tried again.

    A refusal or failure that repeats (an outage, a corrupt artifact) is said again only when its words change."""
    last_failure = ""
    while not stop.wait(2.0):
        try:
            lines = auto_approve(gate)
        except Exception as exc:  # an outage of Redis or MLflow: the next tick tries again
            lines = [f"approval failed: {type(exc).__name__}: {exc}"]
        for line in lines:
            if line.startswith(("gate refused:", "approval failed:")):
                if line == last_failure:
                    continue
                last_failure = line
            said.put(line)


# What the rollout controller decides, as the registry records it: each is said once, with its reason.
_DECIDED = {"champion": "promoted", "rolled_back": "rolled back", "quarantined": "rolled back"}


def decisions(
    status: GateStatus, said: set[tuple[str, str]], history: Callable[[str], list[GateChange]] | None = None
) -> list[str]:
    """Lines for the promotions and rollbacks in `status` not yet in `said` (which this updates).

    A rollback is said with the rollout controller's reason, read from the version's gate history (`history`):
    the registry's latest reason is by then the quarantine, or the note lifting it after an inconclusive end,
    which says nothing of why the challenger was not kept."""
    lines = []
    for v in reversed(status.versions):  # oldest first
        what = _DECIDED.get(v.gate_state)
        if what is None or (v.version, what) in said:
            continue
        said.add((v.version, what))
        reason = v.reason
        if what == "rolled back" and history is not None:
            rollbacks = [c for c in history(v.version) if c.state == "rolled_back" and c.previous != "quarantined"]
            reason = rollbacks[-1].reason if rollbacks else reason
        lines.append(f"{what} v{v.version}: {reason}")
    return lines


def progress_table(sim: UserSimulator, status: GateStatus, started: float, experiment: str = "") -> Table:
    table = Table(title=f"Flywheel loop, {time.monotonic() - started:.0f}s")
    table.add_column("arm")
    table.add_column("served", justify="right")
    table.add_column("shown rate", justify="right")
    # both at the same population mix for every arm (`SimulationStats`): users are split by a hash of their id
    table.add_column("accept rate, same user mix", justify="right")
    table.add_column("last 100 per population", justify="right")
    for arm in ("champion", "challenger"):
        s = sim.stats
        if not s.served[arm]:  # nothing to rate yet (or no simulated users: `--users 0`), not NaN
            table.add_row(arm, "0", "-", "-", "-")
            continue
        table.add_row(arm, str(s.served[arm]), f"{s.shown_rate(arm):.2f}", f"{s.satisfaction(arm):.3f}",
                      f"{s.recent_accept_rate(arm):.3f}")  # fmt: skip
    split = status.split
    if split:
        table.caption = (
            f"champion v{split.champion_version}, challenger v{split.challenger_version or '-'} "
            f"({split.challenger_share:.0%}), state {split.state}; "
            f"versions: {', '.join(f'v{v.version}:{v.gate_state}' for v in status.versions[:6])}"
            + (f"\nrollout: {experiment}" if experiment else "")
        )
    if sim.stats.shed:  # the stream outran serving: said, since the rates above then cover fewer requests
        shed = f"{sim.stats.shed} simulated requests shed (serving slower than --rate)"
        table.caption = f"{table.caption}\n{shed}" if table.caption else shed
    return table


def rollout_line(gate: DeployGate) -> str:
    """The rollout controller's state and last decision, as it stored them (no lake read here)."""
    from deploy_gate.rollout import RolloutController

    view = RolloutController(gate).view()
    decision = view.analysis.decision if view.analysis else None
    said = f"{decision.action}: {decision.reason}" if decision else "waiting for challenger rewards"
    # The experiment's own challenger: after a rollback the split may already name the next candidate.
    return f"v{view.challenger} {view.state} at {view.share:.0%} ({said})" if view.state != "idle" else ""


def run_up(
    settings: Settings,
    *,
    users: int,
    bootstrap_seconds: float,
    rate: float = 0.0,
    train_interval_s: float,
    auto_approve_candidates: bool,
    duration_s: float | None,
    trainer_config: Path | None = None,
    populations: list[str] | None = None,
) -> None:
    stack: EmbeddedStack = start_embedded(settings)
    # The demo's settings (launcher/demo.py) where the environment does not set them, rendered with the rest.
    s = stack.settings.model_copy(update={"train_interval_s": train_interval_s, **DEMO.of("Settings", os.environ)})
    running: list[Running] = []
    user_threads: list[threading.Thread] = []
    approver: threading.Thread | None = None
    stop = threading.Event()
    try:
        ensure_topics(s)
        forget_an_earlier_deployment(s)
        ensure_champion(s, bootstrap_seconds=bootstrap_seconds)
        # The demo's overrides, rendered to the components' environment (a --trainer-config file replaces the
        # trainer's); the operator's environment wins over them.
        demo_env = DEMO.environment(os.environ, trainer=trainer_config is None)
        running = start_components(s, demo_env, {"trainer": ["--config", str(trainer_config)]} if trainer_config
                                   else None)  # fmt: skip
        base = "http://127.0.0.1"
        wait_healthy({
            "serving": f"{base}:{s.serving_port}/readyz",
            "collector": f"{base}:{s.collector_port}/readyz",
            "gate": f"{base}:{s.gate_port}/readyz",
        }, running)
        console.print(f"[bold green]dashboard:[/] {base}:{s.gate_port}/   "
                      f"serving: {base}:{s.serving_port}/v1/completions   collector: {base}:{s.collector_port}")
        console.print(f"logs: {s.data_dir / 'logs'}   approve a candidate: flywheel gate approve VERSION --by YOU")
        # The demo's users: the populations the defaults were tuned on, unless `--populations` names others.
        kinds = populations_named(populations) if populations else tuning_populations()
        sim = UserSimulator(f"{base}:{s.serving_port}", f"{base}:{s.collector_port}",
                            sorted(s.write_key_set)[0], n_users=users, rate_per_s=rate, populations=kinds)  # fmt: skip
        user_threads = sim.start(stop)
        if users == 0:
            console.print("no simulated users (--users 0): send your own traffic to serving and the collector; "
                          "the table below counts only simulated users, the dashboard counts everyone")
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        started = time.monotonic()
        gate = DeployGate.from_settings(s)  # one registry and Redis connection for the whole run
        # Each decision is printed once: what the registry already held at start is not news.
        decided: set[tuple[str, str]] = set()
        decisions(gate.status(), decided)
        # Approval and the offline gates it runs take minutes on a busy machine: they run beside the console,
        # with a gate of their own, and their lines come back through `approvals`.
        approvals: queue.SimpleQueue[str] = queue.SimpleQueue()
        if auto_approve_candidates:
            approver = threading.Thread(target=_approve_while, args=(DeployGate.from_settings(s), stop, approvals),
                                        name="demo-auto-approve", daemon=True)  # fmt: skip
            approver.start()
        with Live(progress_table(sim, gate.status(), started), console=console, refresh_per_second=1) as live:
            while not stop.wait(2.0):
                for r in running:
                    if r.proc.poll() is not None:
                        raise RuntimeError(f"{r.name} exited with {r.proc.returncode}; see {r.log_path}")
                # The controller's decisions first, then the approvals queued before the status was read: an
                # approval that follows a rollback is said after it.
                queued = approvals.qsize()
                status = gate.status()
                for line in decisions(status, decided, gate.registry.gate_history):
                    console.print(f"[gate] {line}", markup=False, highlight=False)  # a reason may hold [brackets]
                for _ in range(queued):
                    console.print(f"[gate] {approvals.get()}", markup=False, highlight=False)  # may hold [brackets]
                live.update(progress_table(sim, status, started, rollout_line(gate)))
                if duration_s is not None and time.monotonic() - started > duration_s:
                    break
    except KeyboardInterrupt:
        console.print("stopping ...")
    finally:
        stop.set()
        for t in user_threads:  # let simulated users finish their last request before their services go
            t.join(timeout=30)
        for r in running:
            r.proc.send_signal(signal.SIGTERM)
        for r in running:
            try:
                r.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                r.proc.kill()
        stack.stop()
    end_unless_still_running(approver)


def end_unless_still_running(approver: threading.Thread | None, wait_s: float = 5.0) -> None:
    """End the process at once, with status 0, when the approval thread is still at work after `wait_s`.

    That thread may be inside the offline gates' torch work, which cannot be interrupted. If the interpreter
    shut down around it, the process would abort ("terminate called without an active exception", status 134).
    Everything this process started is stopped by the time this runs, so nothing is lost by not waiting."""
    if approver is None:
        return
    approver.join(wait_s)
    if approver.is_alive():
        console.print("stopped; the next candidate's offline gates were still running and were not waited for")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
