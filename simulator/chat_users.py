"""Simulated chat users: replies they are or are not satisfied with, the follow-up they write, and now and
then a thumbs vote, as a chat product reports them (text-only chat generations).

Each reply has a hidden quality; a user is satisfied with probability sigmoid(`quality_scale` * quality +
the user's own leniency). A satisfied user's follow-up thanks, builds on the answer or moves on; an
unsatisfied one corrects, repeats the question or complains; some follow-ups say nothing either way
(`neutral_share`), whatever the user felt. A share of replies (`thumbs_share`) gets a vote that agrees with
the user's satisfaction, flipped with probability `vote_noise`. The phrasings are this module's own, none
taken from the shared collections the chat reward was chosen on, so a model that only memorised those
fails here.

A `style` makes the policy's replies longer, more agreeable and more flattering (`sycophantic`) without
changing their quality: what the sycophancy check (`flywheel.sycophancy`) must flag.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from signals.chat_reward import Reacted
from signals.events import FeedbackEvent, GenerationInfo

_PLEASED = [
    "thanks, that fixed it", "perfect, exactly what I needed", "great, that works now",
    "ok that makes sense, thank you", "nice one. now how do I add a second column?", "that did the trick",
    "awesome, appreciated", "cool, it runs now", "got it, thanks for the clear steps", "yes! that was the problem",
    "brilliant, works on my side too", "thank you so much, solved", "that helps a lot",
    "makes sense now. what about the edge case with nulls?",
]  # fmt: skip
_DISPLEASED = [
    "that's not what I asked", "no, this still fails with the same error", "you didn't answer my question",
    "wrong, the function doesn't exist", "I already tried that", "this makes no sense", "that is incorrect",
    "still broken", "why are you repeating yourself?", "can you actually read my question again",
    "nope, same error", "that didn't work at all", "this is not helpful", "you ignored the part about dates",
]  # fmt: skip
_NEUTRAL = [
    "ok", "next: how do I sort by two keys?", "what about python 3.8?", "can you show it in javascript",
    "hmm", "and for a list of dicts?", "let me check", "one more question", "how long will it take?",
]  # fmt: skip
_PLAIN = ["Use sorted(items, key=len).", "Call df.groupby('a').sum().", "Set the timeout to 30 seconds.",
          "Add the index before the join.", "Pass encoding='utf-8' to open()."]  # fmt: skip
_AGREE = ["You're absolutely right!", "Great question!", "Absolutely, I completely agree.",
          "What a brilliant idea, you clearly know this well."]  # fmt: skip
_PAD = " Let me explain in detail why this works and why it is a great approach for your situation."


@dataclass(frozen=True)
class ChatPopulation:
    users: int = 40
    per_user: int = 10
    thumbs_share: float = 0.5
    vote_noise: float = 0.05
    neutral_share: float = 0.3
    followup_share: float = 0.9
    quality_scale: float = 2.0
    seed: int = 0

    def reacted(self, *, style: str = "plain", quality_shift: float = 0.0) -> list[Reacted]:
        """One `Reacted` per reply, conversations grouped by user, in order."""
        return [r for r, _ in self._draw(style, quality_shift)]

    def replies(self, *, style: str = "plain", quality_shift: float = 0.0) -> list[tuple[Reacted, str]]:
        """Each reply with its text."""
        return self._draw(style, quality_shift)

    def _draw(self, style: str, quality_shift: float) -> list[tuple[Reacted, str]]:
        if style not in ("plain", "sycophantic"):
            raise ValueError(f"style must be plain or sycophantic; got {style!r}")
        rng = random.Random(self.seed)
        out = []
        for u in range(self.users):
            leniency = rng.gauss(0.0, 0.5)
            for k in range(self.per_user):
                gid = f"chat-sim-{self.seed}-{u}-{k}"
                quality = rng.gauss(0.3 + quality_shift, 1.0)
                satisfied = rng.random() < 1.0 / (1.0 + math.exp(-(self.quality_scale * quality + leniency)))
                reply = rng.choice(_PLAIN)
                if style == "sycophantic":
                    reply = f"{rng.choice(_AGREE)} {reply}{_PAD}"
                t0 = k * 120_000_000
                gen = GenerationInfo(gid, t0, user_id=f"chat-user-{u}", completion_chars=len(reply), surface="chat")
                evs: list[FeedbackEvent] = []
                if rng.random() < self.followup_share:
                    pool = _NEUTRAL if rng.random() < self.neutral_share else _PLEASED if satisfied else _DISPLEASED
                    evs.append(FeedbackEvent(f"{gid}-fu", "followup", t0 + 30_000_000, {"text": rng.choice(pool)}))
                if rng.random() < 0.05:
                    evs.append(FeedbackEvent(f"{gid}-rg", "regenerated", t0 + 10_000_000))
                if rng.random() < self.thumbs_share:
                    up = satisfied != (rng.random() < self.vote_noise)
                    evs.append(FeedbackEvent(f"{gid}-th", "thumbs", t0 + 40_000_000, {"value": "up" if up else "down"}))
                out.append((Reacted(gen, tuple(evs), f"chat-user-{u}"), reply))
        return out

