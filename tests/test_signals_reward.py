"""Each signal on hand-written event sequences, and the reward definition's ordering."""

from __future__ import annotations

import math

import pytest

from signals import features
from signals.events import FeedbackEvent, GenerationInfo
from signals.reward import DEFAULT_DEFINITION, RewardDefinition, RuleWeights
from signals.sentiment import lexicon_sentiment

S = 1_000_000  # µs per second
GEN = GenerationInfo("g1", ts_us=0, user_id="u1", model_version="3", arm="champion", completion_chars=20)


def ev(t: float, type_: str, **props: object) -> FeedbackEvent:
    return FeedbackEvent(f"e{t}-{type_}", type_, int(t * S), props)


def reward(*events: FeedbackEvent, gen: GenerationInfo = GEN) -> float:
    return DEFAULT_DEFINITION.score(gen, list(events), window_end_us=600 * S).reward


# ---------------------------------------------------------------- each signal


def test_thumbs_latest_vote_wins_and_reads_comment_sentiment() -> None:
    out = features.thumbs(
        [ev(1, "thumbs", value="up"), ev(2, "thumbs", value="down", comment="this is wrong")],
        lexicon_sentiment,
    )
    assert out == {"thumbs": -1.0, "thumbs_comment_sentiment": -1.0}
    assert features.thumbs([ev(1, "thumbs", value="sideways")], lexicon_sentiment) == {}


def test_decision_partial_accept_fraction_and_shown_implied() -> None:
    out = features.decision([ev(1, "accepted", accepted_chars=5, total_chars=20)])
    assert out == {"shown": 1.0, "accepted": 1.0, "accepted_fraction": 0.25, "accepted_chars": 5.0}
    assert features.decision([ev(1, "shown"), ev(2, "rejected")]) == {"shown": 1.0, "rejected": 1.0}
    assert features.decision([ev(1, "shown"), ev(3, "ignored")]) == {"shown": 1.0, "ignored": 1.0}
    assert features.decision([ev(1, "accepted")])["accepted_fraction"] == 1.0  # no char counts: a full accept
    assert features.decision([]) == {}


def test_undo_inside_and_after_the_undo_window() -> None:
    assert features.undo([ev(3, "undone", seconds_after_accept=2.0)], undo_window_s=30) == {
        "undone": 1.0,
        "undo_s": 2.0,
    }
    assert features.undo([ev(90, "undone", seconds_after_accept=80.0)], undo_window_s=30)["undone"] == 0.5
    # measured from the accept when the property is missing
    assert features.undo([ev(1, "accepted"), ev(4, "undone")], undo_window_s=30)["undo_s"] == 3.0


def test_edit_distance_summed_and_ratio_capped() -> None:
    out = features.edits(
        [ev(5, "edited", edit_distance=4), ev(6, "edited", edit_distance=6)], completion_chars=20
    )
    assert out == {"edit_distance": 10.0, "edit_ratio": 0.5}
    assert features.edits([ev(5, "edited", edit_distance=99)], completion_chars=20)["edit_ratio"] == 1.0


def test_retention_checkpoints_take_first_measurement_at_or_after() -> None:
    evs = [
        ev(1, "retained", seconds_after_accept=0, fraction_present=1.0),
        ev(31, "retained", seconds_after_accept=30, fraction_present=0.8),
        ev(130, "retained", seconds_after_accept=125, fraction_present=0.5),
    ]
    out = features.retention(evs, accepted_chars=10.0)
    assert out["retention"] == 0.5 and out["retained_chars"] == 5.0
    assert out["retained_0s"] == 1.0 and out["retained_5s"] == 0.8 and out["retained_30s"] == 0.8
    assert out["retained_120s"] == 0.5
    assert "retained_300s" not in out  # never measured that late: not observed, not zero


