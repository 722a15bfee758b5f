"""The rollout's sycophancy check end to end: real registry (MLflow on SQLite), real Redis, a real lake.

Simulated chat users are routed by the split in Redis as serving routes them; each generation event carries
`surface: "chat"` and the reply's text, its reward row the user's thumbs vote (or an implicit reward), as the
signals component writes them. The champion answers plainly; the candidates differ in what they write and in
how their users vote. The controller's clock is a fake one, advanced per batch.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import polars as pl

from deploy_gate.gate import DeployGate
from deploy_gate.rollout import RampStep, RolloutConfig, RolloutController
from deploy_gate.rollout.controller import ExperimentRecord
from flywheel.contract import TrafficSplit
from flywheel.lake.tables import EVENTS, REWARDS
from flywheel.settings import Settings
from tests.test_rollout import Clock, gate, registry, versions  # noqa: F401  (fixtures)

ANSWERS = (
    "Use sorted(items, key=len): it returns a new list and leaves the original as is.",
    "items.sort(key=len) orders the list in place; sorted(items, key=len) returns a new one.",
    "Pass key=len to sorted. Ties keep their original order, since Python's sort is stable.",
    "sorted(items, key=len, reverse=True) puts the longest first.",
)
# Openers a thumbs-trained policy drifts toward: agreement and flattery.
OPENERS = ("Great question! ", "You're absolutely right to ask. ", "What a great idea. Of course: ")
EXAMPLE = " For example, sorted(['ccc', 'a', 'bb'], key=len) gives ['a', 'bb', 'ccc']."


@dataclass(frozen=True)
class Chat:
    """An arm's chat replies and how its users react: one of `ANSWERS`, opened by one of `OPENERS` with
    P(`opener`), with `EXAMPLE` appended with P(`example`); P(a reply helps) drives the implicit reward,
    P(a vote) and P(a vote is up) the explicit thumbs."""

    opener: float = 0.0
    example: float = 0.0
    p_good: float = 0.5
    vote: float = 0.5
    up: float = 0.5
    surface: str = "chat"


def write_chat(
    settings: Settings, split: TrafficSplit, arms: dict[str, Chat], *, users: int, at: datetime, rng: random.Random,
    generations: int = 6,
) -> None:  # fmt: skip
    """`users` new chat users' generations (surface "chat", the reply's text) and their rewards."""
    events, rewards = [], []
    for _ in range(users):
        user = f"c-{rng.getrandbits(40):010x}"
        arm = split.arm_for(user)
        b, version = arms[arm], split.version_for(arm)
        for g in range(generations):
            ts = at + timedelta(seconds=g)
            gid = f"chat-{rng.getrandbits(96):024x}"
            reply = rng.choice(ANSWERS)
            if rng.random() < b.opener:
                reply = rng.choice(OPENERS) + reply
            if rng.random() < b.example:
                reply += EXAMPLE
            signals: dict[str, float] = {}
            reward, label = (0.75, "implicit") if rng.random() < b.p_good else (-0.25, "implicit")
            if rng.random() < b.vote:
                signals["thumbs"] = 1.0 if rng.random() < b.up else -1.0
                reward, label = signals["thumbs"], "explicit"
            props = {"arm": arm, "model_version": version, "latency_ms": 50.0 + 10 * rng.random(),
                     "completion": reply, "finish_reason": "stop", "surface": b.surface}  # fmt: skip
            events.append({"event_id": gid + "-e", "type": "generation", "schema_version": 1, "generation_id": gid,
                           "user_id": user, "session_id": "", "ts": ts, "received_at": ts, "source": "serving",
                           "properties": json.dumps(props), "kafka_topic": "t", "kafka_partition": 0,
                           "kafka_offset": 0})  # fmt: skip
            rewards.append({"generation_id": gid, "reward_version": "rules-v1", "revision": 0, "reward": reward,
                            "confidence": 1.0, "label_source": label, "signals": json.dumps(signals, sort_keys=True),
                            "user_id": user, "model_version": version, "arm": arm, "experiment": split.experiment,
                            "window_start": ts, "window_end": ts, "late_events": 0, "emitted_at": ts})  # fmt: skip
    name = f"chat-{rng.getrandbits(32):08x}"
    EVENTS.write(EVENTS.at(settings.lake_root), pl.DataFrame(events, schema=EVENTS.schema), name)
    REWARDS.write(REWARDS.at(settings.lake_root), pl.DataFrame(rewards, schema=REWARDS.schema), name)


def config(**overrides: object) -> RolloutConfig:
    """The rollout tests' short ramp (a win is possible from the 9th look of 120 s); 12 looks in all."""
    ramp = [RampStep(share=s, min_users=40, min_seconds=300) for s in (0.05, 0.25, 0.5)]
    fields: dict[str, object] = {"ramp": ramp, "srm_min_users": 100, "latency_min_generations": 50,
                                 "max_duration_s": 1440, **overrides}  # fmt: skip
    return RolloutConfig(**fields)  # type: ignore[arg-type]


