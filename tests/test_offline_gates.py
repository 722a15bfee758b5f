"""Offline gates: each passes a healthy candidate and fails a harmed one with its reason; OPE is right
on data whose true value is known; a failed gate blocks approval and shows on the version's API view.

Real parts: tiny bootstrapped models, the real registry (MLflow on SQLite), Redis and the lake.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import SecretStr
from typer.testing import CliRunner

from deploy_gate.app import create_app
from deploy_gate.cli import app as gate_cli
from deploy_gate.gate import DeployGate
from deploy_gate.offline import GATES, OfflineGateConfig, OfflineGates, ope
from deploy_gate.offline.gates import run_gates
from deploy_gate.offline.heldout import held_out
from deploy_gate.offline.logged import LoggedSample, LoggedTraffic, champion_traffic
from deploy_gate.offline.measure import sample
from flywheel.connections import redis_client
from flywheel.contract import Event, EventType, GenerationRecord, ModelLineage, RewardRecord
from flywheel.lake.tables import EVENTS, REWARDS, events_frame, rewards_frame
from flywheel.lm import Policy, load_policy
from flywheel.settings import Settings, get_settings
from flywheel.signing import sign_generation
from model_registry import ModelRegistry, OfflineGateReport, OfflineGateResult
from trainer.config import TrainerConfig
from trainer.data import Sample
from trainer.loop import score_samples, train_policy
from trainer.scoring import scorer_for

CONFIG = OfflineGateConfig(
    n_prompts=8, logged_prompts=4, n_text_windows=40, lm_min_windows=20, ope_min_samples=20, ope_min_ess=5,
    bootstrap_samples=200, num_threads=1,
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run many times faster on one thread on a busy machine (the tests' own sampling too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the off-policy estimators on a synthetic bandit whose value is known ----------------------------


def _bandit(n: int, seed: int) -> tuple[float, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(true value of pi, rewards, log weights, qhat(x, a) logged, qhat(x, pi)) for a 5-armed bandit."""
    rng = np.random.default_rng(seed)
    k, n_ctx = 5, 20
    p = rng.uniform(0.1, 0.9, (n_ctx, k))  # P(reward 1 | context, action)
    mu = rng.dirichlet(np.ones(k) * 2, n_ctx)  # the behaviour (champion) policy
    pi = rng.dirichlet(np.ones(k) * 2, n_ctx)  # the target (candidate) policy
    true_value = float(np.mean((pi * p).sum(1)))  # contexts are uniform
    x = rng.integers(0, n_ctx, n)
    a = np.array([rng.choice(k, p=mu[c]) for c in x])
    r = (rng.random(n) < p[x, a]).astype(float)
    qhat = np.clip(p + rng.normal(0, 0.1, p.shape), 0, 1)  # a reward model with some error
    return true_value, r, np.log(pi[x, a]) - np.log(mu[x, a]), qhat[x, a], (pi * qhat).sum(1)[x]


def test_snips_and_dr_recover_the_true_value_and_agree_with_a_naive_reference() -> None:
    true_value, r, log_w, q_logged, q_target = _bandit(20_000, seed=1)
    est = ope.estimate(r, log_w, q_logged, q_target, bootstrap_samples=200, seed=3)

    # Naive reference: the textbook formulas, one sample at a time, with plain ratios.
    w = [float(np.exp(v)) for v in log_w]
    naive_snips = sum(wi * ri for wi, ri in zip(w, r, strict=True)) / sum(w)
    naive_dr = sum(q_target) / len(q_target) + sum(
        wi * (ri - qi) for wi, ri, qi in zip(w, r, q_logged, strict=True)
    ) / sum(w)
    naive_ess = sum(w) ** 2 / sum(wi * wi for wi in w)
    assert est.snips.value == pytest.approx(naive_snips, rel=1e-9)
    assert est.dr.value == pytest.approx(naive_dr, rel=1e-9)
    assert est.ess == pytest.approx(naive_ess, rel=1e-9)

    for e in (est.snips, est.dr):
        assert abs(e.value - true_value) < 0.02
        assert e.ci[0] <= true_value <= e.ci[1]
    assert 1 <= est.ess < est.n
    # The behaviour's own value differs from the target's: the estimate is not just the logged mean.
    assert abs(est.behaviour_mean - true_value) > 0.02
    # Seeded: the same seed gives the same interval.
    again = ope.estimate(r, log_w, q_logged, q_target, bootstrap_samples=200, seed=3)
    assert again.dr.ci == est.dr.ci


def test_dr_with_a_good_reward_model_is_tighter_than_snips() -> None:
    _, r, log_w, q_logged, q_target = _bandit(5_000, seed=2)
    est = ope.estimate(r, log_w, q_logged, q_target, bootstrap_samples=300, seed=0)
    assert est.dr.ci[1] - est.dr.ci[0] < est.snips.ci[1] - est.snips.ci[0]


