"""The satisfaction model: metrics against naive references, calibration on users whose
satisfaction is known, and the refit loop: recorded always, activated only when it beats the
surface's rules on held-out labels, on the rules' scale, reproducible, one surface at a time."""

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
from signals.reward import DEFAULT_DEFINITION, builtin_definition
from signals.satisfaction import feature_matrix, fit_satisfaction, is_held_out, refit
from signals.sink import write_rewards
from simulator.telemetry import MISJUDGED_COEF, known_users


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


def _write_labelled_history(
    settings: Settings, n: int, seed: int, coef: dict[str, float] | None = None, surface: str = "code-completion"
) -> None:
    users = known_users(n, seed=seed, thumbs_share=1.0, coef=coef, surface=surface)
    definition = builtin_definition(surface)
    records = [definition.record(u.gen, u.events, window_end_us=600_000_000) for u in users]
    write_rewards(REWARDS.at(settings.lake_root), records, f"test-{surface}-{seed}")


def test_refit_below_min_labels_is_stored_and_rules_stay(settings: Settings) -> None:
    store = DefinitionStore(settings, redis_client(settings))
    assert refit(settings, SignalsConfig(min_labels=400)).version is None  # no labels at all: nothing to fit
    _write_labelled_history(settings, 150, seed=3, coef=MISJUDGED_COEF)
    few = refit(settings, SignalsConfig(min_labels=400))
    assert few.version is not None and not few.activated and "min_labels" in few.reason
    assert store.active_version("code-completion") == DEFAULT_DEFINITION.version
    assert few.version in store.versions(), "the refit is recorded"


def test_a_refit_no_better_than_the_rules_is_recorded_and_not_activated(settings: Settings) -> None:
    """Users whose satisfaction the rules already capture: the model's gain is within noise."""
    store = DefinitionStore(settings, redis_client(settings))
    _write_labelled_history(settings, 600, seed=4)
    result = refit(settings, SignalsConfig(min_labels=100))
    assert not result.activated and "AUC gain" in result.reason, result
    assert store.active_version("code-completion") == DEFAULT_DEFINITION.version
    run = mlflow.get_run(result.run_id)
    assert run.data.params["activated"] == "False" and "AUC gain" in run.data.tags["decision"]
    logged = {"auc_model_ci_low", "auc_rules_ci_high", "auc_gain_ci_low", "ece_model", "ece_rules"}
    assert logged <= run.data.metrics.keys()


def test_a_refit_that_beats_the_rules_is_activated_on_the_same_scale_and_reproducible(settings: Settings) -> None:
    store = DefinitionStore(settings, redis_client(settings))
    _write_labelled_history(settings, 600, seed=4, coef=MISJUDGED_COEF)
    config = SignalsConfig(min_labels=100)
    many = refit(settings, config)
    assert many.activated and store.active_version("code-completion") == many.version, many
    assert many.roc_auc is not None and many.rules_roc_auc is not None and many.roc_auc > many.rules_roc_auc + 0.02
    run = mlflow.get_run(many.run_id)
    assert run.data.params["reward_version"] == many.version and run.data.params["surface"] == "code-completion"
    assert run.data.metrics["auc_gain_ci_low"] > 0

    # the same data gives the same version (seeded bootstrap, labels sorted by generation id)
    assert refit(settings, config).version == many.version

    # scores on the rules' scale: implicit in [-1, 1], explicit thumbs still decide alone, and a
    # generation with no signal gets exactly what the model says of no signal
    definition = store.get(many.version)
    users = known_users(200, seed=9, thumbs_share=0.0)
    scores = [definition.score(u.gen, u.events) for u in users]
    assert all(sc.label_source == "implicit" and -1.0 <= sc.reward <= 1.0 for sc in scores)
    sc = scores[0]
    assert sc.reward == pytest.approx(2 * sc.signals["p_satisfied"] - 1)
    assert definition.score(users[0].gen, [*users[0].events, *_thumbs_up(users[0])]).reward == 1.0
    silent = definition.score(users[0].gen, [])
    assert silent.label_source == "default"
    assert silent.reward == pytest.approx(2 * definition.satisfaction.predict_one({}) - 1)  # type: ignore[union-attr]
    assert silent.reward != DEFAULT_DEFINITION.default_reward


def test_a_model_fitted_on_one_surface_never_scores_another(settings: Settings) -> None:
    """Chat thumbs the rules misjudge: a chat model is activated for chat only; code completion keeps
    its rules, and refitting code completion finds none of chat's labels."""
    store = DefinitionStore(settings, redis_client(settings))
    _write_labelled_history(settings, 600, seed=4, coef=MISJUDGED_COEF, surface="chat")
    chat = refit(settings, SignalsConfig(min_labels=100), surface="chat")
    assert chat.activated and chat.version is not None and chat.version.startswith("sat-chat-")
    assert store.active_version("chat") == chat.version
    assert store.active_version("code-completion") == DEFAULT_DEFINITION.version
    assert refit(settings, SignalsConfig(min_labels=100)).n_labels == 0
    code = known_users(1, seed=9, thumbs_share=0.0)[0]
    with pytest.raises(ValueError, match="scores surface 'chat'"):
        store.get(chat.version).record(code.gen, code.events, window_end_us=600_000_000)


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
    _write_labelled_history(settings, 300, seed=5, coef=MISJUDGED_COEF)
    worker = SignalsWorker(settings, SignalsConfig(refit_every_s=0.5, min_labels=200, poll_timeout_s=0.2))
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while store.active_version("code-completion") == DEFAULT_DEFINITION.version and time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()
    thread.join(timeout=30)
    active = store.active_version("code-completion")
    assert active.startswith("sat-code-completion-300-"), "the worker fitted and activated a model on its own"


def test_a_products_own_surface_is_read_by_the_dashboard_and_refits_like_a_built_in_one(settings: Settings) -> None:
    """A surface no built-in names ('docs'): once signals pins it (`adopt`, at its first generation), the
    dashboard's reader counts its rewards, and a refit on its thumbs is activated for it alone."""
    from deploy_gate.metrics import latest_rewards

    store = DefinitionStore(settings, redis_client(settings))
    _write_labelled_history(settings, 600, seed=4, coef=MISJUDGED_COEF, surface="docs")
    assert store.adopt("docs") == "docs-rules-v1"
    frame, read = latest_rewards(settings.lake_dir, lake_uri=settings.lake_root)
    assert frame is not None and frame.height == 600 and "docs-rules-v1" in str(read)
    docs = refit(settings, SignalsConfig(min_labels=100), surface="docs")
    assert docs.activated and docs.version is not None and docs.version.startswith("sat-docs-")
    assert store.active_version("docs") == docs.version
    assert store.active_version("code-completion") == DEFAULT_DEFINITION.version
    assert docs.version in str(latest_rewards(settings.lake_dir, lake_uri=settings.lake_root)[1])