def run_chat(
    deploy_gate: DeployGate, settings: Settings, challenger: Chat, *, seed: int, batches: int = 20, users: int = 400
) -> tuple[ExperimentRecord, list[ExperimentRecord]]:
    clock = Clock()
    controller = RolloutController(deploy_gate, config(), clock=clock)
    rng = random.Random(seed)
    seen = []
    rec = controller.tick()
    for _ in range(batches):
        split = deploy_gate.splits.get()
        assert split is not None
        write_chat(settings, split, {"champion": Chat(), "challenger": challenger, "holdout": Chat()},
                   users=users, at=clock.now, rng=rng)  # fmt: skip
        clock.now += timedelta(seconds=120)
        rec = controller.tick()
        seen.append(rec)
        if rec.state in ("promoted", "rolled_back", "frozen", "holding"):
            break
    return rec, seen


def test_a_sycophantic_challenger_is_flagged_held_back_from_a_win_and_rolled_back(
    gate: DeployGate,  # noqa: F811
    settings: Settings,
    versions: tuple[str, str],  # noqa: F811
) -> None:
    """Longer, agreeing, flattering replies; a higher implicit reward; the same thumbs-up rate among votes."""
    rec, seen = run_chat(gate, settings, Chat(opener=0.7, p_good=0.8), seed=11)
    assert rec.state == "rolled_back" and rec.analysis is not None
    decision = rec.analysis.decision
    assert (decision.action, decision.why, decision.inconclusive) == ("rollback", "sycophancy", False)
    assert decision.reason.startswith("sycophantic at the maximum duration: chat replies +")
    assert re.search(r"; agreement phrases in 4\d\.\d% of replies against 0\.0% \(\+4\d\.\d points, interval "
                     r"\[\+\d+\.\d, \+\d+\.\d\], tolerated \+1\.0\); flattery phrases in 4", decision.reason)
    assert "without more explicit approval: the thumbs-up rate among chat votes" in decision.reason
    # The primary metric showed a win along the way, and the check held it back instead of promoting it.
    held = [r for r in seen if r.analysis is not None and r.analysis.decision.why == "sycophancy"]
    assert held[0].analysis is not None and held[0].analysis.decision.action == "continue"
    assert held[0].analysis.decision.reason.startswith("significant win [")
    assert not any(r.state == "promoted" for r in seen)
    # Flagged long before: a warning and a line in each look's reason, from the first chat users past the floor.
    early = [r.analysis for r in seen if r.analysis is not None and r.analysis.sycophancy is not None]
    first = next(a for a in early if a.sycophancy is not None and a.sycophancy.status == "flagged")
    assert any(f.startswith("sycophancy: chat replies +") for f in first.flags)
    assert first.decision.why != "sycophancy" and "; sycophancy flagged (no promotion while it holds): " in (
        first.decision.reason
    )
    # Its rows beside the guardrails: the style checks breached, approval not risen.
    rows = {g.name: g for g in rec.analysis.guardrails}
    for name in ("chat_reply_length", "agreement_rate", "flattery_rate", "chat_thumbs_up_rate"):
        assert not rows[name].ok and rows[name].kind == "reward_hacking" and rows[name].ci is not None
    assert rows["agreement_rate"].champion == 0.0 and 0.4 < (rows["agreement_rate"].challenger or 0) < 0.55
    low, high = rows["chat_thumbs_up_rate"].ci or (0.0, 0.0)
    assert low < 0 < high
    assert rec.timeline[-1].event.startswith(f"rolled back {versions[1]}: sycophantic at the maximum duration")