def test_a_paired_direct_method_term_cancels_what_the_contexts_share() -> None:
    """Paired (the target's completion of each logged context): the champion against itself has d = 0 exactly;
    unpaired, the contexts' spread shows up as a wide interval around it."""
    rng = np.random.default_rng(4)
    q = rng.normal(0.2, 0.4, 300)  # qhat of the logged completions: contexts differ a lot
    r = q + rng.normal(0, 0.1, 300)
    paired = ope.estimate(r, np.zeros(300), q, q, bootstrap_samples=200, seed=1, paired=True)
    unpaired = ope.estimate(r, np.zeros(300), q, q, bootstrap_samples=200, seed=1)
    assert paired.dr_minus_behaviour.value == pytest.approx(0.0, abs=1e-12)
    assert paired.dr_minus_behaviour.ci == pytest.approx((0.0, 0.0), abs=1e-12)
    low, high = unpaired.dr_minus_behaviour.ci
    assert high - low > 0.05
    with pytest.raises(ValueError, match="one value per logged sample"):
        ope.estimate(r, np.zeros(300), q, q[:10], paired=True)


def test_huge_log_weights_do_not_overflow() -> None:
    log_w = np.array([800.0, 799.0, -50.0])
    assert ope.snips([1.0, 0.0, 0.0], log_w) == pytest.approx(1 / (1 + np.exp(-1)))
    assert ope.effective_sample_size(log_w) > 1.0
    with pytest.raises(ValueError, match="NaN"):
        ope.snips([1.0], [float("nan")])


def test_config_refuses_bad_bounds_and_names_each() -> None:
    with pytest.raises(ValueError) as err:
        OfflineGateConfig(max_kl=0, length_ratio_range=(1.5, 2.0), confidence=1.0)
    assert "max_kl" in str(err.value) and "length_ratio_range" in str(err.value) and "confidence" in str(err.value)
    with pytest.raises(ValueError, match="unknown OfflineGateConfig fields"):
        OfflineGateConfig.from_dict({"max_kll": 1})
    assert OfflineGateConfig.from_dict(CONFIG.to_dict()) == CONFIG


# ---- candidates: healthy (one small training step) and harmed --------------------------------------


def healthy(champion_dir: Path, out: Path) -> Path:
    """The champion after one small training step on held-in code."""
    policy = load_policy(champion_dir)
    policy.model.train()
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-4)
    ids = policy.tokenizer("def add(a, b):\n    return a + b\n", return_tensors="pt")["input_ids"]
    policy.model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    policy.model.eval()
    return policy.save(out)


def noisy(champion_dir: Path, out: Path, scale: float = 2.0) -> Path:
    """The champion with Gaussian noise of `scale` times each weight matrix's own spread added."""
    policy = load_policy(champion_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    return policy.save(out)


def one_token(champion_dir: Path, out: Path, text: str | None) -> Path:
    """A model whose every next token is the one token of `text` (None: end-of-text).

    Embeddings are tied, so the output layer sees only one hidden dimension `d`, held at a large
    positive value for every input; the chosen token's embedding has twice everyone else's `d`.
    """
    policy = load_policy(champion_dir)
    model = policy.model
    d = 0
    token = int(policy.tokenizer.eos_token_id) if text is None else policy.tokenizer(text)["input_ids"][-1]
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, d] = 50.0
        emb[token, d] = 100.0
        for layer in model.model.layers:  # no layer writes to dimension d
            layer.self_attn.o_proj.weight[d] = 0.0
            layer.mlp.down_proj.weight[d] = 0.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[d] = 1.0
    return policy.save(out)


def eos_only(champion_dir: Path, out: Path) -> Path:
    """A model that declines every suggestion (end-of-text first)."""
    return one_token(champion_dir, out, None)


def blank_only(champion_dir: Path, out: Path) -> Path:
    """A model that never declines and never shows anything: every completion is a lone newline."""
    return one_token(champion_dir, out, "\n")


@pytest.fixture(scope="module")
def champion(tiny_model_dir: Path) -> Policy:
    return load_policy(tiny_model_dir)


@pytest.fixture(scope="module")
def data(tiny_model_dir: Path):  # -> HeldOut
    return held_out(tiny_model_dir, CONFIG.n_prompts, CONFIG.n_text_windows, CONFIG.text_window_tokens * 4, 0)


def by_name(results: list) -> dict:
    assert [r.name for r in results] == list(GATES)
    return {r.name: r for r in results}


NO_TRAFFIC = LoggedTraffic([], None, 0)


def test_held_out_data_is_deterministic_and_not_from_the_training_sample(tiny_model_dir: Path, data) -> None:
    from flywheel.lm.corpus import stdlib_corpus

    again = held_out(tiny_model_dir, CONFIG.n_prompts, CONFIG.n_text_windows, CONFIG.text_window_tokens * 4, 0)
    assert again == data and len(data.prompts) == CONFIG.n_prompts and len(data.texts) == CONFIG.n_text_windows
    trained = "\n".join(stdlib_corpus(40, 12_000, 0))  # the "test" preset's corpus, seed 0
    # Held out by file, not by content: the standard library repeats some code verbatim across files (one of
    # these 40 windows, from xml.sax, is also in a trained file), so a few may recur; never most of them.
    assert sum(t in trained for t in data.texts) <= len(data.texts) // 20


