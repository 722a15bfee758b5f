"""When and on what the offline gates run: one candidate version against the current champion.

The deploy gate runs them (the trainer may not import the gate, and the gate is where approval
happens): `flywheel gate check VERSION` runs them by hand (`--pending` for every waiting
candidate), and approval runs them itself when the version has no report checked against the
current champion. Results are recorded on the version in the registry (`record_offline_gates`),
so every process sees the same verdict and the API shows it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

from deploy_gate.offline.config import OfflineGateConfig
from deploy_gate.offline.gates import GATES, ReferenceModel, run_gates
from deploy_gate.offline.heldout import held_out
from deploy_gate.offline.logged import LoggedTraffic, champion_traffic, product_texts, recent_prompts
from flywheel.contract import utcnow
from flywheel.holdout import in_holdout
from flywheel.lm import CheckpointError, load_policy
from flywheel.lm.engine import EngineChoice
from flywheel.settings import Settings
from model_registry import ArtifactIntegrityError, ModelRegistry, OfflineGateReport, OfflineGateResult, UnknownVersion

log = logging.getLogger(__name__)

_CHARS_PER_TOKEN = 4  # a held-out text is cut by characters first, then by tokens


class OfflineGates:
    """Runs and records the offline gates of candidate versions."""

    def __init__(self, settings: Settings, registry: ModelRegistry, config: OfflineGateConfig | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.config = config or OfflineGateConfig()

    def report(self, version: str) -> OfflineGateReport | None:
        return self.registry.offline_gates(version)

    def current(self, version: str, champion: str) -> OfflineGateReport | None:
        """The recorded report when it was checked against `champion` with this config; else None."""
        report = self.registry.offline_gates(version)
        if report is None or report.champion != champion or report.config != self.recorded_config():
            return None
        return report

    def recorded_config(self) -> dict[str, object]:
        """The config as a report records it (JSON types: a tuple reads back as a list)."""
        recorded: dict[str, object] = json.loads(json.dumps(self.config.to_dict()))
        return recorded

    def ensure(self, version: str, champion: str) -> OfflineGateReport:
        """The current report of `version`, running the gates first when there is none."""
        return self.current(version, champion) or self.check(version, champion)

    def _holdout_share(self, version: str) -> float | None:
        """The share of prompts `version`'s trainer held out (`flywheel.holdout`); None: it trained on no traffic."""
        lineage = self.registry.lineage(version)
        share = float(lineage.trainer_config.get("ope_holdout_share", 0.0) or 0.0)
        return None if share == 0 and lineage.data_window is None else share

    def reference_of(self, champion: str) -> str:
        """The lineage's first champion: follow `champion`'s parents back to the version that has none."""
        version, seen = champion, {champion}
        while (parent := self.registry.lineage(version).parent_version) is not None and parent not in seen:
            seen.add(parent)
            version = parent
        return version

    def _reference(self, champion: str) -> ReferenceModel | None:
        """The reference for the drift bound, loaded; None when the champion is it."""
        try:
            version = self.reference_of(champion)
        except UnknownVersion as exc:
            return ReferenceModel("?", None, f"the lineage is broken: {exc}")
        if version == champion:
            return None
        try:
            return ReferenceModel(version, load_policy(self.registry.fetch(version)))
        except (CheckpointError, ValueError, OSError, ArtifactIntegrityError) as exc:
            return ReferenceModel(version, None, f"it does not load: {exc}")

    def _unseen(self, version: str, traffic: LoggedTraffic) -> tuple[LoggedTraffic, bool]:
        """The champion's traffic on prompts `version` was not trained on (its trainer's holdout, `flywheel.holdout`),
        and whether the estimate is in-sample: a trained candidate whose trainer held nothing out."""
        lineage = self.registry.lineage(version)
        share = float(lineage.trainer_config.get("ope_holdout_share", 0.0) or 0.0)
        if share > 0:
            held = [s for s in traffic.samples if in_holdout(s.record.prompt, share)]
            return replace(traffic, samples=held), False
        return traffic, lineage.data_window is not None

    def check(self, version: str, champion: str) -> OfflineGateReport:
        """Run every gate on `version` against `champion` and record the report on `version`."""
        cfg = self.config
        champion_dir = self.registry.fetch(champion)
        candidate_dir = self.registry.fetch(version)
        data = held_out(
            champion_dir, cfg.n_prompts, cfg.n_text_windows, cfg.text_window_tokens * _CHARS_PER_TOKEN, cfg.seed
        )
        prompts = data.prompts + recent_prompts(self.settings, cfg.logged_prompts)
        traffic = champion_traffic(self.settings, champion, cfg.reward_version, cfg.ope_max_samples)
        traffic, in_sample = self._unseen(version, traffic)
        texts = product_texts(self.settings, cfg.logged_texts, self._holdout_share(version))
        try:
            champion_policy = load_policy(champion_dir)
        except (CheckpointError, ValueError, OSError) as exc:  # nothing to compare with: no verdict can pass
            why = f"not run: the champion (version {champion}) does not load: {exc}"
            results = [OfflineGateResult(name, "failed", None, "-", why) for name in GATES]
        else:
            results = run_gates(candidate_dir, champion_policy, prompts, data.texts, traffic, cfg, in_sample=in_sample,
                                logged_texts=texts, reference=self._reference(champion),
                                engine=EngineChoice.from_settings(self.settings), version=version)  # fmt: skip
        report = OfflineGateReport(
            checked_at=utcnow(), champion=champion, results=results, config=self.recorded_config()
        )
        self.registry.record_offline_gates(version, report)
        failed = ", ".join(f"{r.name} ({r.detail})" for r in report.failed) or "none"
        log.info("offline gates of version %s against champion %s: failed %s", version, champion, failed)
        return report
