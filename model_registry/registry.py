"""The MLflow-backed model registry: versions, lineage, gate state, aliases, fetch.

A version is one registered checkpoint directory. What is stored is logged as MLflow run
artifacts (under `model/`, in the trainer's run when the lineage names one), together
with a manifest (per-file and per-tensor sha256 of the checkpoint) whose own hash is a
version tag; `fetch` refuses a download that does not match.

A version trained from a parent stores a lossless delta against it (model_registry.delta)
while the chain of deltas back to a full snapshot is shorter than `registry_max_chain`, and
its full weights otherwise, or when its weights changed dtype (an fp32 parent, a bf16 child).
`fetch` rebuilds a delta from its (cached, verified) parent and checks the result, file by
file and tensor by tensor, against the manifest before anyone loads it; a broken link (a
parent gone, a parent other than the one the delta was made against, a corrupt stored file) is
an `ArtifactIntegrityError` that says which.

A LoRA adapter version (`register_adapter`) stores a peft adapter directory in full, with the base it was
trained on: the base's version, the sha256 of the base's manifest (its content hash) and its lineage's base,
in the adapter's own `flywheel_adapter.json` (covered by the adapter's manifest) and in a version tag. Its
lineage's parent is the version it continued from (the champion: the base itself or an earlier adapter on
it). `fetch` of an adapter checks that the base version still has that hash, refusing it otherwise
(`ArtifactIntegrityError` naming both), and fetches the base too, beside it in the cache, where
`flywheel.lm.load_policy` finds it.

Lineage and gate state live in version tags, and every gate-state change adds one history
tag (who, when, why), so the history is never rewritten.
Works on any MLflow store (SQLite by default, PostgreSQL, a tracking server).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import sqlalchemy.exc
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from flywheel.connections import configure_mlflow, experiment_artifact_location
from flywheel.contract import ModelLineage
from flywheel.lm.adapter_info import ADAPTER_INFO, AdapterInfo, is_adapter_dir, read_adapter_info, write_adapter_info
from flywheel.lm.errors import CheckpointError
from flywheel.settings import Settings
from model_registry.delta import SUFFIX, DeltaError, apply_delta, make_delta, shares_tensors
from model_registry.diff import TensorDiff, diff_checkpoints
from model_registry.manifest import (
    ArtifactIntegrityError,
    artifact_of,
    build_manifest,
    manifest_bytes,
    verify,
    verify_tensors,
)

log = logging.getLogger(__name__)

# Artifact downloads are internal steps of `fetch`; their tqdm bars would only clutter logs.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

# "refused": the offline gates refused it against the champion of the day (the reason, in its history, names
# the gates and their numbers); final, like "rejected" (a person's or a newer candidate's decision), and kept apart
# from it so the registry says why a candidate never reached users.
GATE_STATES = ("pending", "approved", "rejected", "refused", "challenger", "champion", "rolled_back", "quarantined")
REGISTRY_EXPERIMENT = "flywheel-registry"
ARTIFACT_DIR = "model"
MANIFEST_ARTIFACT = "checkpoint_manifest.json"
DELTA_INFO = "flywheel_delta.json"  # in a delta's stored files: which parent (for a person browsing MLflow)

TAG_LINEAGE = "flywheel.lineage"
TAG_GATE_STATE = "flywheel.gate_state"
TAG_GATE_HISTORY = "flywheel.gate_history."  # + zero-padded sequence number
TAG_MANIFEST_SHA = "flywheel.manifest_sha256"
TAG_ADAPTER = "flywheel.adapter"  # a LoRA adapter's base: JSON of flywheel.lm.AdapterInfo
TAG_OFFLINE_GATES = "flywheel.offline_gates"  # the report's summary; written last
TAG_OFFLINE_GATE = "flywheel.offline_gate."  # + gate name: one result each (tag values are capped)
_DETAIL_CHARS = 2000


@dataclass
class VersionInfo:
    version: str
    created_at: datetime
    lineage: ModelLineage
    gate_state: str
    aliases: list[str] = field(default_factory=list)
    reason: str = ""  # why it is in its gate state: the latest history entry's reason


@dataclass(frozen=True)
class ArtifactInfo:
    """How a version is stored: "full", "delta" against `parent`, `chain_length` deltas from a snapshot, or
    "adapter": a LoRA adapter stored in full, `parent` naming its base version (`checkpoint_bytes`: the adapter's)."""

    kind: str
    parent: str | None
    chain_length: int
    stored_bytes: int
    checkpoint_bytes: int  # the rebuilt checkpoint (every file)


@dataclass(frozen=True)
class GateChange:
    """One entry of a version's gate-state history."""

    state: str
    previous: str
    by: str
    at: datetime
    reason: str


@dataclass(frozen=True)
class OfflineGateResult:
    """One offline gate's verdict on a version.

    `status` is "passed", "failed", "insufficient_evidence" or "undecided" (an interval that straddles the
    margin; both shown, never blocking); `passed` is False only for "failed". `bound` says in words what
    `value` had to satisfy.
    """

    name: str
    status: str
    value: float | None
    bound: str
    detail: str

    @property
    def passed(self) -> bool:
        return self.status != "failed"


@dataclass(frozen=True)
class OfflineGateReport:
    """Every offline gate's result for a version, checked against `champion` at `checked_at`."""

    checked_at: datetime
    champion: str | None
    results: list[OfflineGateResult]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[OfflineGateResult]:
        return [r for r in self.results if not r.passed]


class UnknownVersion(LookupError):
    """The registry holds no such version."""


class RegistryUnavailable(RuntimeError):
    """The MLflow store does not answer (server or database down); try again later.

    Its text never holds the store's URI (which may carry a password).
    """


_NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")
P = ParamSpec("P")
R = TypeVar("R")


def _is_unreachable(exc: MlflowException) -> bool:
    """MLflow wraps an unreachable store as TEMPORARILY_UNAVAILABLE (database) or as a generic
    error caused by a requests failure (tracking server)."""
    if exc.error_code == "TEMPORARILY_UNAVAILABLE":
        return True
    cause = exc.__cause__ or exc.__context__
    # requests' errors are OSErrors; a database that does not answer is an OperationalError.
    return isinstance(cause, OSError | sqlalchemy.exc.OperationalError)


def _reachable(method: Callable[P, R]) -> Callable[P, R]:
    """Raise `RegistryUnavailable` instead of MLflow's error when the store does not answer."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except MlflowException as exc:
            if _is_unreachable(exc):
                # The chain is cut: MLflow's message names the store's URL, password included.
                cause = type(exc.__cause__ or exc.__context__ or exc).__name__
                raise RegistryUnavailable(f"the model registry (MLflow) does not answer ({cause})") from None
            raise

    return call


def _run_of(mv: ModelVersion) -> str:
    """The run holding a version's artifacts; every version `register` writes names one."""
    if mv.run_id is None:  # made outside this registry (e.g. by hand in the MLflow UI)
        raise ArtifactIntegrityError(f"version {mv.version} has no MLflow run, so no artifacts to fetch")
    return mv.run_id


def ensure_experiment(client: MlflowClient, settings: Settings, name: str) -> str:
    """The id of experiment `name`, created with the configured artifact location when missing."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return str(exp.experiment_id)
    location = experiment_artifact_location(settings)
    try:
        return str(
            client.create_experiment(name, artifact_location=f"{location}/{name}" if location else None)
        )
    except MlflowException:  # another process created it between our lookup and create
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return str(exp.experiment_id)


class ModelRegistry:
    """Model versions of `settings.registered_model_name` in the MLflow model registry."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        uri = configure_mlflow(settings)
        self._client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        self._name = settings.registered_model_name
        self._cache_dir = settings.data_dir / "models"
        self._max_chain = settings.registry_max_chain
        # Manifests never change once registered (their hash is a version tag): read each once.
        self._manifests: dict[tuple[str, str], dict[str, Any]] = {}

    @property
    def client(self) -> MlflowClient:
        return self._client

    # -- registration ------------------------------------------------------------------
    @_reachable
    def register_adapter(self, adapter_dir: Path, lineage: ModelLineage, base_version: str) -> str:
        """Register the peft adapter in `adapter_dir`, trained on registered full-weights `base_version`.

        Writes `flywheel_adapter.json` (the base's version, manifest hash and lineage base) into
        `adapter_dir` first, so the stored adapter names its base and its manifest covers that record.
        Stored in full (an adapter is small; no delta chain to rebuild before serving it)."""
        adapter_dir = Path(adapter_dir)
        if not is_adapter_dir(adapter_dir):
            raise FileNotFoundError(f"{adapter_dir} holds no adapter_config.json; pass a saved peft adapter")
        base_mv = self._version(base_version)
        if TAG_ADAPTER in base_mv.tags:
            raise ValueError(f"version {base_version} is itself an adapter: an adapter's base is full weights")
        info = AdapterInfo(
            base_version=str(base_mv.version),
            base_manifest_sha256=str(base_mv.tags.get(TAG_MANIFEST_SHA)),
            base=ModelLineage.model_validate_json(base_mv.tags[TAG_LINEAGE]).base,
        )
        write_adapter_info(adapter_dir, info)
        tag = json.dumps({"base_version": info.base_version, "base_manifest_sha256": info.base_manifest_sha256,
                          "base": info.base})  # fmt: skip
        return self.register(adapter_dir, lineage, full=True, _tags={TAG_ADAPTER: tag})

    @_reachable
    def adapter(self, version: str) -> AdapterInfo | None:
        """The base `version` was trained on when it is a LoRA adapter; None for full weights."""
        raw = self._version(version).tags.get(TAG_ADAPTER)
        if raw is None:
            return None
        d = json.loads(raw)
        return AdapterInfo(str(d["base_version"]), str(d["base_manifest_sha256"]), str(d.get("base", "")))

    @_reachable
    def register(self, model_dir: Path, lineage: ModelLineage, *, full: bool = False,
                 _tags: dict[str, str] | None = None) -> str:  # fmt: skip
        """Log `model_dir` (as a delta against the lineage's parent where allowed, else in full) and its
        manifest as artifacts, and create a version in gate state "pending".

        The artifacts go to the lineage's run (the trainer's cycle run) when it names one,
        else to a new run of the registry experiment. The version is created last, with all
        its tags at once: a crash before that leaves orphan artifacts, never a half version.
        `full`: store full weights even where a delta is allowed.
        """
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"{model_dir} is not a directory; pass a saved Hugging Face checkpoint")
        manifest = build_manifest(model_dir)
        run_id = lineage.run_id or self._new_run(model_dir)
        lineage = lineage.model_copy(update={"run_id": run_id})
        with tempfile.TemporaryDirectory() as tmp:
            stored, manifest["artifact"] = self._stored_form(
                model_dir, manifest, None if full else lineage.parent_version, Path(tmp)
            )
            raw_manifest = manifest_bytes(manifest)
            self._client.log_artifacts(run_id, str(stored), ARTIFACT_DIR)
            path = Path(tmp) / MANIFEST_ARTIFACT
            path.write_bytes(raw_manifest)
            self._client.log_artifact(run_id, str(path))
        self._ensure_registered_model()
        now = _utc_now()
        first = GateChange(state="pending", previous="", by="registry", at=now, reason="registered")
        mv = self._client.create_model_version(
            self._name,
            source=f"{self._client.get_run(run_id).info.artifact_uri}/{ARTIFACT_DIR}",
            run_id=run_id,
            tags={
                TAG_LINEAGE: lineage.model_dump_json(),
                TAG_GATE_STATE: "pending",
                _history_key(0): _change_json(first),
                TAG_MANIFEST_SHA: hashlib.sha256(raw_manifest).hexdigest(),
                **(_tags or {}),
            },
            description=f"parent {lineage.parent_version or '-'}; {lineage.sample_count} samples",
        )
        return str(mv.version)

    def _stored_form(
        self, model_dir: Path, manifest: dict[str, Any], parent: str | None, scratch: Path
    ) -> tuple[Path, dict[str, Any]]:
        """(the folder to store, the manifest's artifact record): a delta against `parent` when the
        chain allows it and it is smaller, else `model_dir` itself in full."""
        full = {"kind": "full", "parent": None, "chain_length": 0, "stored": manifest["files"],
                "stored_bytes": manifest["total_bytes"]}  # fmt: skip
        # Deltas are for weights: a checkpoint without safetensors weights (no tensors hashed) is stored whole.
        if parent is None or self._max_chain == 0 or not manifest["tensors"]:
            return model_dir, full
        try:
            parent_mv = self._version(parent)
        except UnknownVersion:
            return model_dir, full
        if TAG_ADAPTER in parent_mv.tags:  # full weights trained from an adapter share no file with it
            return model_dir, full
        parent_manifest = self._manifest(parent_mv)
        chain = int(artifact_of(parent_manifest)["chain_length"]) + 1
        if chain > self._max_chain:  # the chain is long enough: a full snapshot starts the next one
            log.info("version from %s stored in full: chain limit %d reached", parent, self._max_chain)
            return model_dir, full
        parent_dir = self.fetch(parent)
        out = scratch / "delta"
        out.mkdir()
        unchanged = []
        for name, record in manifest["files"].items():
            if parent_manifest["files"].get(name) == record:
                unchanged.append(name)
                continue
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if name.endswith(".safetensors") and (parent_dir / name).is_file():
                parent_raw, child_raw = (parent_dir / name).read_bytes(), (model_dir / name).read_bytes()
                try:
                    if not shares_tensors(parent_raw, child_raw):
                        # A delta would hold every tensor again and add a link to the chain for nothing.
                        log.info("version from %s stored in full: no tensor of %s keeps its parent's dtype"
                                 " and shape (a dtype change)", parent, name)  # fmt: skip
                        return model_dir, full
                    blob = make_delta(parent_raw, child_raw)
                except DeltaError:  # not a safetensors file after all: stored as it is
                    blob = None
                if blob is not None and len(blob) < record["bytes"]:
                    target.with_name(target.name + SUFFIX).write_bytes(blob)
                    continue
            shutil.copyfile(model_dir / name, target)
        artifact = {"kind": "delta", "parent": str(parent), "chain_length": chain, "unchanged": unchanged,
                    "parent_manifest_sha256": parent_mv.tags.get(TAG_MANIFEST_SHA)}  # fmt: skip
        (out / DELTA_INFO).write_text(json.dumps(artifact, indent=1))
        stored = build_manifest(out)
        artifact |= {"stored": stored["files"], "stored_bytes": stored["total_bytes"]}
        if stored["total_bytes"] >= manifest["total_bytes"]:
            return model_dir, full
        return out, artifact

    def _new_run(self, model_dir: Path) -> str:
        exp_id = ensure_experiment(self._client, self._settings, REGISTRY_EXPERIMENT)
        run = self._client.create_run(exp_id, run_name=f"register {model_dir.name}")
        self._client.set_terminated(run.info.run_id)
        return str(run.info.run_id)

    def _ensure_registered_model(self) -> None:
        try:
            self._client.get_registered_model(self._name)
        except MlflowException:
            try:
                self._client.create_registered_model(self._name)
            except MlflowException:  # created concurrently by another process
                self._client.get_registered_model(self._name)

    # -- reading -----------------------------------------------------------------------
    def _version(self, version: str) -> ModelVersion:
        # Versions are positive integers; anything else (or one too big for the store) is unknown.
        if not (str(version).isdigit() and 0 < int(version) < 2**31):
            raise UnknownVersion(f"model {self._name!r} has no version {version!r}")
        try:
            return self._client.get_model_version(self._name, str(int(version)))
        except MlflowException as exc:
            if exc.error_code in _NOT_FOUND:
                raise UnknownVersion(f"model {self._name!r} has no version {version!r}") from exc
            raise

    @_reachable
    def lineage(self, version: str) -> ModelLineage:
        return ModelLineage.model_validate_json(self._version(version).tags[TAG_LINEAGE])

    @_reachable
    def versions(self) -> list[VersionInfo]:
        """Every version, newest first."""
        try:
            found = self._client.search_model_versions(f"name='{self._name}'")
            model_aliases = self._client.get_registered_model(self._name).aliases
        except MlflowException as exc:
            if exc.error_code in _NOT_FOUND:  # nothing registered yet
                return []
            raise
        # search results carry no aliases on every store; the registered model has them all
        aliases: dict[str, list[str]] = {}
        for alias, version in model_aliases.items():
            aliases.setdefault(str(version), []).append(alias)
        infos = [_info(mv, aliases.get(str(mv.version), [])) for mv in found if TAG_LINEAGE in mv.tags]
        return sorted(infos, key=lambda v: int(v.version), reverse=True)

    @_reachable
    def gate_state(self, version: str) -> str:
        return str(self._version(version).tags.get(TAG_GATE_STATE, "pending"))

    @_reachable
    def gate_history(self, version: str) -> list[GateChange]:
        """Every gate-state change of `version`, oldest first."""
        tags = self._version(version).tags
        keys = sorted(k for k in tags if k.startswith(TAG_GATE_HISTORY))
        return [_change_from_json(tags[k]) for k in keys]

    @_reachable
    def offline_gates(self, version: str) -> OfflineGateReport | None:
        """The last offline-gate report recorded on `version`, or None when none was."""
        tags = self._version(version).tags
        raw = tags.get(TAG_OFFLINE_GATES)
        if raw is None:
            return None
        summary = json.loads(raw)
        results = [
            OfflineGateResult(name=name, **json.loads(tags[TAG_OFFLINE_GATE + name]))
            for name in summary["gates"]
            if TAG_OFFLINE_GATE + name in tags
        ]
        return OfflineGateReport(
            checked_at=datetime.fromisoformat(summary["checked_at"]),
            champion=summary["champion"],
            results=results,
            config=summary.get("config", {}),
        )

    # -- changing ----------------------------------------------------------------------
    @_reachable
    def record_offline_gates(self, version: str, report: OfflineGateReport) -> None:
        """Record `report` on `version` (replacing an earlier one): one tag per gate, the summary last.

        Readers follow the summary's list of gates, so a crash part-way leaves the previous report
        (or none) readable, never a mix presented as one.
        """
        mv = self._version(version)
        for r in report.results:
            if not r.name.replace("_", "").isalnum():
                raise ValueError(f"offline gate name {r.name!r}: use letters, digits and underscores")
            value = {"status": r.status, "value": r.value, "bound": r.bound, "detail": r.detail[:_DETAIL_CHARS]}
            self._client.set_model_version_tag(self._name, str(version), TAG_OFFLINE_GATE + r.name, json.dumps(value))
        summary = {
            "checked_at": report.checked_at.isoformat(),
            "champion": report.champion,
            "passed": report.passed,
            "gates": [r.name for r in report.results],
            "config": report.config,
        }
        self._client.set_model_version_tag(self._name, str(version), TAG_OFFLINE_GATES, json.dumps(summary))
        names = {TAG_OFFLINE_GATE + r.name for r in report.results}
        for stale in [k for k in mv.tags if k.startswith(TAG_OFFLINE_GATE) and k not in names]:
            self._client.delete_model_version_tag(self._name, str(version), stale)

    @_reachable
    def set_gate_state(self, version: str, state: str, *, by: str, reason: str = "") -> None:
        """Move `version` to `state`, recording who did it, when and why."""
        if state not in GATE_STATES:
            raise ValueError(f"unknown gate state {state!r}; use one of {', '.join(GATE_STATES)}")
        if not by.strip():
            raise ValueError("say who changes the gate state (by=...)")
        mv = self._version(version)
        seq = sum(1 for k in mv.tags if k.startswith(TAG_GATE_HISTORY))
        change = GateChange(
            state=state, previous=mv.tags.get(TAG_GATE_STATE, ""), by=by, at=_utc_now(), reason=reason
        )
        # History first: a crash between the two writes leaves a history entry ahead of the
        # state, which is visible and repairable, never a state change nobody recorded.
        self._client.set_model_version_tag(self._name, str(version), _history_key(seq), _change_json(change))
        self._client.set_model_version_tag(self._name, str(version), TAG_GATE_STATE, state)

    @_reachable
    def set_alias(self, alias: str, version: str) -> None:
        self._version(version)
        self._client.set_registered_model_alias(self._name, alias, str(version))

    @_reachable
    def delete_alias(self, alias: str) -> None:
        """Remove `alias` (no error when it is not set)."""
        if self.alias(alias) is not None:
            self._client.delete_registered_model_alias(self._name, alias)

    @_reachable
    def alias(self, alias: str) -> str | None:
        try:
            return str(self._client.get_model_version_by_alias(self._name, alias).version)
        except MlflowException as exc:
            if exc.error_code in _NOT_FOUND:
                return None
            raise

    # -- fetching ----------------------------------------------------------------------
    @_reachable
    def fetch(self, version: str) -> Path:
        """A verified local copy of `version`'s checkpoint, cached under data_dir/models/<version>.

        A delta is rebuilt from its parent (fetched the same way). The cached copy is checked
        against the manifest on every call. Raises `ArtifactIntegrityError` when the stored
        artifacts or the rebuilt checkpoint do not match the manifest recorded at registration,
        or when a link of the chain is missing or is not the parent the delta was made against.
        """
        path = self._fetch(str(version), ())
        if (path / ADAPTER_INFO).is_file() and is_adapter_dir(path):
            self._check_adapter_base(str(version), path)
        return path

    def _check_adapter_base(self, version: str, path: Path) -> None:
        """Refuse adapter `version` unless its base version still has the manifest hash it was trained on;
        fetch that base beside it (verified), where `load_policy` looks for it."""
        try:
            info = read_adapter_info(path)
        except CheckpointError as exc:
            raise ArtifactIntegrityError(f"version {version}: {exc}") from None
        self._check_base_hash(version, info)
        self._fetch(info.base_version, (version,))

    def _check_base_hash(self, version: str, info: AdapterInfo) -> None:
        try:
            base_mv = self._version(info.base_version)
        except UnknownVersion:
            raise ArtifactIntegrityError(
                f"version {version} is a LoRA adapter of {info.describe()}, which the registry does not hold"
            ) from None
        held = str(base_mv.tags.get(TAG_MANIFEST_SHA))
        if held != info.base_manifest_sha256:
            raise ArtifactIntegrityError(
                f"version {version} is a LoRA adapter trained on {info.describe()}, but version {info.base_version}"
                f" now has manifest sha256 {held[:12]}...: its base does not match, so it is refused"
            )

    def _fetch(self, version: str, below: tuple[str, ...]) -> Path:
        mv = self._version(version)
        manifest = self._manifest(mv)
        target = self._cache_dir / str(version)
        if target.is_dir():
            try:
                verify(target, manifest)
                return target
            except ArtifactIntegrityError:
                shutil.rmtree(target)  # a damaged cache is rebuilt, not trusted
        self._cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=self._cache_dir))
        try:
            local = self._materialize(mv, manifest, staging, below)
            try:
                os.replace(local, target)
            except OSError:
                if not target.is_dir():  # another process put a verified copy there first
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    @_reachable
    def verify(self, version: str) -> None:
        """Download `version`'s artifacts to a scratch folder, rebuild it when it is a delta, and check
        every stored file, every rebuilt file and every tensor against the manifest.

        Raises `ArtifactIntegrityError` naming what is wrong; keeps nothing (the gate checks a
        candidate this way before it lets any user receive it).
        """
        mv = self._version(version)
        manifest = self._manifest(mv)
        with tempfile.TemporaryDirectory(prefix=f"verify-{version}-") as tmp:
            local = self._materialize(mv, manifest, Path(tmp), (), tensors=True)
            if (local / ADAPTER_INFO).is_file() and is_adapter_dir(local):  # its base still has the hash it names
                self._check_base_hash(str(version), read_adapter_info(local))

    def _materialize(self, mv: ModelVersion, manifest: dict[str, Any], into: Path, below: tuple[str, ...],
                     *, tensors: bool = False) -> Path:  # fmt: skip
        """The checkpoint of `mv` under `into`, rebuilt and verified: every file's sha256, and with `tensors`
        every tensor's too (implied by the files' hashes, which were taken of the same bytes: `verify`
        checks them anyway, a load, on the path of a live swap, does not hash everything twice)."""
        version = str(mv.version)
        artifact = artifact_of(manifest)
        stored = self._download_verified(mv, manifest, artifact, into)
        local = stored if artifact["kind"] == "full" else self._rebuild(version, artifact, stored, into / "rebuilt",
                                                                         below)
        try:
            try:
                verify(local, manifest)
            except ArtifactIntegrityError:
                verify_tensors(local, manifest)  # name the tensors that differ, where a weights file does
                raise
            if tensors:
                verify_tensors(local, manifest)
        except ArtifactIntegrityError as exc:
            raise ArtifactIntegrityError(
                f"version {version} of {self._name!r} (run {mv.run_id}) is corrupted: {exc}"
            ) from None
        return local

    def _rebuild(self, version: str, artifact: dict[str, Any], stored: Path, out: Path,
                 below: tuple[str, ...]) -> Path:  # fmt: skip
        parent = str(artifact["parent"])
        if parent in below or parent == version:
            raise ArtifactIntegrityError(f"version {version}: its delta chain loops back to version {parent}")
        try:
            parent_mv = self._version(parent)
        except UnknownVersion:
            raise ArtifactIntegrityError(
                f"version {version} is a delta against version {parent}, which the registry does not hold: "
                "a missing link in its chain"
            ) from None
        if parent_mv.tags.get(TAG_MANIFEST_SHA) != artifact.get("parent_manifest_sha256"):
            raise ArtifactIntegrityError(
                f"version {version}'s delta was made against a parent whose manifest hash is "
                f"{str(artifact.get('parent_manifest_sha256'))[:12]}..., but version {parent}'s is "
                f"{str(parent_mv.tags.get(TAG_MANIFEST_SHA))[:12]}...: its manifest names another parent"
            )
        try:
            parent_dir = self._fetch(parent, (*below, version))
        except ArtifactIntegrityError as exc:
            raise ArtifactIntegrityError(f"version {version} cannot be rebuilt: its parent {exc}") from None
        out.mkdir(parents=True)
        for name in artifact.get("unchanged", []):
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(parent_dir / name, out / name)
        for name in artifact["stored"]:
            if name == DELTA_INFO:
                continue
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            if not name.endswith(SUFFIX):
                shutil.copyfile(stored / name, out / name)
                continue
            result = name.removesuffix(SUFFIX)
            try:
                rebuilt = apply_delta((parent_dir / result).read_bytes(), (stored / name).read_bytes())
            except (DeltaError, OSError) as exc:
                raise ArtifactIntegrityError(
                    f"version {version}: {result} cannot be rebuilt from version {parent}: {exc}"
                ) from None
            (out / result).write_bytes(rebuilt)
        return out

    def _download_verified(
        self, mv: ModelVersion, manifest: dict[str, Any], artifact: dict[str, Any], into: Path
    ) -> Path:
        """The stored files (full checkpoint or delta), each checked against the manifest."""
        local = Path(self._download(mv, ARTIFACT_DIR, into))
        try:
            verify(local, manifest, artifact["stored"])
        except ArtifactIntegrityError as exc:
            kind = "delta" if artifact["kind"] == "delta" else "checkpoint"
            raise ArtifactIntegrityError(
                f"version {mv.version} of {self._name!r} (run {mv.run_id}): the stored {kind} is corrupted: {exc}"
            ) from None
        return local

    def _download(self, mv: ModelVersion, path: str, into: Path | str) -> str:
        try:
            return str(self._client.download_artifacts(_run_of(mv), path, str(into)))
        except MlflowException as exc:
            if _is_unreachable(exc):
                raise
            raise ArtifactIntegrityError(
                f"version {mv.version} of {self._name!r}: its artifact {path!r} is missing from the store "
                f"(run {mv.run_id})"
            ) from None
        except OSError:
            raise ArtifactIntegrityError(
                f"version {mv.version} of {self._name!r}: its artifact {path!r} is missing from the store "
                f"(run {mv.run_id})"
            ) from None

    def _manifest(self, mv: ModelVersion) -> dict[str, Any]:
        recorded = str(mv.tags.get(TAG_MANIFEST_SHA))
        key = (str(mv.version), recorded)
        if key in self._manifests:
            return self._manifests[key]
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(self._download(mv, MANIFEST_ARTIFACT, tmp)).read_bytes()
        if hashlib.sha256(raw).hexdigest() != recorded:
            raise ArtifactIntegrityError(
                f"version {mv.version} of {self._name!r}: the stored manifest does not match "
                "its recorded hash"
            )
        manifest: dict[str, Any] = json.loads(raw)
        self._manifests[key] = manifest
        return manifest

    @_reachable
    def manifest(self, version: str) -> dict[str, Any]:
        """`version`'s manifest (checked against its recorded hash)."""
        return self._manifest(self._version(version))

    def artifact(self, version: str) -> ArtifactInfo:
        """What `version` stores: full weights or a delta (against which parent, how far from a snapshot)."""
        manifest = self.manifest(version)
        art = artifact_of(manifest)
        adapter = self.adapter(version)
        if adapter is not None:
            art |= {"kind": "adapter", "parent": adapter.base_version}
        return ArtifactInfo(
            kind=art["kind"], parent=art.get("parent"), chain_length=int(art["chain_length"]),
            stored_bytes=int(art.get("stored_bytes") or sum(f["bytes"] for f in art["stored"].values())),
            checkpoint_bytes=int(manifest["total_bytes"]),
        )  # fmt: skip

    def diff(self, a: str, b: str) -> list[TensorDiff]:
        """Tensor by tensor, how version `b`'s weights differ from version `a`'s (both fetched, verified)."""
        return diff_checkpoints(self.fetch(a), self.fetch(b))