def test_every_gate_passes_a_candidate_one_small_step_from_the_champion(
    tiny_model_dir: Path, champion: Policy, data, tmp_path: Path
) -> None:
    results = by_name(
        run_gates(healthy(tiny_model_dir, tmp_path / "h"), champion, data.prompts, data.texts, NO_TRAFFIC, CONFIG)
    )
    for name in GATES[:-1]:
        assert results[name].status == "passed", results[name]
    assert 0 < results["kl_to_champion"].value < CONFIG.max_kl
    # No logged traffic: the off-policy estimate says so and does not block.
    assert results["ope_satisfaction"].status == "insufficient_evidence" and results["ope_satisfaction"].passed


def test_noisy_weights_fail_kl_and_perplexity_with_their_numbers(
    tiny_model_dir: Path, champion: Policy, data, tmp_path: Path
) -> None:
    results = by_name(
        run_gates(noisy(tiny_model_dir, tmp_path / "n"), champion, data.prompts, data.texts, NO_TRAFFIC, CONFIG)
    )
    kl, lm_gate = results["kl_to_champion"], results["lm_vs_champion"]
    assert kl.status == "failed" and kl.value > CONFIG.max_kl and "KL(candidate || champion)" in kl.detail
    assert lm_gate.status == "failed" and lm_gate.value > CONFIG.lm_margin and "paired t-interval" in lm_gate.detail


def test_a_model_that_declines_everything_fails_the_decline_bounds_not_the_empty_ones(
    tiny_model_dir: Path, champion: Policy, data, tmp_path: Path
) -> None:
    results = by_name(
        run_gates(eos_only(tiny_model_dir, tmp_path / "e"), champion, data.prompts, data.texts, NO_TRAFFIC, CONFIG)
    )
    sanity = results["sanity"]
    assert sanity.status == "failed" and sanity.detail == "it declines 100% of the prompts (bound 50%)"
    declined = results["declined_rate_vs_champion"]
    # the rise over the champion, which itself declines a few prompts (the bootstrap's decline prior)
    assert declined.status == "failed" and 1.0 - CONFIG.max_declined_rate_increase < declined.value <= 1.0
    assert results["empty_rate_vs_champion"].status == "passed" and results["empty_rate_vs_champion"].value == 0.0


def test_a_model_that_shows_blank_outputs_instead_of_declining_fails_the_empty_bounds(
    tiny_model_dir: Path, champion: Policy, data, tmp_path: Path
) -> None:
    candidate = blank_only(tiny_model_dir, tmp_path / "b")
    results = by_name(run_gates(candidate, champion, data.prompts, data.texts, NO_TRAFFIC, CONFIG))
    sanity = results["sanity"]
    assert sanity.status == "failed" and "100% of its outputs are empty without declining" in sanity.detail
    assert results["empty_rate_vs_champion"].status == "failed" and results["empty_rate_vs_champion"].value == 1.0
    assert results["declined_rate_vs_champion"].status == "passed"


def _sampled(declined: int, blank: int, n: int = 20):  # -> Sampled
    from deploy_gate.offline.measure import Sampled
    from flywheel.lm import Generation
    from flywheel.lm.policy import FinishReason

    def gen(text: str, finish: FinishReason) -> Generation:
        return Generation([1], [2], text, [-0.5], finish)

    return Sampled(
        [gen("", "declined")] * declined + [gen("", "stop")] * blank + [gen(" x = 1", "stop")] * (n - declined - blank)
    )


@pytest.mark.parametrize(
    ("declined", "failed"),
    [
        (5, set()),  # declining a quarter of the prompts is a policy's right: nothing fails
        (8, {"declined_rate_vs_champion"}),  # 40 points more than the champion: past the loose rise bound
        (11, {"sanity", "declined_rate_vs_champion"}),  # a flood: more than half the prompts
    ],
)
def test_declines_have_loose_bounds_of_their_own(declined: int, failed: set[str]) -> None:
    from deploy_gate.offline.gates import _sanity, _versus_champion

    cand, champ = _sampled(declined=declined, blank=0), _sampled(declined=0, blank=0)
    results = [_sanity(cand, 3.0, CONFIG), *_versus_champion(cand, champ, CONFIG)]
    assert {r.name for r in results if not r.passed} == failed
    # The length compared is that of what was suggested: declines do not shorten it.
    assert next(r for r in results if r.name == "mean_length_vs_champion").value == 1.0


