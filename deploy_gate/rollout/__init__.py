"""The rollout controller: a ramped A/B test per candidate, analysed per user, decided by rules.

- `config`: the ramp, minimum samples and times, alpha, guardrail bounds, holdout (FLYWHEEL_ROLLOUT_*);
- `data`: per-user aggregates of each arm from the lake (rewards joined with generation events);
- `analysis`: the statistics and the decision, a pure function of aggregates, config and state;
- `state`: the experiment's ramp, timeline and last analysis, kept in Redis;
- `controller`: one tick reads the lake, decides, and applies through the gate's plan-then-apply;
- `models`: the `GET /api/experiment` answer; `api`: its router.
"""

from __future__ import annotations

from deploy_gate.rollout.config import RampStep, RolloutConfig
from deploy_gate.rollout.controller import CONTROLLER_ACTOR, RolloutController

__all__ = ["CONTROLLER_ACTOR", "RampStep", "RolloutConfig", "RolloutController"]
