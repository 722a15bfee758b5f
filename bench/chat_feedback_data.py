"""Readers of the shared chat-feedback collections (`../shared/chat-feedback`, see its README): each judged
system reply as a `JudgedTurn` (dialogue id, the user's message before it, the reply, the user's next
message, and whether it was judged good). Read in place, never copied into the repository.

- ab-redial (MIT): `annotated_turns.csv`, one row per annotator and three judged turns per dialogue. A
  turn's label is its annotators' mean `overall` score: good at >= `good_at` (4), bad at <= `bad_at`
  (2); turns in between are left out.
- eurtad (Apache-2.0; dialogue texts under their upstream licences): `filtered_dialogs/*/*/*.json`, each
  annotated turn judged by several annotators with an error type (E1-E10, empty for none). A turn is bad
  when most of its annotators name an error, good when none does; split ties are left out. In the files,
  annotation `turn` t judges `turns[t-1].response`, and `turns[t].utterance` is the user's reaction
  (the Self-Feeding Chatbot files judge the last reply, with no turn index). With `reacted=True`, a bad turn is
  kept only when most of the annotators who name its error say the user reacted to it in the next message
  (UR2 repeat or rephrase, UR3 / UR4 make the system aware, UR5 ask for clarification), not UR1 (ignore and go
  on): the errors a follow-up can show.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "chat-feedback"


@dataclass(frozen=True)
class JudgedTurn:
    dialogue: str
    context: str  # the user's message the reply answers
    reply: str
    followup: str  # the user's next message
    good: bool
    source: str = ""


def _strip_speaker(text: str) -> str:
    return text.split("\t", 1)[-1].strip()


def ab_redial(root: Path = SHARED, good_at: float = 4.0, bad_at: float = 2.0) -> list[JudgedTurn]:
    path = root / "ab-redial" / "annotated_turns.csv"
    scores: dict[tuple[str, int], list[float]] = defaultdict(list)
    texts: dict[tuple[str, int], tuple[str, str, str]] = {}
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            for k in (1, 2, 3):
                raw = (row.get(f"overall{k}") or "").strip()
                if not raw:
                    continue
                key = (row["ConvId"], k)
                scores[key].append(float(raw))
                base = 4 * (k - 1)
                texts[key] = tuple(_strip_speaker(row[f"utterance{base + i}"]) for i in (1, 2, 3))  # type: ignore[assignment]
    out = []
    for key in sorted(scores):
        mean = statistics.mean(scores[key])
        if bad_at < mean < good_at:
            continue
        context, reply, followup = texts[key]
        out.append(JudgedTurn(f"ab-redial/{key[0]}", context, reply, followup, mean >= good_at, "ab-redial"))
    return out


def _is_error(error_type: object) -> bool:
    return isinstance(error_type, str) and error_type.startswith("E")


_REACTED = ("UR2", "UR3", "UR4", "UR5")


def eurtad(root: Path = SHARED, *, reacted: bool = False) -> list[JudgedTurn]:
    out = []
    for path in sorted((root / "eurtad" / "data" / "analysis" / "filtered_dialogs").glob("*/*/*.json")):
        corpus = path.parts[-3]
        doc = json.loads(path.read_text(encoding="utf-8"))
        turns = doc["turns"]
        dialogue = f"eurtad/{corpus}/{doc['unique_id']}"
        if "correction" in doc:  # Self-Feeding Chatbot: the last user message reacts to the reply before it
            judged = [(len(turns) - 1, doc["annotations"])]
        else:
            judged = [(int(a["turn"]), a["annotation"]) for a in doc["annotations"]]
        for t, annotators in judged:
            if not 1 <= t < len(turns):
                continue
            errors = sum(_is_error(a.get("error_type")) for a in annotators)
            if 0 < errors <= len(annotators) / 2:
                continue  # annotators split: no label
            if reacted and errors:
                naming = [a for a in annotators if _is_error(a.get("error_type"))]
                if sum(a.get("user_reaction") in _REACTED for a in naming) <= len(naming) / 2:
                    continue
            prev, nxt = turns[t - 1], turns[t]
            out.append(
                JudgedTurn(dialogue, prev["utterance"].strip(), prev["response"].strip(), nxt["utterance"].strip(),
                           errors == 0, f"eurtad/{corpus}")  # fmt: skip
            )
    return out
