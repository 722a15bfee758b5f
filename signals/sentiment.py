"""Sentiment of a follow-up message or thumbs comment, in [-1, 1].

New reward definitions use VADER (`DEFAULT_SENTIMENT`; Hutto & Gilbert 2014, "VADER: A Parsimonious
Rule-based Model for Sentiment Analysis of Social Media Text"): a 7,500-entry human-rated lexicon with
rules for negation, intensifiers, "but", capitals and punctuation, shipped in the `vaderSentiment`
package (lexicon in the wheel, no download), deterministic, ~40 us a message. Its compound score is
already in [-1, 1]. The older 55-word `lexicon_sentiment` stays for the definitions that name it (the
built-in `rules-v1` among them). Measured against thumbs on a self-made labelled set of follow-ups:
bench/sentiment_auc.py (bench/README.md).

Anything with the `Sentiment` call signature can be registered in `SENTIMENTS`; a `RewardDefinition`
names the one it uses (`sentiment_name`), so a recompute scores with the same one. A name is tied to
what it scores with: "vader-3.3.2" is that release's lexicon and rules (constraints.txt pins it).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

_POSITIVE = frozenset(
    [
        "thanks",
        "thank",
        "great",
        "perfect",
        "awesome",
        "nice",
        "good",
        "excellent",
        "works",
        "worked",
        "working",
        "love",
        "helpful",
        "correct",
        "exactly",
        "cool",
        "brilliant",
        "amazing",
        "wonderful",
        "fixed",
        "solved",
        "yes",
        "right",
        "neat",
    ]
)
_NEGATIVE = frozenset(
    [
        "wrong",
        "bad",
        "broken",
        "useless",
        "error",
        "errors",
        "fails",
        "failed",
        "failing",
        "incorrect",
        "no",
        "nope",
        "terrible",
        "awful",
        "hate",
        "bug",
        "buggy",
        "worse",
        "worst",
        "stupid",
        "annoying",
        "doesnt",
        "doesn't",
        "didnt",
        "didn't",
        "nonsense",
        "garbage",
        "undo",
        "revert",
        "crash",
        "crashes",
    ]
)
_NEGATIONS = frozenset(["not", "never", "no", "isn't", "isnt", "don't", "dont", "wasn't", "wasnt"])
_WORD = re.compile(r"[a-z']+")


class Sentiment(Protocol):
    def __call__(self, text: str) -> float: ...


def lexicon_sentiment(text: str) -> float:
    """Score `text` in [-1, 1]: (positive - negative) / matched words; a negation flips the next word.

    >>> lexicon_sentiment("thanks, that works great")
    1.0
    >>> lexicon_sentiment("this is wrong and broken")
    -1.0
    >>> lexicon_sentiment("not good")
    -1.0
    >>> lexicon_sentiment("")
    0.0
    """
    score = 0
    matched = 0
    flip = False
    for word in _WORD.findall(text.lower()):
        polarity = 1 if word in _POSITIVE else -1 if word in _NEGATIVE else 0
        if polarity:
            score += -polarity if flip else polarity
            matched += 1
            flip = False
        elif word in _NEGATIONS:
            flip = True
    return score / matched if matched else 0.0


@functools.cache
def _vader() -> SentimentIntensityAnalyzer:
    # Loaded once (reading the lexicon takes ~50 ms); scoring reads it only, so threads may share it.
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


# The old lexicon's words VADER does not rate (code-assistant talk: "works", "fixed", "bug", "crashes"),
# at a mild valence. Chosen a priori (the old list as it was, less its negations, which VADER handles
# itself), not fitted to any labelled data.
_CODE_WORDS = {
    **dict.fromkeys(["correct", "exactly", "fixed", "right", "worked", "working", "works"], 1.5),
    **dict.fromkeys(["bug", "buggy", "crashes", "garbage", "incorrect", "nope", "revert", "undo"], -1.5),
}


@functools.cache
def _vader_code() -> SentimentIntensityAnalyzer:
    analyzer = type(_vader())()
    analyzer.lexicon = {**analyzer.lexicon, **{w: v for w, v in _CODE_WORDS.items() if w not in analyzer.lexicon}}
    return analyzer


def vader_code_sentiment(text: str) -> float:
    """VADER with the old lexicon's code words added where VADER has none (`_CODE_WORDS`).

    >>> vader_sentiment("works now") == 0.0 < vader_code_sentiment("works now")
    True
    """
    if not text.strip():
        return 0.0
    return float(_vader_code().polarity_scores(text)["compound"])


def vader_sentiment(text: str) -> float:
    """VADER's compound score of `text`, in [-1, 1] (0 for text with no sentiment-bearing word).

    >>> vader_sentiment("thanks, that works great") > 0.5
    True
    >>> vader_sentiment("this is wrong and broken") < -0.5
    True
    >>> vader_sentiment("not good") < 0 < vader_sentiment("good")
    True
    >>> vader_sentiment("")
    0.0
    """
    if not text.strip():
        return 0.0
    return float(_vader().polarity_scores(text)["compound"])


DEFAULT_SENTIMENT = "vader-3.3.2"
SENTIMENTS: dict[str, Sentiment] = {
    "lexicon-v1": lexicon_sentiment,
    DEFAULT_SENTIMENT: vader_sentiment,
    "vader-code-3.3.2": vader_code_sentiment,
}
