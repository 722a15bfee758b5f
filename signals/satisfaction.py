"""Satisfaction inference: P(a user was satisfied | implicit signals), learnt from explicit thumbs,
per product surface, and used only where it beats the rules.

`refit(surface=...)` reads the lake's reward records of that surface (records of versions whose
definition belongs to it: chat thumbs never train a code-completion model), keeps generations that
carry a thumbs vote (label: up), sorted by generation id, fits a logistic regression on their
implicit signals, and compares it with the surface's rules on held-out labels (a stable hash of
the generation id picks them): ROC AUC and expected calibration error of both, with seeded
percentile-bootstrap 95% intervals, paired (the same resamples for both). The rules' reward r is
read as the probability (r + 1) / 2, the scale the model's reward 2p - 1 is on.

Every refit becomes a stored definition version (`sat-<surface>-<labels>-<hash>`; the same data
gives the same version) and an MLflow run. It is made active only when the surface has
`min_labels` labels, its AUC beats the rules' by `auc_margin` with the lower end of the
difference's interval above 0, and its ECE is no worse than the rules'; otherwise the run says
why and the rules stay.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import polars as pl

from flywheel.connections import configure_mlflow, experiment_artifact_location, redis_client
from flywheel.lake.tables import REWARDS
from flywheel.reward_versions import DEFAULT_SURFACE, surface_of
from flywheel.settings import Settings
from signals.config import SignalsConfig
from signals.definitions import DefinitionStore, UnknownRewardVersion
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
    test_labels: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    test_proba: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    test_signals: tuple[Mapping[str, float], ...] = field(repr=False, default=())


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
        y[test],
        p,
        tuple(sig for sig, t in zip(signals, test, strict=True) if t),
    )


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float

    def as_metrics(self, name: str) -> dict[str, float]:
        out = {name: self.value, f"{name}_ci_low": self.low, f"{name}_ci_high": self.high}
        return {k: v for k, v in out.items() if np.isfinite(v)}


@dataclass(frozen=True)
class Comparison:
    """Model against rules on the same held-out labels (95% percentile-bootstrap intervals)."""

    n_test: int
    auc_model: Interval
    auc_rules: Interval
    auc_gain: Interval  # model - rules, paired
    ece_model: Interval
    ece_rules: Interval

    def beats(self, margin: float) -> tuple[bool, str]:
        """Whether the model may replace the rules, and if not, why."""
        gain, ece_m, ece_r = self.auc_gain, self.ece_model.value, self.ece_rules.value
        if not np.isfinite(gain.value):
            return False, "held-out labels are all of one kind: no AUC to compare"
        if gain.value < margin:
            return False, f"held-out AUC gain over the rules {gain.value:+.3f} < margin {margin:.3f}"
        if not gain.low > 0:
            return False, f"the AUC gain's 95% interval [{gain.low:+.3f}, {gain.high:+.3f}] includes 0"
        if ece_m > ece_r:
            return False, f"ECE {ece_m:.3f} is worse than the rules' {ece_r:.3f}"
        return True, ""

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"n_test": float(self.n_test)}
        for name in ("auc_model", "auc_rules", "auc_gain", "ece_model", "ece_rules"):
            out.update(getattr(self, name).as_metrics(name))
        return out


def compare_with_rules(
    labels: np.ndarray, proba: np.ndarray, rules_proba: np.ndarray, *, samples: int = 400, seed: int = 0
) -> Comparison:
    """AUC and ECE of the model (`proba`) and the rules (`rules_proba`) on the same `labels`, with
    paired percentile-bootstrap 95% intervals (Efron & Tibshirani, 1993, ch. 13), seeded.

    >>> y = np.array([0, 0, 1, 1] * 10); good = y * 0.8 + 0.1; flat = np.full(40, 0.8)
    >>> c = compare_with_rules(y, good, flat, samples=50)
    >>> round(c.auc_model.value, 2), round(c.auc_rules.value, 2), c.beats(0.02)[0]
    (1.0, 0.5, True)
    """
    y = np.asarray(labels, dtype=np.float64)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(samples):
        ix = rng.integers(0, len(y), len(y))
        if len(np.unique(y[ix])) < 2:
            continue  # no AUC without both kinds
        a_m, a_r = roc_auc(y[ix], proba[ix]), roc_auc(y[ix], rules_proba[ix])
        draws.append(
            (a_m, a_r, a_m - a_r, expected_calibration_error(y[ix], proba[ix]),
             expected_calibration_error(y[ix], rules_proba[ix]))
        )  # fmt: skip
    d = np.array(draws) if draws else np.full((1, 5), np.nan)
    point = (
        roc_auc(y, proba),
        roc_auc(y, rules_proba),
        roc_auc(y, proba) - roc_auc(y, rules_proba),
        expected_calibration_error(y, proba),
        expected_calibration_error(y, rules_proba),
    )
    lo, hi = np.nanpercentile(d, 2.5, axis=0), np.nanpercentile(d, 97.5, axis=0)
    iv = [Interval(float(point[i]), float(lo[i]), float(hi[i])) for i in range(5)]
    return Comparison(len(y), *iv)


@dataclass(frozen=True)
class RefitResult:
    n_labels: int
    surface: str = DEFAULT_SURFACE
    version: str | None = None
    activated: bool = False
    roc_auc: float | None = None
    ece: float | None = None
    rules_roc_auc: float | None = None
    rules_ece: float | None = None
    run_id: str | None = None
    reason: str = ""

    def summary(self) -> dict[str, object]:
        return asdict(self)


def explicit_labels(
    settings: Settings, store: DefinitionStore, surface: str, rewards: pl.DataFrame | None = None
) -> pl.DataFrame:
    """One row per generation of `surface` with a thumbs vote: generation_id, signals (dict), label
    (1 = up), sorted by generation id (the fit is the same whatever order records were written in).
    `rewards`: the explicit rows of the rewards table, already read (`refit_all` reads them once for every
    surface); None: read here."""
    empty = pl.DataFrame(schema={"generation_id": pl.String, "signals": pl.Object, "label": pl.Int64})
    df = _explicit_rows(settings) if rewards is None else rewards
    if df.is_empty():
        return empty
    versions = [v for v in df["reward_version"].unique().to_list() if _surface_of_version(store, v) == surface]
    latest = (
        df.filter((pl.col("label_source") == "explicit") & pl.col("reward_version").is_in(versions))
        .sort("emitted_at", "revision")
        .unique("generation_id", keep="last", maintain_order=True)
        .sort("generation_id")
    )
    if latest.is_empty():
        return empty
    sigs = [json.loads(s) for s in latest["signals"].to_list()]
    return pl.DataFrame(
        {
            "generation_id": latest["generation_id"],
            "signals": pl.Series(sigs, dtype=pl.Object),
            "label": [int(s.get("thumbs", 0) > 0) for s in sigs],
        }
    )


def _explicit_rows(settings: Settings) -> pl.DataFrame:
    df = read_rewards(REWARDS.at(settings.lake_root))
    return df if df.is_empty() else df.filter(pl.col("label_source") == "explicit")


def refit_all(settings: Settings, config: SignalsConfig | None = None) -> list[RefitResult]:
    """`refit` for every surface with enough explicit labels to fit (`MIN_FIT_LABELS`), reading the rewards table
    once for all of them: the worker's periodic refit, whose cost so grows with the labels, not with the number of
    surfaces (a flood of new surface names made it read the whole table once per surface)."""
    store = DefinitionStore(settings, redis_client(settings))
    rows = _explicit_rows(settings)
    if rows.is_empty():
        return []
    counts = rows.group_by("reward_version").agg(pl.col("generation_id").n_unique().alias("n"))
    by_surface: dict[str, int] = {}
    for version, n in counts.iter_rows():
        surface = _surface_of_version(store, version)
        if surface is not None:
            by_surface[surface] = by_surface.get(surface, 0) + n
    return [
        refit(settings, config, surface=surface, rewards=rows)
        for surface, n in sorted(by_surface.items())
        if n >= MIN_FIT_LABELS
    ]


def _surface_of_version(store: DefinitionStore, version: str) -> str | None:
    try:
        return store.get(version).surface
    except UnknownRewardVersion:
        return None  # written by something other than signals (a simulator): no surface to claim it


def refit(
    settings: Settings,
    config: SignalsConfig | None = None,
    *,
    surface: str = DEFAULT_SURFACE,
    activate: bool = True,
    rewards: pl.DataFrame | None = None,
) -> RefitResult:
    """Fit on the surface's explicit labels so far; compare with its rules; log to MLflow; store the
    new definition and activate it only if it beats the rules (see the module docstring). `rewards`: see
    `explicit_labels`."""
    config = config or SignalsConfig()
    surface = surface_of(surface)
    if surface != DEFAULT_SURFACE:  # chat-like: learn the follow-up's words when its reactions have text
        from signals.chat_reward import refit_as_satisfaction  # imports this module

        learned = refit_as_satisfaction(settings, config, surface=surface, activate=activate)
        if learned is not None:
            return learned
    store = DefinitionStore(settings, redis_client(settings))
    labels = explicit_labels(settings, store, surface, rewards)
    n = labels.height
    if n < MIN_FIT_LABELS:
        return RefitResult(
            n, surface, reason=f"{n} explicit labels; fitting needs {MIN_FIT_LABELS}; rules stay in use"
        )
    try:
        fit = fit_satisfaction(
            labels["generation_id"].to_list(), labels["signals"].to_list(), labels["label"].to_list()
        )
    except ValueError as exc:
        return RefitResult(n, surface, reason=str(exc))
    active = store.active(surface)
    rules = store.get(active.rules_version) if active.satisfaction is not None else active
    rules_proba = np.array([(rules.score_implicit(dict(s)).reward + 1.0) / 2.0 for s in fit.test_signals])
    cmp = compare_with_rules(
        fit.test_labels, fit.test_proba, rules_proba, samples=config.bootstrap_samples, seed=config.seed
    )
    digest = json.dumps({"base": rules.version, "model": fit.model.to_json()}, sort_keys=True)
    version = f"sat-{surface}-{n}-{hashlib.sha256(digest.encode()).hexdigest()[:8]}"
    definition = rules.with_satisfaction(
        fit.model,
        version=version,
        notes=f"logistic regression on {fit.n_train} {surface} thumbs over {rules.version}; held-out AUC "
        f"{cmp.auc_model.value:.3f} (rules {cmp.auc_rules.value:.3f}), ECE {cmp.ece_model.value:.3f} "
        f"(rules {cmp.ece_rules.value:.3f})",
    )
    store.put(definition)
    better, reason = cmp.beats(config.auc_margin)
    if n < config.min_labels:
        reason = f"{n} labels < min_labels {config.min_labels}"
    elif not activate:
        reason = "activation not asked for"
    activated = not reason and better
    run_id = _log_to_mlflow(settings, config, definition.to_spec(), fit, cmp, n, activated, reason)
    if activated:
        store.set_active(definition.version)
    log.info(
        "satisfaction refit",
        extra={"surface": surface, "version": version, "activated": activated, "reason": reason,
               "auc": cmp.auc_model.value, "rules_auc": cmp.auc_rules.value, "ece": cmp.ece_model.value},
    )
    return RefitResult(
        n, surface, version, activated, cmp.auc_model.value, cmp.ece_model.value,
        cmp.auc_rules.value, cmp.ece_rules.value, run_id, reason or "activated: beats the rules",
    )  # fmt: skip


def _log_to_mlflow(
    settings: Settings,
    config: SignalsConfig,
    spec: dict[str, object],
    fit: FitResult,
    cmp: Comparison,
    n_labels: int,
    activated: bool,
    reason: str,
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
                "surface": spec["surface"],
                "n_labels": n_labels,
                "n_train": fit.n_train,
                "n_test": fit.n_test,
                "activated": activated,
                "auc_margin": config.auc_margin,
                "bootstrap_samples": config.bootstrap_samples,
                "seed": config.seed,
                "features": ",".join(FEATURES),
            }
        )
        mlflow.set_tag("decision", reason or "activated: beats the rules")
        metrics = {"roc_auc": cmp.auc_model.value, "ece": cmp.ece_model.value, **cmp.metrics()}
        mlflow.log_metrics({k: v for k, v in metrics.items() if np.isfinite(v)})
        mlflow.log_dict(spec, "reward_definition.json")
        return str(run.info.run_id)
