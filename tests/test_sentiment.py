"""Follow-up sentiment from VADER (the `vaderSentiment` package's lexicon and rules), behind `Sentiment`."""

from __future__ import annotations

import pytest

from signals import features
from signals.events import FeedbackEvent
from signals.reward import RewardDefinition
from signals.sentiment import DEFAULT_SENTIMENT, SENTIMENTS, vader_code_sentiment, vader_sentiment
from tests.helpers import bench_module

POSITIVE = ["thanks, that worked", "perfect, exactly what I needed", "great explanation!", "awesome, thank you"]
NEGATIVE = ["that's wrong", "this is useless", "still getting the same error", "terrible, nothing runs"]


@pytest.mark.parametrize("sentiment", [vader_sentiment, vader_code_sentiment])
def test_positive_follow_ups_score_above_negative_ones(sentiment) -> None:  # noqa: ANN001
    assert min(map(sentiment, POSITIVE)) > 0.3 > -0.3 > max(map(sentiment, NEGATIVE))
    assert sentiment("") == 0.0 and -1.0 <= sentiment("NO!!! this is AWFUL, the worst") < -0.8
    assert sentiment("not good") < 0 < sentiment("good")  # negation, handled by VADER's rules


def test_a_reward_definition_scores_follow_ups_with_vader() -> None:
    definition = RewardDefinition(version="vader-test", sentiment_name=DEFAULT_SENTIMENT)
    assert definition.sentiment is vader_sentiment and DEFAULT_SENTIMENT in SENTIMENTS
    out = features.followup([FeedbackEvent("e", "followup", 1, {"text": "thanks, works great"})], definition.sentiment)
    assert out["followup"] == 1.0 and out["followup_sentiment"] == pytest.approx(vader_sentiment("thanks, works great"))


def test_on_the_labelled_set_vader_beats_chance_with_its_interval() -> None:
    bench = bench_module("sentiment_auc")
    rows = bench.load(bench.DATA)
    pos = [vader_sentiment(t) for t, up in rows if up]
    neg = [vader_sentiment(t) for t, up in rows if not up]
    low, high = bench.interval(pos, neg, 300, seed=0)
    assert 0.5 < low <= bench.auc(pos, neg) <= high
