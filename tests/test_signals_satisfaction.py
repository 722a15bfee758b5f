"""The satisfaction model: metrics against naive references, calibration on users whose
satisfaction is known, and the refit loop (fallback, activation, MLflow)."""

from __future__ import annotations

import itertools

import mlflow
import numpy as np
import pytest

from flywheel.connections import redis_client
from flywheel.lake.tables import REWARDS
from flywheel.settings import Settings
from signals.config import SignalsConfig
from signals.definitions import DefinitionStore
from signals.logistic import expected_calibration_error, roc_auc
from signals.reward import DEFAULT_DEFINITION
from signals.satisfaction import feature_matrix, fit_satisfaction, is_held_out, refit
from signals.sink import write_rewards
from simulator.telemetry import known_users


def test_auc_and_ece_match_naive_definitions() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 60)
    s = np.round(rng.random(60), 1)  # ties on purpose
    pairs = [(a, b) for a, b in itertools.product(range(60), range(60)) if y[a] == 1 and y[b] == 0]
    naive = sum(1.0 if s[a] > s[b] else 0.5 if s[a] == s[b] else 0.0 for a, b in pairs) / len(pairs)
    assert roc_auc(y, s) == pytest.approx(naive)
    bins = [[i for i in range(60) if min(int(s[i] * 10), 9) == b] for b in range(10)]
    naive_ece = sum(len(ix) / 60 * abs(y[ix].mean() - s[ix].mean()) for ix in bins if ix)
    assert expected_calibration_error(y, s) == pytest.approx(naive_ece)


def test_inferred_probability_tracks_known_satisfaction() -> None:
    """Bounds: held-out AUC within 0.03 of the oracle's (the true probabilities), ECE below 0.06,
    and mean |inferred - true probability| below 0.04, on 6000 users of whom 40% vote."""
    users = known_users(6000, seed=1)
    voted = [u for u in users if u.thumbs]
    fit = fit_satisfaction(
        [u.generation_id for u in voted], [u.signals for u in voted], [int(u.satisfied) for u in voted]
    )
    held = [u for u in voted if is_held_out(u.generation_id)]
    oracle_auc = roc_auc(np.array([u.satisfied for u in held]), np.array([u.true_p for u in held]))
    assert fit.n_test == len(held) > 300
    assert fit.roc_auc > oracle_auc - 0.03
    assert fit.ece < 0.06
    p = fit.model.predict_proba(feature_matrix([u.signals for u in users]))
    assert np.abs(p - np.array([u.true_p for u in users])).mean() < 0.04
    # the bound has teeth: a distorted but equally ranked predictor fails it
    y = np.array([u.satisfied for u in users])
    assert expected_calibration_error(y, p**3) > 0.06
    # one record's probability, as the stream computes it, equals the vectorised one
    assert fit.model.predict_one(users[0].signals) == pytest.approx(p[0], abs=1e-12)


def _write_labelled_history(settings: Settings, n: int, seed: int) -> None:
    users = known_users(n, seed=seed, thumbs_share=1.0)
    records = [DEFAULT_DEFINITION.record(u.gen, u.events, window_end_us=600_000_000) for u in users]
    write_rewards(REWARDS.at(settings.lake_dir), records, f"test-{seed}")


def test_refit_keeps_rules_until_enough_labels_then_activates_and_logs(settings: Settings) -> None:
    store = DefinitionStore(settings, redis_client(settings))
    config = SignalsConfig(min_labels=400)

    assert refit(settings, config).version is None  # no labels at all: nothing to fit
    _write_labelled_history(settings, 150, seed=3)
    few = refit(settings, config)
    assert few.version is not None and not few.activated
    assert store.active_version() == DEFAULT_DEFINITION.version, "rule-based fallback below min_labels"

    _write_labelled_history(settings, 600, seed=4)
    many = refit(settings, config)
    assert many.activated and store.active_version() == many.version
    assert many.roc_auc is not None and many.roc_auc > 0.7

    run = mlflow.get_run(many.run_id)
    assert {"roc_auc", "ece"} <= run.data.metrics.keys()
    assert run.data.params["reward_version"] == many.version

    # the new definition scores implicit feedback with the model, explicit thumbs still decide alone
    definition = store.get(many.version)
    user = known_users(1, seed=9, thumbs_share=0.0)[0]
    sc = definition.score(user.gen, user.events)
    assert sc.label_source == "implicit" and sc.reward == pytest.approx(2 * sc.signals["p_satisfied"] - 1)
    assert definition.score(user.gen, [*user.events, *_thumbs_up(user)]).reward == 1.0


def _thumbs_up(user):  # noqa: ANN001, ANN202
    from signals.events import FeedbackEvent

    return [FeedbackEvent(f"{user.generation_id}-up", "thumbs", 60_000_000, {"value": "up"})]


def test_a_running_worker_refits_as_labels_accumulate(settings: Settings) -> None:
    import threading
    import time

    from flywheel.bus import ensure_topics
    from signals.worker import SignalsWorker

    ensure_topics(settings)
    store = DefinitionStore(settings, redis_client(settings))
    _write_labelled_history(settings, 300, seed=5)
    worker = SignalsWorker(settings, SignalsConfig(refit_every_s=0.5, min_labels=200, poll_timeout_s=0.2))
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while store.active_version() == DEFAULT_DEFINITION.version and time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()
    thread.join(timeout=30)
    assert store.active_version().startswith("sat-300-"), "the worker fitted and activated a model on its own"