def test_blank_outputs_are_bounded_as_strictly_as_before() -> None:
    from deploy_gate.offline.gates import _sanity, _versus_champion

    cand, champ = _sampled(declined=0, blank=3), _sampled(declined=0, blank=0)
    results = {r.name: r for r in [_sanity(cand, 3.0, CONFIG), *_versus_champion(cand, champ, CONFIG)]}
    assert results["empty_rate_vs_champion"].status == "failed" and results["empty_rate_vs_champion"].value == 0.15
    assert results["sanity"].passed and results["declined_rate_vs_champion"].passed


def test_a_checkpoint_that_does_not_load_fails_sanity_and_says_so(champion: Policy, data, tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "fake"}')
    results = by_name(run_gates(tmp_path / "broken", champion, data.prompts, data.texts, NO_TRAFFIC, CONFIG))
    assert results["sanity"].status == "failed" and "does not load" in results["sanity"].detail
    assert all(r.status == "failed" and "not run" in r.detail for n, r in results.items() if n != "sanity")


# ---- the off-policy gate on the champion's logged traffic ------------------------------------------


def log_champion_traffic(settings: Settings, policy: Policy, version: str, n: int, forged: int = 0) -> None:
    """`n` signed generations of the champion (reward 1 for non-empty, else 0) and `forged` unsigned ones."""
    key = settings.serving_key.get_secret_value()
    events, rewards = [], []
    start = datetime(2026, 11, 25, 9, tzinfo=UTC)
    prompts = ["def main(", "import os\nimport ", "class Parser:\n    def ", "for i in range("]
    for i in range(n + forged):
        gid, user = f"g{i:04d}", f"u{i % 7}"
        g = policy.generate(prompts[i % len(prompts)], max_tokens=8, seed=i)
        rec = GenerationRecord(
            prompt=prompts[i % len(prompts)], prompt_token_ids=g.prompt_token_ids, completion=g.completion,
            completion_token_ids=g.completion_token_ids, behaviour_logprobs=g.logprobs, model_version=version,
            finish_reason=g.finish_reason,
        )  # fmt: skip
        if i < n:
            rec.signature = sign_generation(key, gid, user, rec)
        at = start + timedelta(seconds=i)
        events.append((Event(type=EventType.GENERATION, generation_id=gid, user_id=user, ts=at, source="serving",
                             properties=rec.model_dump()), "t", 0, i))  # fmt: skip
        rewards.append(RewardRecord(generation_id=gid, reward_version="r1", reward=float(bool(g.completion.strip())),
                                    confidence=1.0, label_source="explicit", user_id=user, model_version=version,
                                    arm="champion", experiment="default", window_start=at, window_end=at,
                                    emitted_at=at + timedelta(seconds=5)))  # fmt: skip
    EVENTS.write(EVENTS.at(settings.lake_root), events_frame(events), "gen")
    REWARDS.write(REWARDS.at(settings.lake_root), rewards_frame(rewards), "rew")


def test_ope_uses_only_signed_champion_traffic_and_passes_the_champion_itself(
    settings: Settings, tiny_model_dir: Path, champion: Policy, data
) -> None:
    log_champion_traffic(settings, champion, "1", n=40, forged=5)
    traffic = champion_traffic(settings, "1", "", 1000)
    assert len(traffic.samples) == 40 and traffic.untrusted == 5 and traffic.reward_version == "r1"
    ope_result = by_name(run_gates(tiny_model_dir, champion, data.prompts, data.texts, traffic, CONFIG))[
        "ope_satisfaction"
    ]
    # The candidate is the champion: every weight is 1, so ESS = n and SNIPS is the logged mean; DR
    # adds only its direct-method term's sampling noise, which must not make the champion fail.
    mean = float(np.mean([s.reward for s in traffic.samples]))
    assert ope_result.status != "failed", ope_result
    assert "ESS 40.0 of n=40" in ope_result.detail and f"SNIPS {mean:.4g}" in ope_result.detail
    assert ope_result.value == pytest.approx(0.0, abs=0.15)  # DR - the champion's logged mean


def test_ope_fails_a_candidate_that_declines_what_the_champion_was_rewarded_for(
    settings: Settings, tiny_model_dir: Path, champion: Policy, data, tmp_path: Path
) -> None:
    log_champion_traffic(settings, champion, "1", n=40)
    traffic = champion_traffic(settings, "1", "r1", 1000)
    config = OfflineGateConfig(**{**CONFIG.to_dict(), "ope_min_ess": 1.0})
    harmed = eos_only(tiny_model_dir, tmp_path / "e")
    result = by_name(run_gates(harmed, champion, data.prompts, data.texts, traffic, config))["ope_satisfaction"]
    assert result.status == "failed" and "worse than the champion" in result.detail, result