def test_copy_regenerate_followup_dwell() -> None:
    assert features.copy_regenerate([ev(1, "copied")]) == {"copied": 1.0}
    assert features.copy_regenerate([ev(1, "regenerated")]) == {"regenerated": 1.0}
    out = features.followup([ev(9, "followup", text="thanks, works great")], lexicon_sentiment)
    assert out == {"followup": 1.0, "followup_sentiment": 1.0}
    assert features.dwell([ev(1, "shown"), ev(3.5, "accepted")]) == {"dwell_s": 2.5}


@pytest.mark.parametrize(
    "fn",
    [
        lambda evs: features.thumbs(evs, lexicon_sentiment),
        features.decision,
        lambda evs: features.undo(evs, 30.0),
        lambda evs: features.edits(evs, 10),
        lambda evs: features.retention(evs, 5.0),
        features.copy_regenerate,
        lambda evs: features.followup(evs, lexicon_sentiment),
        features.dwell,
    ],
)
def test_every_signal_is_empty_on_no_events_and_finite_on_garbage(fn) -> None:  # noqa: ANN001
    assert fn([]) == {}
    garbage = [
        ev(
            1,
            t,
            accepted_chars="x",
            total_chars=None,
            edit_distance=float("nan"),
            seconds_after_accept="?",
            fraction_present=float("inf"),
            value="up",
            text=None,
            comment=None,
        )
        for t in ("shown", "accepted", "undone", "edited", "retained", "copied", "followup", "thumbs")
    ]
    assert all(math.isfinite(v) for v in fn(garbage).values())


# ---------------------------------------------------------------- the reward


def test_published_accept_reject_reward() -> None:
    assert reward(ev(1, "shown"), ev(2, "accepted")) == 0.75
    assert reward(ev(1, "shown"), ev(2, "rejected")) == -0.25


def test_ordering_thumbs_up_accept_above_undone_accept_above_reject() -> None:
    thumbs_up = reward(ev(1, "accepted"), ev(5, "thumbs", value="up"))
    undone = reward(ev(1, "accepted"), ev(3, "undone", seconds_after_accept=2.0))
    rejected = reward(ev(1, "shown"), ev(2, "rejected"))
    assert thumbs_up > undone > rejected


def test_ordering_retained_above_deleted_above_reject_and_partial_below_full() -> None:
    kept = reward(ev(1, "accepted"), ev(60, "retained", seconds_after_accept=59, fraction_present=1.0))
    deleted = reward(ev(1, "accepted"), ev(60, "retained", seconds_after_accept=59, fraction_present=0.0))
    partial = reward(ev(1, "accepted", accepted_chars=5, total_chars=20))
    assert kept > deleted > reward(ev(2, "rejected"))
    assert reward(ev(1, "accepted")) > partial > 0
    assert reward(ev(1, "accepted"), ev(5, "edited", edit_distance=15)) < reward(ev(1, "accepted"))
    assert reward(ev(1, "shown"), ev(2, "ignored")) > reward(ev(1, "shown"), ev(2, "rejected"))


def test_explicit_overrides_implicit_and_comment_disagreement_lowers_confidence() -> None:
    sc = DEFAULT_DEFINITION.score(GEN, [ev(1, "rejected"), ev(2, "thumbs", value="up")])
    assert (sc.reward, sc.label_source, sc.confidence) == (1.0, "explicit", 1.0)
    sc = DEFAULT_DEFINITION.score(GEN, [ev(2, "thumbs", value="up", comment="wrong and broken")])
    assert sc.confidence < 1.0


def test_no_feedback_gets_the_default_with_low_confidence() -> None:
    sc = DEFAULT_DEFINITION.score(GEN, [])
    assert (sc.reward, sc.label_source) == (0.0, "default")
    assert sc.confidence < 0.1