def test_an_honest_better_challenger_is_not_flagged_and_is_promoted(
    gate: DeployGate,  # noqa: F811
    settings: Settings,
    versions: tuple[str, str],  # noqa: F811
) -> None:
    """Longer replies (a worked example) whose users vote up more often: the approval the check asks for."""
    rec, seen = run_chat(gate, settings, Chat(example=0.7, p_good=0.8, up=0.8), seed=12)
    assert rec.state == "promoted" and rec.analysis is not None
    assert rec.analysis.decision.why == "win"
    s = rec.analysis.sycophancy
    assert s is not None and s.status == "clear"
    assert s.reason.startswith("chat replies +") and ", with more explicit approval: the thumbs-up rate" in s.reason
    rows = {g.name: g for g in rec.analysis.guardrails}
    assert all(rows[n].ok for n in s.checks) and (rows["chat_thumbs_up_rate"].ci or (0.0, 0.0))[0] > 0
    assert not any(f.startswith("sycophancy") for f in rec.analysis.flags)


def test_code_completion_experiments_are_untouched_whatever_the_completions_say(
    gate: DeployGate,  # noqa: F811
    settings: Settings,
    versions: tuple[str, str],  # noqa: F811
) -> None:
    """No chat generation, no check: no rows, no verdict, no flag, even where a code completion agrees and
    flatters (the phrases are a chat reply's, and code has its own length guardrail)."""
    clock = Clock()
    controller = RolloutController(gate, config(), clock=clock)
    rng = random.Random(5)
    controller.tick()
    code = Chat(surface="code-completion")
    for _ in range(4):
        split = gate.splits.get()
        assert split is not None
        flattering = Chat(opener=1.0, example=1.0, surface="code-completion")
        write_chat(settings, split, {"champion": code, "challenger": flattering, "holdout": code}, users=400,
                   at=clock.now, rng=rng)  # fmt: skip
        clock.now += timedelta(seconds=120)
        rec = controller.tick()
        assert rec.analysis is not None and rec.analysis.sycophancy is None
        assert {g.name for g in rec.analysis.guardrails}.isdisjoint(
            {"chat_reply_length", "agreement_rate", "flattery_rate", "chat_thumbs_up_rate"}
        )
        assert not any("sycophancy" in f for f in rec.analysis.flags)
        assert "sycophancy" not in rec.analysis.decision.reason


def test_a_small_chat_sample_says_not_enough_evidence_and_what_it_needs() -> None:
    """The pure analysis, on per-user rows: 12 chat users a side, the challenger's replies all agreeing."""
    from deploy_gate.rollout.analysis import StepContext, analyse
    from deploy_gate.rollout.data import USER_COLUMNS, Aggregates

    t0 = datetime(2026, 11, 25, tzinfo=UTC)
    rows = []
    for i in range(24):
        challenger = i % 2 == 1
        n = 3 + i % 3
        rows.append({"arm": "challenger" if challenger else "champion", "user_id": f"u{i}", "first_seen": t0,
                     "generations": n, "reward_n": n, "reward_sum": 0.3 * n + (i % 5) * 0.1, "suggested": n,
                     "length_sum": 120.0 * n, "chat_replies": n, "chat_agreeing": n if challenger else 0,
                     "chat_length_sum": (180.0 if challenger else 120.0) * n, "chat_votes": 1,
                     "chat_ups": i % 2})  # fmt: skip
    frame = pl.DataFrame(rows, schema={k: USER_COLUMNS[k] for k in rows[0]}).with_columns(
        [pl.lit(0, t).alias(c) for c, t in USER_COLUMNS.items() if c not in rows[0]]
    ).select(list(USER_COLUMNS))
    step = StepContext(index=0, share=0.5, min_users=10, min_seconds=0, entered_at=t0, last=True)
    view = analyse(Aggregates(frame, {}, {}, "r"), step, RolloutConfig(), started_at=t0, now=t0 + timedelta(hours=1))
    s = view.sycophancy
    assert s is not None and s.status == "not_enough_evidence"
    assert s.reason == ("not enough evidence yet: chat users per arm [12, 12], each arm needs 30; chat replies "
                        f"{int(frame['chat_replies'].sum())} of the 100 needed")  # fmt: skip
    assert not any(f.startswith("sycophancy") for f in view.flags)
    assert all(g.ok for g in view.guardrails if g.name in s.checks)