def calls_traffic(policy: Policy, n: int) -> LoggedTraffic:
    """`n` champion generations rewarded 1 when they open a call ("(") and 0 otherwise, in memory."""
    prompts = ["def main(", "import os\nimport ", "class Parser:\n    def ", "for i in range("]
    samples = []
    for i in range(n):
        g = policy.generate(prompts[i % len(prompts)], max_tokens=8, seed=i)
        rec = GenerationRecord(
            prompt=prompts[i % len(prompts)], prompt_token_ids=g.prompt_token_ids, completion=g.completion,
            completion_token_ids=g.completion_token_ids, behaviour_logprobs=g.logprobs, model_version="1",
            finish_reason=g.finish_reason,
        )  # fmt: skip
        samples.append(LoggedSample(f"g{i:04d}", rec, float("(" in g.completion)))
    return LoggedTraffic(samples, "r1", 0)


def test_a_harmed_candidate_is_refused_by_the_offline_gate_on_its_estimate_alone(
    tiny_model_dir: Path, champion: Policy, data, tmp_path: Path
) -> None:
    """Trained a small step against what the champion's users rewarded: close to the champion (KL, perplexity,
    empty, declined and length all pass), worse in truth, and refused by `ope_satisfaction` alone."""
    torch.manual_seed(0)
    traffic = calls_traffic(champion, 120)
    harmed = load_policy(tiny_model_dir)
    now = datetime.now(UTC)
    samples = [Sample(s.generation_id, "u", s.record.prompt_token_ids or [], s.record.completion_token_ids or [],
                      s.record.behaviour_logprobs, -s.reward, "1", now) for s in traffic.samples]  # fmt: skip
    config = TrainerConfig(learning_rate=1e-3, batch_size=16, baseline="batch_mean")
    reference = score_samples(harmed.model, samples, scorer_for(False), harmed.pad_id, 16)
    train_policy(harmed.model, samples, reference, config, scorer_for(False), harmed.pad_id, stop_ids=harmed.stop_ids)
    harmed.save(tmp_path / "harmed")

    results = by_name(run_gates(tmp_path / "harmed", champion, data.prompts, data.texts, traffic, CONFIG))
    ope_result = results["ope_satisfaction"]
    assert ope_result.status == "failed" and "worse than the champion" in ope_result.detail, ope_result
    assert all(r.status == "passed" for name, r in results.items() if name != "ope_satisfaction"), results
    # And it is worse in truth: it opens calls less often than the champion on the same prompts and seeds.
    prompts = [s.record.prompt for s in traffic.samples]
    rate = lambda p: np.mean(["(" in g.completion for g in sample(p, prompts, 8, seed=1).generations])  # noqa: E731
    assert rate(load_policy(tmp_path / "harmed")) < rate(champion)


# ---- approval, the CLI and the API -----------------------------------------------------------------

TOKEN = "offline-gates-admin-token"


@pytest.fixture
def gate_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"approval_token": SecretStr(TOKEN)})


@pytest.fixture
def registry(gate_settings: Settings, tiny_model_dir: Path) -> ModelRegistry:
    registry = ModelRegistry(gate_settings)
    v = registry.register(tiny_model_dir, ModelLineage(base="tiny"))
    registry.set_gate_state(v, "champion", by="bootstrap", reason="first model")
    registry.set_alias("champion", v)
    return registry


@pytest.fixture
def gate(registry: ModelRegistry, gate_settings: Settings) -> DeployGate:
    offline = OfflineGates(gate_settings, registry, CONFIG)
    return DeployGate(registry, redis_client(gate_settings), gate_settings, offline=offline)


