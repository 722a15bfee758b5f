"""The demo's overrides: what `flywheel up` runs differently from production's defaults, as one typed object.

`DEMO` holds the `Settings`, `TrainerConfig` and `RolloutConfig` fields the demo changes, each value checked
against its field's type and bounds when this module loads (a typo or an out-of-bounds value fails at once,
naming the field). `DemoOverrides.environment` renders the trainer's and the rollout controller's, in this one
place, to the components' environment (`FLYWHEEL_TRAINER_*`, `FLYWHEEL_ROLLOUT_*`); the settings' go into the
`Settings` that `flywheel up` renders for every component (`launcher.embedded.settings_env`). Each applies only
where the operator's environment does not set that variable already: the environment wins over the demo, and
`flywheel up --trainer-config FILE` replaces the demo's trainer fields. `flywheel config show --demo` shows the
values `flywheel up` runs with, each marked `demo` where it comes from here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic_settings import BaseSettings

from deploy_gate.rollout.config import RolloutConfig
from flywheel.settings import Settings
from trainer.config import TrainerConfig


def _typed(cls: type[BaseSettings], values: dict[str, Any]) -> dict[str, Any]:
    """`values` checked against `cls`'s fields: each a field of it, of its type and within its bounds; the typed
    values (a ramp's steps as `RampStep`s)."""
    unknown = sorted(set(values) - set(cls.model_fields))
    if unknown:
        raise ValueError(f"not fields of {cls.__name__}: {unknown}")
    typed = {}
    for name, value in values.items():
        try:
            typed[name] = _adapter(cls, name).validate_python(value)
        except ValidationError as exc:
            raise ValueError(f"{cls.__name__}.{name}={value!r}: {exc.errors()[0]['msg']}") from None
    return typed


def _adapter(cls: type[BaseSettings], name: str) -> TypeAdapter[Any]:
    info = cls.model_fields[name]
    return TypeAdapter(Annotated[info.annotation, info])  # type: ignore[arg-type]  # the field: type and bounds


class DemoOverrides(BaseModel):
    """The fields `flywheel up` sets over production's defaults, per object (the environment still wins)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    settings: dict[str, Any] = Field(default_factory=dict, description="Settings fields (every process).")
    trainer: dict[str, Any] = Field(default_factory=dict, description="TrainerConfig fields.")
    rollout: dict[str, Any] = Field(default_factory=dict, description="RolloutConfig fields.")

    @field_validator("settings")
    @classmethod
    def _settings_fields(cls, values: dict[str, Any]) -> dict[str, Any]:
        return _typed(Settings, values)

    @field_validator("trainer")
    @classmethod
    def _trainer_fields(cls, values: dict[str, Any]) -> dict[str, Any]:
        typed = _typed(TrainerConfig, values)
        TrainerConfig.model_validate(typed)  # over the defaults, the checks across fields too (no environment)
        return typed

    @field_validator("rollout")
    @classmethod
    def _rollout_fields(cls, values: dict[str, Any]) -> dict[str, Any]:
        return _typed(RolloutConfig, values)

    def of(self, owner: str, given: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The fields the demo sets on the object named `owner` ({} for one it leaves alone); with `given` (the
        environment), only those whose variable it does not set."""
        objects: dict[str, tuple[type[BaseSettings], dict[str, Any]]] = {
            "Settings": (Settings, self.settings), "TrainerConfig": (TrainerConfig, self.trainer),
            "RolloutConfig": (RolloutConfig, self.rollout)}  # fmt: skip
        cls, values = objects.get(owner, (BaseSettings, {}))
        if given is None:
            return dict(values)
        set_already = {k.upper() for k in given}
        return {k: v for k, v in values.items() if not set_already & set(_variables(cls, k))}

    def environment(self, given: Mapping[str, str], *, trainer: bool = True) -> dict[str, str]:
        """The variables that give the components these values, leaving out those `given` (the environment)
        sets already; without the trainer's with `trainer=False` (a `--trainer-config` file replaces them)."""
        out: dict[str, str] = {}
        objects: tuple[type[BaseSettings], ...] = (TrainerConfig, RolloutConfig) if trainer else (RolloutConfig,)
        for cls in objects:
            for name, value in self.of(cls.__name__, given).items():
                out[_variables(cls, name)[0]] = value if isinstance(value, str) else json.dumps(
                    _adapter(cls, name).dump_python(value, mode="json"))  # fmt: skip
        return out


def _variables(cls: type[BaseSettings], name: str) -> tuple[str, ...]:
    """The variables that set field `name` of `cls`: its aliases, or its prefix and name in capitals."""
    alias = cls.model_fields[name].validation_alias
    if isinstance(alias, AliasChoices):
        return tuple(str(c).upper() for c in alias.choices)
    return ((str(cls.model_config.get("env_prefix", "")) + name).upper(),)


# The demo's trainer takes bigger steps than production's default (lr 1e-5, made for a model serving real
# users for hours between cycles): on a few hundred samples every two minutes the embedded model's accept
# rate should move within minutes. Its baseline is the reward of not suggesting (0 under Cursor's rewards),
# so each suggestion is weighed against silence, and a declined request teaches nothing by itself.
# A cycle reads at most 1,000 of the eligible samples since its parent champion's window (a seeded uniform
# sample, the rest reported as left out; they stay eligible for the next cycle) and trains within a 90-s wall
# budget (cycles start every two minutes); past it, it stops and reports how many samples it did not reach
# (visited in a seeded random order, so the trained ones are a uniform sample), never "the newest N".
# `flywheel up --trainer-config FILE` replaces it (TrainerConfig fields as JSON, docs/configuration.md).
# A fifth of the traffic is held out of training so the offline gate estimates each candidate on traffic it
# never saw (flywheel/holdout.py).
# It trains on the champion's own samples, 4 a logged prompt, scored by a reward model fitted on the cycle's
# logged rewards (trainer/reward_model.py; the logged samples when the fit predicts nothing), and stops once
# the batches' KL to the champion passes 0.025 nats: chosen on the tuning populations (README, "Does it make
# users happier?"), where it doubled one cycle's gain on `length` (+42% against +20%) and left `style` where
# the logged samples leave it (+3% against +4%, both inside the noise).
# Preparing own samples is bounded in CPU, not wall time (which on a loaded machine counts everyone's work):
# unbounded, one cycle beside the running demo scored and sampled for 894 s before its first step. 30 CPU-s
# from the logged samples' scoring on (at most 1,000: ~17 CPU-s), the rest for own samples of a seeded uniform
# sample of the prompts (~0.15 CPU-s a prompt: 90 or more, 360 samples, more than a 90-s cycle trains on under
# load); the reason says how many prompts it covered. Chosen on `length`: budgets of 15 and 30 CPU-s reached
# the unbounded cycle's gain within the noise (+29% and +39% against +35%; 20 CPU-s without the wall budget:
# +38%), as `target_kl` stops training after ~250 own samples (bench/results/trainer_ptx_budget.md). With the
# pretraining mix at 0.1
# (ptx_coef: InstructGPT's PPO-ptx on each batch's logged contexts) the gain on `length` stayed (+37.7% against
# +37.9%) while the held-out text's log-loss rose +0.025 nats a token instead of +0.045 (the product's own
# contexts: +0.003 instead of +0.037); 0.3 halved the gain, 1.0 removed it. The combination, rerun on `length`:
# +21.5% [+11%, +33%], log-loss +0.016 (one cycle's gain varies this much between runs). On the reporting
# populations the held-out log-loss no longer rose; accept moved within the noise on `brackets` and
# `style-mirror`, and fell on `content` (-5% [-9%, -1%], against -3% before), where the reward model predicts
# nothing and the mix let `target_kl` stop later: the gates are what refuse such a candidate.
# The simulated users' latest check comes 30 s after an accept: a one-minute reward window covers it, so the demo's
# loop turns in minutes, not the 16 a real product's 15-minute retention check needs.
_DEMO_SETTINGS = {"reward_window_s": 60.0}

_DEMO_TRAINER = {"learning_rate": 1e-4, "epochs": 1, "batch_size": 16, "baseline": 0.0, "time_budget_s": 90,
                 "ope_holdout_share": 0.2, "own_samples": 4, "target_kl": 0.025, "max_samples": 1000,
                 "own_cpu_budget_s": 30, "ptx_coef": 0.1}

# The demo drives a handful of simulated users: a ramp with production minimums (hundreds of users
# per step) would never move. So the demo's ramp and maximum duration are short and the confidence
# sequence is tuned for small samples (N* = 100); the decision rules are production's, evidence floor
# included (deploy_gate/rollout/rules.py), so a demo whose traffic cannot support a decision says
# "not enough evidence yet" and rolls the challenger back as inconclusive at the maximum duration
# instead of promoting on noise (bench/rollout_decisions.py measures this very configuration). These
# apply unless FLYWHEEL_ROLLOUT_* says otherwise; production keeps the defaults. The decision rule is
# production's default, expected loss, on purpose: harm rolls back at any look from 30 users an arm, a
# challenger whose users never arrive is rolled back (no data) at the 10 minutes instead of stalling the
# loop, and at 2,000 users in 10 minutes it promoted 40% of 10%-better and 97% of 30%-better
# challengers with no 10%-worse one promoted (bench/results/rollout_decisions.md); the sequential
# rule's margin cannot be resolved at a demo's traffic. Eight minutes, not ten, at the demo's 6 requests a
# second (about 2,000 users by the end, `flywheel up --rate`): the first candidate is approved about six minutes
# after the components start, so its decision comes within 15; measured on the bench's users (100 experiments a
# cell, 2026-12-03), 43% of 10%-better and 94% of 30%-better challengers promoted, no 10%-worse one, no A/A
# wrong decision, where ten minutes at 3 requests a second (1,450 users) gave 28% and 82%.
# Those eight minutes are now a planned size, not a clock: an experiment ends once its users resolve a 25% change
# in the accept rate (`planned_change`), and runs on to 30 minutes where the traffic is a small product's (outside
# traffic at 3 requests a second on users who accept 5% of suggestions: eight minutes promoted 27% of 30%-better
# challengers, 30 minutes 82%, with 10%-worse ones at 1% both ways; simulated users at accept 0.25 and 0.05,
# `deploy_gate.rollout.calibration`, 2026-12-04).
# The demo's own users (`flywheel up`'s `--rate` and `--populations`) are 12 requests a second from the three
# populations the defaults were tuned on. At 6 a second from all five default kinds, the first candidate (about +9% in
# truth in both runs: `content` and `noisy` users teach it little) was decided at about 12.5 minutes and promoted in
# one run of two. At 12 a second the planned size comes in about 4.5 minutes, so the first decision comes at 8-9.5
# minutes; a rollback then leaves time for a second experiment inside 15. The first candidate also trains on about
# twice the samples (494 against 262). Measured in bench/results/flywheel_up_demo.md.
_DEMO_ROLLOUT = {
    "ramp": [{"share": 0.25, "min_users": 1, "min_seconds": 60}, {"share": 0.5, "min_users": 2, "min_seconds": 120}],
    "max_duration_s": 1800,
    "planned_change": 0.25,
    "tuning_n": 100,
    "interval_s": 10,
    "srm_min_users": 50,
}

DEMO = DemoOverrides(settings=_DEMO_SETTINGS, trainer=_DEMO_TRAINER, rollout=_DEMO_ROLLOUT)
