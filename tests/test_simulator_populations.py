"""The simulator's populations: their ground truth behaves as declared, and what they send is valid.

The unit tests judge fixed answers; the last test runs every population against the real serving
app (tiny model) and the real collector, and checks that every event they send passes validation
(no dead letters) and lands in the lake, carrying nothing but the documented properties.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deploy_gate import DeployGate
from flywheel.bus import ensure_topics
from flywheel.bus.reader import read_topic
from flywheel.contract import ModelLineage
from flywheel.event_properties import properties_of
from flywheel.lake.tables import EVENTS
from flywheel.lm import PRESETS
from flywheel.lm.corpus import held_out_files, stdlib_corpus
from flywheel.settings import Settings
from ingest.collector.app import create_app as create_collector
from ingest.worker.loop import IngestWorker
from model_registry import ModelRegistry
from serving import build_serving_app
from simulator.contexts import Context, held_out_contexts
from simulator.populations import (
    BracketPopulation,
    ContentPopulation,
    DecliningPopulation,
    LengthPopulation,
    NoisyPopulation,
    Reaction,
    StylePopulation,
    Truth,
    default_populations,
    populations_named,
    reporting_populations,
    tuning_populations,
)
from simulator.product import Outcome, SimulatedProduct
from simulator.users import SimulationStats

CODE = Context(prompt="def area(width, height):\n    return wid", truth="th * height\n", kind="code")
COMMENT = Context(prompt="x = 1\n# the cache is rebuil", truth="t on every start\n", kind="comment")


def test_contexts_are_seeded_and_cut_from_held_out_code() -> None:
    a, b = held_out_contexts(30, seed=3), held_out_contexts(30, seed=3)
    assert a == b and a != held_out_contexts(30, seed=4)
    assert len(a.code) == 30 and a.comment
    assert all(c.kind == "comment" and c.prompt.splitlines()[-1].lstrip().startswith("#") for c in a.comment)
    # Every context comes from a file the default bootstrap never trained on.
    held = {str(p) for p in held_out_files(PRESETS["default"].n_files, 0)}
    assert {c.source for c in a.code + a.comment} <= held
    corpus = set(stdlib_corpus(PRESETS["default"].n_files, 10**9, 0))
    assert not any(Path(c.source).read_text(encoding="utf-8", errors="replace") in corpus for c in a.code)


def test_length_population_prefers_short_completions_that_end_the_line() -> None:
    pop = LengthPopulation()
    short = pop.truth(CODE, "th * height\n", "stop")
    long = pop.truth(CODE, "th * height\n    x = area(1, 2)\n    y = 3", "length")
    assert short.p_accept == pop.p_good > long.p_accept == pop.p_bad
    assert short.expected_reward > 0 > long.expected_reward


def test_bracket_population_likes_closed_calls_and_dislikes_open_ones() -> None:
    pop = BracketPopulation()
    closed, plain, left_open = (pop.truth(CODE, text, "stop").p_accept for text in ("(1)\n", "th\n", "(1, \n"))
    assert closed == pop.p_closed > plain == pop.p_plain > left_open == pop.p_open


def test_tuning_and_reporting_populations_are_apart() -> None:
    """No population both chose the defaults and reports on them (bench/results/closed_loop_history.md: "Which
    populations chose the defaults")."""
    tuning, reporting = tuning_populations(), reporting_populations()
    assert {p.name for p in tuning} == {"length", "style", "declining"}
    assert not {p.name for p in tuning} & {p.name for p in reporting}
    assert not set(map(repr, tuning)) & set(map(repr, reporting))


def test_populations_by_name_take_the_reporting_kind_and_refuse_an_unknown_name() -> None:
    """`flywheel up --populations` and the closed-loop bench pick populations by name: `noisy` is the
    reporting kind (judging like `style`), and a misspelt name is refused, not skipped."""
    content, noisy = populations_named(["content", "noisy"])
    assert isinstance(content, ContentPopulation)
    assert isinstance(noisy, NoisyPopulation) and isinstance(noisy.inner, StylePopulation)
    with pytest.raises(ValueError, match="unknown populations \\['bracket'\\]"):
        populations_named(["bracket"])


def test_style_population_prefers_its_quote_and_naming() -> None:
    pop = StylePopulation(quote="'", naming="snake")
    liked = pop.truth(CODE, "th + len('x')\n", "stop").p_accept
    neutral = pop.truth(CODE, "th + 1\n", "stop").p_accept
    wrong_quote = pop.truth(CODE, 'th + len("x")\n', "stop").p_accept
    camel = pop.truth(CODE, "th * rowCount\n", "stop").p_accept
    assert liked > neutral > wrong_quote and wrong_quote == camel
    flipped = StylePopulation(quote='"', naming="camel")
    double, single = (flipped.truth(CODE, text, "stop").p_accept for text in ('th + len("x")\n', "th + len('x')\n"))
    assert double > single


def test_content_population_rewards_what_the_author_really_wrote() -> None:
    pop = ContentPopulation()
    exact = pop.truth(CODE, "th * height\n", "stop").p_accept
    close = pop.truth(CODE, "th * heigth\n", "stop").p_accept
    wrong = pop.truth(CODE, "import os\n", "stop").p_accept
    assert exact > close > wrong and exact > 0.9 and wrong < 0.2


def test_declining_population_is_happiest_with_nothing_in_a_comment() -> None:
    pop = DecliningPopulation()
    silence = pop.truth(COMMENT, "", "declined")
    answers = ["t every time\n", "t on every start\n", "x", "t\n    return cache\n"]
    shown = [pop.truth(COMMENT, text, "stop") for text in answers]
    assert not silence.wanted and silence.satisfaction == 1.0
    assert all(silence.satisfaction > t.satisfaction and t.p_accept <= pop.p_unwanted for t in shown)
    # Elsewhere it wants suggestions: a good one beats silence, which is worth what other users give it.
    in_code = pop.truth(CODE, "th * height\n", "stop")
    assert in_code.wanted and in_code.satisfaction > pop.truth(CODE, "", "declined").satisfaction == 0.25


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_noisy_population_thumbs_contradict_actions_at_the_configured_rate(rate: float) -> None:
    pop = NoisyPopulation(contradiction_rate=rate, thumbs_rate=1.0)
    rng = random.Random(7)
    counts: Counter[str] = Counter()
    for _ in range(4000):
        reaction = pop.react(Truth(shown=True, p_accept=0.5, satisfaction=0.5, wanted=True), rng)
        assert reaction.thumbs is not None
        counts["contradicting" if (reaction.thumbs == "up") != reaction.kept else "agreeing"] += 1
    assert abs(counts["contradicting"] / 4000 - rate) < 0.03


def test_reactions_follow_the_truth() -> None:
    pop = LengthPopulation()
    rng = random.Random(1)
    kept = sum(pop.react(Truth(True, 0.85, 0.85, True), rng).kept for _ in range(4000)) / 4000
    assert abs(kept - 0.85) < 0.03
    assert not pop.react(Truth(False, 0.0, 0.25, True), rng).shown


def test_the_demo_table_compares_arms_at_one_population_mix() -> None:
    """Equal versions, arms holding different mixes of users: the raw rates differ, the table's do not."""
    stats = SimulationStats()

    def serve(arm: str, population: str, kept: int, shown: int) -> None:
        for i in range(shown):
            reaction = Reaction(shown=True, accepted=i < kept, kept=i < kept)
            stats.record(Outcome(population, CODE, arm, "1", f"g-{arm}-{population}-{i}", "x", "stop",
                                 Truth(True, 0.5, 0.5, True), reaction, 2))  # fmt: skip

    # both versions: content users accept 5 in 100, length users 40 in 100; the challenger got mostly content users
    serve("champion", "content", 5, 100)
    serve("champion", "length", 120, 300)
    serve("challenger", "content", 15, 300)
    serve("challenger", "length", 40, 100)
    raw = {arm: stats.satisfied[arm] / stats.served[arm] for arm in ("champion", "challenger")}
    assert raw["challenger"] < 0.6 * raw["champion"]  # 0.1375 against 0.3125: what the table showed before
    assert stats.satisfaction("champion") == pytest.approx(stats.satisfaction("challenger"))
    assert stats.satisfaction("champion") == pytest.approx((0.05 * 400 + 0.4 * 400) / 800)
    # a population only one arm has served does not enter either arm's rate
    serve("champion", "style", 100, 100)
    assert stats.satisfaction("champion") == pytest.approx(stats.satisfaction("challenger"))
    # the recent rate: each population's last 100 in the arm (kept ones came first above), at the same weights
    assert stats.recent_accept_rate("champion") == pytest.approx((5 / 100 + 0 / 100) / 2)
    assert stats.recent_accept_rate("challenger") == pytest.approx((0 / 100 + 40 / 100) / 2)


@pytest.mark.slow
def test_every_population_sends_valid_events_that_land_in_the_lake(settings: Settings, tiny_model_dir: Path) -> None:
    ensure_topics(settings)
    registry = ModelRegistry(settings)
    champion = registry.register(tiny_model_dir, ModelLineage(base=str(tiny_model_dir)))
    registry.set_alias("champion", champion)
    registry.set_gate_state(champion, "champion", by="test", reason="first champion")
    DeployGate.from_settings(settings).ensure_split()
    contexts = held_out_contexts(40, seed=0, preset="test")
    key = sorted(settings.write_key_set)[0]
    sent = 0
    shown = 0
    with TestClient(build_serving_app(settings)) as serving, TestClient(create_collector(settings)) as collector:
        product = SimulatedProduct(serving, collector, key, contexts, max_tokens=8)
        rng = random.Random(0)
        for pop in default_populations():
            for i in range(4):
                outcome = product.step(pop, f"{pop.name}-{i}", rng)
                assert outcome.population == pop.name and outcome.model_version == champion
                assert 0.0 <= outcome.truth.p_accept <= 1.0
                sent += outcome.events
                shown += outcome.truth.shown
    assert shown and sent >= 2 * shown  # a shown suggestion gets at least `shown` and an accept or reject
    worker = IngestWorker(settings, group_id="sim-lake", poll_timeout_s=0.3)
    try:
        deadline = time.monotonic() + 60
        feedback = EVENTS.empty()
        while time.monotonic() < deadline:
            worker.run_once()
            lake = EVENTS.read(EVENTS.at(settings.lake_root))
            feedback = lake.filter(lake["type"] != "generation")
            if feedback.height >= sent:
                break
    finally:
        worker.close()
    assert read_topic(settings, settings.dead_letter_topic, timeout_s=3) == []
    assert feedback.height == sent
    for row in feedback.iter_rows(named=True):
        props = json.loads(row["properties"])
        assert props["surface"] == "code-completion"
        assert set(props) <= set(properties_of(row["type"])), props  # the documented names, nothing more