def test_approval_of_a_candidate_that_failed_a_gate_is_refused_and_the_api_shows_why(
    gate: DeployGate, registry: ModelRegistry, gate_settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    bad = registry.register(noisy(tiny_model_dir, tmp_path / "n"), ModelLineage(base="tiny", parent_version="1"))
    good = registry.register(healthy(tiny_model_dir, tmp_path / "h"), ModelLineage(base="tiny", parent_version="1"))
    with TestClient(create_app(gate_settings, gate=gate)) as client:
        refused = client.post(f"/api/versions/{bad}/approve", json={"reason": "looks fine"},
                              headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
        assert refused.status_code == 409 and refused.json()["error"] == "offline_gate_failed"
        assert "kl_to_champion" in refused.json()["detail"] and "lm_vs_champion" in refused.json()["detail"]
        assert registry.gate_state(bad) == "refused"  # a state, with the failed gates as its reason
        assert "kl_to_champion" in registry.gate_history(bad)[-1].reason

        view = client.get(f"/api/versions/{bad}").json()
        gates = {g["name"]: g for g in view["offline_gates"]}
        assert list(gates) == list(GATES) and view["offline_gates_champion"] == "1"
        assert gates["kl_to_champion"] == {
            **gates["kl_to_champion"],
            "passed": False,
            "status": "failed",
            "bound": "<= 0.1",
        }
        assert gates["kl_to_champion"]["value"] > 0.1
        assert client.get(f"/api/versions/{good}").json()["offline_gates"] == []  # not run yet

        ok = client.post(f"/api/versions/{good}/approve", json={"reason": "gates pass"},
                         headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
        assert ok.status_code == 200, ok.json()
        assert all(g["passed"] for g in client.get(f"/api/versions/{good}").json()["offline_gates"])
    assert registry.gate_state(good) == "approved"
    # The recorded report is reused, not recomputed, while the champion and config stay the same.
    report = registry.offline_gates(good)
    assert report is not None and gate.offline is not None
    assert gate.offline.ensure(good, "1").checked_at == report.checked_at


def test_a_report_against_another_champion_is_run_again(
    gate: DeployGate, registry: ModelRegistry, tiny_model_dir: Path
) -> None:
    candidate = registry.register(tiny_model_dir, ModelLineage(base="tiny", parent_version="1"))
    assert gate.offline is not None
    first = gate.offline.check(candidate, "1")
    assert gate.offline.current(candidate, "1") == first
    assert gate.offline.current(candidate, "2") is None


def test_cli_check_prints_each_verdict_and_exits_1_on_a_failure(
    registry: ModelRegistry, gate_settings: Settings, tiny_model_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    bad = registry.register(eos_only(tiny_model_dir, tmp_path / "e"), ModelLineage(base="tiny", parent_version="1"))
    # The CLI reads settings from the environment, as in production.
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(gate_settings.data_dir))
    monkeypatch.setenv("FLYWHEEL_MLFLOW_TRACKING_URI", gate_settings.mlflow_tracking_uri)
    monkeypatch.setenv("FLYWHEEL_REDIS_URL", gate_settings.redis_url)
    monkeypatch.setenv("FLYWHEEL_REDIS_PREFIX", gate_settings.redis_prefix)
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(gate_cli, ["check", "--pending"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 1, result.output
    assert f"version {bad} vs champion 1" in result.output and "failed" in result.output
    report = registry.offline_gates(bad)
    assert report is not None and not report.passed and "sanity" in [r.name for r in report.failed]
    assert registry.gate_state(bad) == "refused" and f"version {bad} is marked refused" in result.output


def test_a_new_report_replaces_the_old_one_whole(settings: Settings, tmp_path: Path) -> None:
    registry = ModelRegistry(settings)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    v = registry.register(tmp_path / "ckpt", ModelLineage(base="fake"))
    assert registry.offline_gates(v) is None
    at = datetime(2026, 11, 25, 10, tzinfo=UTC)
    first = [
        OfflineGateResult("sanity", "passed", 0.0, "-", "x" * 5000),
        OfflineGateResult("old_gate", "failed", None, "-", ""),
    ]
    registry.record_offline_gates(v, OfflineGateReport(at, "1", first, {"seed": 0}))
    report = registry.offline_gates(v)
    assert report is not None and not report.passed and [r.name for r in report.failed] == ["old_gate"]
    assert len(report.results[0].detail) == 2000  # tag values are capped; details are cut, never refused
    registry.record_offline_gates(v, OfflineGateReport(at, "2", first[:1], {"seed": 0}))
    again = registry.offline_gates(v)
    assert again is not None and again.passed and again.champion == "2"
    assert [r.name for r in again.results] == ["sanity"]
    assert not any(k.startswith("flywheel.offline_gate.old_gate") for k in registry.client.get_model_version(
        settings.registered_model_name, v).tags)  # fmt: skip


def test_a_candidate_refused_offline_is_marked_refused_and_never_retried_by_the_auto_approver(
    gate: DeployGate, registry: ModelRegistry, gate_settings: Settings, tiny_model_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from rich.console import Console

    import model_registry.cli as registry_cli
    from launcher.up import auto_approve

    bad = registry.register(noisy(tiny_model_dir, tmp_path / "n"), ModelLineage(base="tiny", parent_version="1"))
    assert gate.offline is not None
    checks: list[str] = []
    check = gate.offline.check
    monkeypatch.setattr(gate.offline, "check", lambda v, c: checks.append(v) or check(v, c))

    said = auto_approve(gate)
    assert len(said) == 1 and said[0].startswith(f"refused v{bad}: offline gates failed against champion 1")
    assert "kl_to_champion" in said[0]
    assert registry.gate_state(bad) == "refused" and checks == [bad]
    history = registry.gate_history(bad)
    assert [(h.previous, h.state, h.by) for h in history[1:]] == [("pending", "refused", "deploy-gate")]

    # Every later tick: nothing pending, nothing run again, nothing said, no second history entry.
    for _ in range(3):
        assert auto_approve(gate) == []
    assert checks == [bad] and len(registry.gate_history(bad)) == len(history)
    # Approval by hand is refused too (not pending), without running the gates.
    from deploy_gate.errors import NotPending

    with pytest.raises(NotPending, match="refused"):
        gate.plan_approve(bad, by="ana", reason="try again")
    assert checks == [bad]

    # `flywheel registry list` shows it refused, with the offline reason.
    for name, value in (("FLYWHEEL_DATA_DIR", str(gate_settings.data_dir)),
                        ("FLYWHEEL_MLFLOW_TRACKING_URI", gate_settings.mlflow_tracking_uri)):  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(registry_cli, "console", Console(width=400))
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(registry_cli.app, ["list"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.strip("│ ").startswith(bad))
    assert "refused" in row and "offline gates failed against champion 1: kl_to_champion" in row


def test_while_an_experiment_runs_the_next_candidate_is_checked_once_and_then_approved_without_a_second_check(
    gate: DeployGate, registry: ModelRegistry, gate_settings: Settings, tiny_model_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from deploy_gate.policy import AutoApprove
    from launcher.up import auto_approve

    running = registry.register(tiny_model_dir, ModelLineage(base="tiny", parent_version="1"))
    gate.approve(running, by="ana", reason="start an experiment")
    assert gate.offline is not None
    checks: list[str] = []
    check = gate.offline.check
    monkeypatch.setattr(gate.offline, "check", lambda v, c: checks.append(v) or check(v, c))

    # The demo's approver: the newest pending candidate is checked while the experiment runs; a failure is final.
    bad = registry.register(noisy(tiny_model_dir, tmp_path / "n"), ModelLineage(base="tiny", parent_version="1"))
    [said] = auto_approve(gate)
    assert said.startswith(f"refused v{bad}: offline gates failed against champion 1") and "kl_to_champion" in said
    assert registry.gate_state(bad) == "refused" and gate.status().challenger == running
    nxt = registry.register(tiny_model_dir, ModelLineage(base="tiny", parent_version="1"))
    assert auto_approve(gate) == [f"v{nxt} passed its offline gates while v{running} runs; it starts when that ends "
                                  "unless a newer one passes first"]
    assert auto_approve(gate) == [] and checks == [bad, nxt]  # said once, checked once
    assert registry.gate_state(nxt) == "pending" and gate.status().challenger == running
    gate.rollback(by="ana", reason="the experiment ended")
    assert auto_approve(gate) == [f"approved v{nxt} as challenger"]
    assert checks == [bad, nxt]  # approval used the report made while the experiment ran

    # The gate service's auto-approve policy does the same for the candidate it approves next (the oldest).
    policy = AutoApprove(DeployGate(registry, gate.redis, gate_settings.model_copy(update={"auto_approve": True}),
                                    offline=gate.offline))  # fmt: skip
    later = registry.register(tiny_model_dir, ModelLineage(base="tiny", parent_version="1"))
    assert policy.tick() is None and checks == [bad, nxt, later]
    assert gate.offline.current(later, "1") is not None and registry.gate_state(later) == "pending"
    assert policy.tick() is None and checks == [bad, nxt, later]


# ---- the language-model gate: a paired interval against a margin, drift against the reference, budgets -------


def test_the_lm_gate_passes_within_the_margin_fails_beyond_it_and_is_undecided_at_it(
    tiny_model_dir: Path, champion: Policy, data, tmp_path: Path
) -> None:
    from scipy import stats

    from deploy_gate.offline import lm

    items = lm.windows(champion, data.texts, "general", CONFIG.text_window_tokens)
    assert len(items) == CONFIG.n_text_windows

    def diffs(candidate_dir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        scored = lm.score(load_policy(candidate_dir), {"champion": champion}, items, lm.Budget(3600.0), seed=0)
        assert scored.n == len(items)
        return scored.candidate - scored.others["champion"], scored.candidate, scored.others["champion"]

    close, cand, champ = diffs(noisy(tiny_model_dir, tmp_path / "close", scale=0.02))
    within = lm.non_inferiority(close, CONFIG.lm_margin, 0.95, CONFIG.lm_min_windows)
    # The interval is the paired t-interval of the mean difference, as scipy computes it.
    reference = stats.ttest_rel(cand, champ).confidence_interval(0.95)
    assert within.ci == pytest.approx((reference.low, reference.high), rel=1e-9)
    assert within.verdict == "passed" and within.ci[1] < CONFIG.lm_margin and within.n == len(items)

    far, _, _ = diffs(noisy(tiny_model_dir, tmp_path / "far", scale=2.0))
    beyond = lm.non_inferiority(far, CONFIG.lm_margin, 0.95, CONFIG.lm_min_windows)
    assert beyond.verdict == "failed" and beyond.ci[0] > CONFIG.lm_margin

    # A candidate whose rise is the margin itself: its interval straddles the margin, so it is too close to call.
    at = lm.non_inferiority(close, within.mean, 0.95, CONFIG.lm_min_windows)
    assert at.verdict == "undecided" and at.ci[0] < within.mean < at.ci[1]
    # So is one judged on too few windows, whatever its numbers.
    assert lm.non_inferiority(far[:5], CONFIG.lm_margin, 0.95, CONFIG.lm_min_windows).verdict == "undecided"

    # Through the gates: the verdict is recorded as it is (undecided does not block), with the windows and interval.
    config = CONFIG.replace(lm_margin=within.mean, lm_reference_margin=1.0)
    results = by_name(run_gates(tmp_path / "close", champion, data.prompts, data.texts, NO_TRAFFIC, config))
    gate = results["lm_vs_champion"]
    assert gate.status == "undecided" and gate.passed and gate.value == pytest.approx(within.mean)
    assert f"decided by {len(items)} text windows" in gate.detail and "paired t-interval [" in gate.detail


def test_drift_is_bounded_against_the_lineage_s_first_champion_not_only_the_last_step(
    tiny_model_dir: Path, champion: Policy, data, tmp_path: Path, registry: ModelRegistry, gate_settings: Settings
) -> None:
    from deploy_gate.offline.gates import ReferenceModel

    # The champion drifted far from the base; a candidate equal to it is no worse than it, and still refused.
    drifted = noisy(tiny_model_dir, tmp_path / "drifted", scale=0.5)
    results = by_name(run_gates(drifted, load_policy(drifted), data.prompts, data.texts, NO_TRAFFIC, CONFIG,
                                reference=ReferenceModel("1", champion)))  # fmt: skip
    step, drift = results["lm_vs_champion"], results["lm_vs_reference"]
    assert step.status == "passed" and step.value == 0.0
    assert drift.status == "failed" and drift.value > CONFIG.lm_reference_margin and "reference v1" in drift.detail

    # The reference is the lineage's first champion: parents are followed back to the version that has none.
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    v2 = registry.register(tmp_path / "ckpt", ModelLineage(base="tiny", parent_version="1"))
    v3 = registry.register(tmp_path / "ckpt", ModelLineage(base="tiny", parent_version=v2))
    gates = OfflineGates(gate_settings, registry, CONFIG)
    assert gates.reference_of(v3) == "1" and gates.reference_of("1") == "1"


def test_the_gates_honour_their_cpu_budgets_and_say_what_they_covered(
    tiny_model_dir: Path, champion: Policy, data, tmp_path: Path
) -> None:
    """A clock that advances one "second" per reading: the budgets count readings, so what is covered is exact."""
    import itertools

    ticks = itertools.count()
    config = CONFIG.replace(lm_cpu_budget_s=11.0, ope_cpu_budget_s=2.0, lm_min_windows=2)
    traffic = calls_traffic(champion, 120)
    results = by_name(run_gates(healthy(tiny_model_dir, tmp_path / "h"), champion, data.prompts, data.texts, traffic,
                                config, clock=lambda: float(next(ticks))))  # fmt: skip
    lm_gate = results["lm_vs_champion"]
    assert "decided by 10 text windows" in lm_gate.detail
    assert f"10 of {CONFIG.n_text_windows} available" in lm_gate.detail
    assert lm_gate.status != "undecided"  # 10 windows, above this config's minimum: a verdict
    ope_gate = results["ope_satisfaction"]
    assert "covered 32 of 120 logged samples" in ope_gate.detail, ope_gate  # one batch of completions
    assert "ESS" in ope_gate.detail and "n=32" in ope_gate.detail


def test_product_text_comes_from_signed_traffic_on_prompts_held_out_of_training(
    settings: Settings, champion: Policy
) -> None:
    from deploy_gate.offline.logged import product_texts
    from flywheel.holdout import in_holdout

    log_champion_traffic(settings, champion, "1", n=40, forged=5)
    texts = product_texts(settings, 100, None)  # a candidate that trained on no traffic: all of it is unseen
    prompts = ["def main(", "import os\nimport ", "class Parser:\n    def ", "for i in range("]
    assert texts and all(any(t.startswith(p) for p in prompts) for t in texts)
    assert any(t not in prompts for t in texts)  # kept completions (reward 1) follow their context
    assert product_texts(settings, 100, 0.0) == []  # trained on it all, held nothing out: none is unseen
    share = 0.5
    held = product_texts(settings, 100, share)
    assert held == [t for t in texts if in_holdout(next(p for p in prompts if t.startswith(p)), share)]
    assert len(product_texts(settings, 2, None)) == 2


def test_a_check_scores_the_product_s_own_text_and_names_the_reference(
    gate: DeployGate, registry: ModelRegistry, gate_settings: Settings, champion: Policy, tiny_model_dir: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    import re

    log_champion_traffic(gate_settings, champion, "1", n=40)
    lineage = ModelLineage(base="tiny", parent_version="1")  # trained on no traffic: all of it is unseen
    candidate = registry.register(healthy(tiny_model_dir, tmp_path / "h"), lineage)
    assert gate.offline is not None
    results = {r.name: r for r in gate.offline.check(candidate, "1").results}
    step = results["lm_vs_champion"]
    found = re.search(r"decided by (\d+) text windows \((\d+) from the product's held-out traffic", step.detail)
    assert found and int(found.group(2)) > 0 and int(found.group(1)) > int(found.group(2)), step.detail
    # v1 is the lineage's first champion: the drift bound is judged on the same comparison, and says so.
    assert "the champion itself: the lineage's first" in results["lm_vs_reference"].detail