def _info(mv: ModelVersion, aliases: list[str]) -> VersionInfo:
    return VersionInfo(
        version=str(mv.version),
        created_at=datetime.fromtimestamp(mv.creation_timestamp / 1000, tz=UTC),
        lineage=ModelLineage.model_validate_json(mv.tags[TAG_LINEAGE]),
        gate_state=str(mv.tags.get(TAG_GATE_STATE, "pending")),
        aliases=sorted(aliases),
        reason=_latest_reason(mv.tags),
    )


def _latest_reason(tags: dict[str, str]) -> str:
    keys = sorted(k for k in tags if k.startswith(TAG_GATE_HISTORY))
    return _change_from_json(tags[keys[-1]]).reason if keys else ""


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _history_key(seq: int) -> str:
    return f"{TAG_GATE_HISTORY}{seq:05d}"


def _change_json(change: GateChange) -> str:
    return json.dumps(
        {
            "state": change.state,
            "previous": change.previous,
            "by": change.by,
            "at": change.at.isoformat(),
            "reason": change.reason,
            "id": uuid.uuid4().hex[:8],
        }
    )


def _change_from_json(raw: str) -> GateChange:
    d = json.loads(raw)
    return GateChange(
        state=d["state"],
        previous=d["previous"],
        by=d["by"],
        at=datetime.fromisoformat(d["at"]),
        reason=d["reason"],
    )