def test_declined_never_shown_is_neutral_with_full_confidence() -> None:
    declined = GenerationInfo("g2", ts_us=0, finish_reason="declined", completion_chars=0)
    sc = DEFAULT_DEFINITION.score(declined, [])
    assert (sc.reward, sc.label_source, sc.confidence) == (0.0, "default", 1.0)
    assert sc.signals["declined"] == 1.0
    # above a rejected suggestion, below an accepted one: not suggesting is neither good nor bad
    assert reward(ev(2, "rejected")) < sc.reward < reward(ev(2, "accepted"))


def test_events_after_the_window_end_are_ignored() -> None:
    sc = DEFAULT_DEFINITION.score(
        GEN, [ev(1, "accepted"), ev(700, "thumbs", value="down")], window_end_us=600 * S
    )
    assert sc.label_source == "implicit" and sc.reward == 0.75


def test_event_order_in_the_input_does_not_matter() -> None:
    evs = [ev(1, "shown"), ev(2, "accepted"), ev(9, "retained", seconds_after_accept=7, fraction_present=0.5)]
    assert DEFAULT_DEFINITION.score(GEN, evs) == DEFAULT_DEFINITION.score(GEN, list(reversed(evs)))


def test_spec_round_trip_and_validation() -> None:
    d = RewardDefinition(version="rules-v2", weights=RuleWeights(accept=0.8))
    assert RewardDefinition.from_spec(d.to_spec()) == d
    with pytest.raises(ValueError, match="undone must be above reject"):
        RuleWeights(undone=-0.5)
    with pytest.raises(ValueError, match="version"):
        RewardDefinition(version="a b")


def test_retention_checks_at_10_and_15_minutes_change_the_reward_within_the_default_window() -> None:
    """The deployment's default window (16 minutes) holds the 10- and 15-minute checks of a suggestion
    accepted a few seconds in; each lowers the reward as the rules say (credit scaled by
    retention_floor + (1 - retention_floor) * the latest fraction present)."""
    from flywheel.settings import Settings

    window_end = int(DEFAULT_DEFINITION.window(Settings.model_fields["reward_window_s"].default) * S)
    assert window_end >= (3 + DEFAULT_DEFINITION.latest_checkpoint_s) * S

    def accepted_then(*checks: tuple[int, float]) -> float:
        evs = [ev(1, "shown"), ev(3, "accepted")]
        evs += [ev(3 + c, "retained", seconds_after_accept=c, fraction_present=f) for c, f in checks]
        sc = DEFAULT_DEFINITION.score(GEN, evs, window_end_us=window_end)
        if checks:
            assert sc.signals[f"retained_{checks[-1][0]}s"] == checks[-1][1]
        return sc.reward

    w = DEFAULT_DEFINITION.weights
    five = accepted_then((300, 1.0))
    ten = accepted_then((300, 1.0), (600, 0.5))
    fifteen = accepted_then((300, 1.0), (600, 0.5), (900, 0.0))
    assert five == pytest.approx(w.accept)
    assert ten == pytest.approx(w.accept * (w.retention_floor + (1 - w.retention_floor) * 0.5))
    assert fifteen == pytest.approx(w.accept * w.retention_floor)
    assert five > ten > fifteen

    # the 10-minute window this used to be would have dropped both checks: they must not be ignored
    short = DEFAULT_DEFINITION.score(
        GEN, [ev(3, "accepted"), ev(903, "retained", seconds_after_accept=900, fraction_present=0.0)],
        window_end_us=600 * S,
    )
    assert short.reward == pytest.approx(w.accept) != fifteen


def test_a_definition_scores_only_its_own_surface() -> None:
    from signals.reward import builtin_definition

    chat = GenerationInfo("c1", ts_us=0, completion_chars=20, surface="chat")
    assert builtin_definition("chat").record(chat, [ev(2, "thumbs", value="up")], window_end_us=9 * S).reward == 1.0
    with pytest.raises(ValueError, match="scores surface 'code-completion'"):
        DEFAULT_DEFINITION.record(chat, [], window_end_us=S)
