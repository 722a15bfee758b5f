"""Satisfaction inference: P(a user was satisfied | implicit signals), learnt from explicit thumbs.

`refit` reads the lake's reward records, keeps generations that carry a thumbs
vote (label: up), fits a logistic regression on their implicit signals, measures
ROC AUC and expected calibration error on held-out labels (a stable hash of the
generation id picks them), and logs both to MLflow. The fitted model becomes a new
reward definition version (`sat-<labels>-<hash>`) built on the active one; it is
made active only once there are `min_labels` labels: until then the rules decide.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

from flywheel.connections import configure_mlflow, experiment_artifact_location, redis_client
from flywheel.lake.tables import REWARDS
from flywheel.settings import Settings
from signals.config import SignalsConfig
from signals.definitions import DefinitionStore
from signals.logistic import LogisticModel, expected_calibration_error, roc_auc
from signals.sink import read_rewards

log = logging.getLogger(__name__)

# Implicit signals the model reads. Missing ones count as 0, except those in
# MEASURED_SOMETIMES, where missing means "not measured" (filled with the mean).
FEATURES: tuple[str, ...] = (
    "shown",
    "accepted",
    "accepted_fraction",
    "rejected",
    "ignored",
    "undone",
    "edit_ratio",
    "retention",
    "copied",
    "regenerated",
    "followup_sentiment",
)
MEASURED_SOMETIMES = frozenset({"retention"})
MIN_FIT_LABELS = 20  # below this nothing is fitted at all


def feature_matrix(signals: Sequence[Mapping[str, float]], features: Sequence[str] = FEATURES) -> np.ndarray:
    out = np.zeros((len(signals), len(features)))
    for i, s in enumerate(signals):
        for j, name in enumerate(features):
            out[i, j] = s.get(name, np.nan if name in MEASURED_SOMETIMES else 0.0)
    return out


def is_held_out(generation_id: str, share: float = 0.2) -> bool:
    """A stable split: the same generation is always on the same side, whatever the refit."""
    h = int.from_bytes(hashlib.sha256(generation_id.encode()).digest()[:8], "big") / 2**64
    return h < share


@dataclass(frozen=True)
class FitResult:
    model: LogisticModel
    n_train: int
    n_test: int
    roc_auc: float
    ece: float


def fit_satisfaction(
    generation_ids: Sequence[str],
    signals: Sequence[Mapping[str, float]],
    labels: Sequence[int],
    holdout_share: float = 0.2,
) -> FitResult:
    x = feature_matrix(signals)
    y = np.asarray(labels, dtype=np.float64)
    test = np.array([is_held_out(g, holdout_share) for g in generation_ids], dtype=bool)
    if (~test).sum() < MIN_FIT_LABELS or len(np.unique(y[~test])) < 2:
        raise ValueError(
            f"need at least {MIN_FIT_LABELS} training labels of both kinds; have {(~test).sum()}"
        )
    model = LogisticModel.fit(x[~test], y[~test], FEATURES)
    p = model.predict_proba(x[test])
    return FitResult(
        model,
        int((~test).sum()),
        int(test.sum()),
        roc_auc(y[test], p),
        expected_calibration_error(y[test], p),
    )


@dataclass(frozen=True)
class RefitResult:
    n_labels: int
    version: str | None = None
    activated: bool = False
    roc_auc: float | None = None
    ece: float | None = None
    run_id: str | None = None
    reason: str = ""

    def summary(self) -> dict[str, object]:
        return asdict(self)


def explicit_labels(settings: Settings) -> pl.DataFrame:
    """One row per generation with a thumbs vote: generation_id, signals (dict), label (1 = up)."""
    df = read_rewards(REWARDS.at(settings.lake_dir))
    if df.is_empty():
        return pl.DataFrame(schema={"generation_id": pl.String, "signals": pl.Object, "label": pl.Int64})
    latest = (
        df.filter(pl.col("label_source") == "explicit")
        .sort("emitted_at", "revision")
        .unique("generation_id", keep="last", maintain_order=True)
    )
    sigs = [json.loads(s) for s in latest["signals"].to_list()]
    return pl.DataFrame(
        {
            "generation_id": latest["generation_id"],
            "signals": pl.Series(sigs, dtype=pl.Object),
            "label": [int(s.get("thumbs", 0) > 0) for s in sigs],
        }
    )


def refit(settings: Settings, config: SignalsConfig | None = None, *, activate: bool = True) -> RefitResult:
    """Fit on all explicit labels so far; log to MLflow; store (and maybe activate) the new definition."""
    config = config or SignalsConfig()
    labels = explicit_labels(settings)
    n = labels.height
    if n < MIN_FIT_LABELS:
        return RefitResult(
            n, reason=f"{n} explicit labels; fitting needs {MIN_FIT_LABELS}; rules stay in use"
        )
    try:
        fit = fit_satisfaction(
            labels["generation_id"].to_list(), labels["signals"].to_list(), labels["label"].to_list()
        )
    except ValueError as exc:
        return RefitResult(n, reason=str(exc))
    store = DefinitionStore(settings, redis_client(settings))
    base = store.active()
    spec_hash = hashlib.sha256(json.dumps(fit.model.to_json(), sort_keys=True).encode()).hexdigest()[:8]
    definition = base.with_satisfaction(
        fit.model,
        version=f"sat-{n}-{spec_hash}",
        notes=f"logistic regression, {fit.n_train} thumbs; held-out AUC {fit.roc_auc:.3f}, ECE {fit.ece:.3f}",
    )
    store.put(definition)
    enough = n >= config.min_labels
    run_id = _log_to_mlflow(settings, config, definition.to_spec(), fit, n, enough and activate)
    if enough and activate:
        store.set_active(definition.version)
    reason = "" if enough else f"{n} labels < min_labels {config.min_labels}: stored, rules stay active"
    log.info(
        "satisfaction refit %s: AUC %.3f ECE %.3f (%s)",
        definition.version,
        fit.roc_auc,
        fit.ece,
        reason or "activated",
    )
    return RefitResult(n, definition.version, enough and activate, fit.roc_auc, fit.ece, run_id, reason)


def _log_to_mlflow(
    settings: Settings,
    config: SignalsConfig,
    spec: dict[str, object],
    fit: FitResult,
    n_labels: int,
    activated: bool,
) -> str:
    import mlflow

    configure_mlflow(settings)
    if mlflow.get_experiment_by_name(config.mlflow_experiment) is None:
        mlflow.create_experiment(
            config.mlflow_experiment, artifact_location=experiment_artifact_location(settings)
        )
    mlflow.set_experiment(config.mlflow_experiment)
    with mlflow.start_run(run_name=f"satisfaction-{spec['version']}") as run:
        mlflow.log_params(
            {
                "reward_version": spec["version"],
                "n_labels": n_labels,
                "n_train": fit.n_train,
                "n_test": fit.n_test,
                "activated": activated,
                "features": ",".join(FEATURES),
            }
        )
        metrics = {"roc_auc": fit.roc_auc, "ece": fit.ece}
        mlflow.log_metrics({k: v for k, v in metrics.items() if np.isfinite(v)})
        mlflow.log_dict(spec, "reward_definition.json")
        return str(run.info.run_id)
