"""Sentiment of a follow-up message or thumbs comment, in [-1, 1].

The default is a small lexicon with negation handling: it needs no download and
is deterministic (stream and batch agree). Anything with the `Sentiment` call
signature can replace it in a `RewardDefinition`; the definition's
`sentiment_name` then names it, so a recompute knows which one was used.
"""

from __future__ import annotations

import re
from typing import Protocol

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
