"""The model registry on real MLflow stores: SQLite (default) and PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from flywheel.contract import DataWindow, ModelLineage
from flywheel.settings import Settings
from model_registry import ArtifactIntegrityError, ModelRegistry, UnknownVersion


def _checkpoint(root: Path, payload: bytes = b"weights") -> Path:
    root.mkdir(parents=True)
    (root / "model.safetensors").write_bytes(payload * 100)
    (root / "config.json").write_text('{"model_type": "tiny"}')
    (root / "tok").mkdir()
    (root / "tok" / "tokenizer.json").write_text("{}")
    return root


def _lineage(parent: str | None = None) -> ModelLineage:
    window = DataWindow(start=None, end=datetime(2025, 1, 2, tzinfo=UTC), reward_version="r1")
    return ModelLineage(
        parent_version=parent,
        base="tiny",
        trainer_config={"lr": 1e-5},
        data_window=window,
        sample_count=12,
        metrics={"mean_reward": 0.25},
    )


def _exercise(registry: ModelRegistry, tmp_path: Path) -> None:
    v1 = registry.register(_checkpoint(tmp_path / "ck1"), ModelLineage(base="tiny"))
    v2 = registry.register(_checkpoint(tmp_path / "ck2", b"other"), _lineage(parent=v1))
    assert [v.version for v in registry.versions()] == [v2, v1]
    assert registry.gate_state(v2) == "pending"
    lineage = registry.lineage(v2)
    assert lineage.parent_version == v1 and lineage.sample_count == 12 and lineage.run_id
    assert lineage.data_window and lineage.data_window.end == datetime(2025, 1, 2, tzinfo=UTC)

    registry.set_alias("champion", v1)
    registry.set_gate_state(v2, "approved", by="alice", reason="offline checks passed")
    registry.set_gate_state(v2, "quarantined", by="gate", reason="rolled back")
    assert registry.alias("champion") == v1 and registry.alias("challenger") is None
    assert registry.gate_state(v2) == "quarantined"
    history = registry.gate_history(v2)
    assert [(h.state, h.previous, h.by) for h in history] == [
        ("pending", "", "registry"),
        ("approved", "pending", "alice"),
        ("quarantined", "approved", "gate"),
    ]
    assert history[1].reason == "offline checks passed" and history[1].at <= history[2].at
    assert {v.version: v.aliases for v in registry.versions()} == {v1: ["champion"], v2: []}

    local = registry.fetch(v2)
    assert local == registry._cache_dir / v2
    assert (local / "model.safetensors").read_bytes() == b"other" * 100
    assert (local / "tok" / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="unknown gate state"):
        registry.set_gate_state(v2, "shipped", by="x")
    with pytest.raises(UnknownVersion):
        registry.gate_state("999")


def test_registry_versions_lineage_gate_history_and_fetch_on_sqlite(
    settings: Settings, tmp_path: Path
) -> None:
    _exercise(ModelRegistry(settings), tmp_path)


def test_fetch_refuses_a_corrupted_artifact_and_repairs_a_damaged_cache(
    settings: Settings, tmp_path: Path
) -> None:
    registry = ModelRegistry(settings)
    version = registry.register(_checkpoint(tmp_path / "ck"), ModelLineage(base="tiny"))
    cached = registry.fetch(version)
    (cached / "config.json").write_text("tampered")  # a damaged local cache is re-downloaded
    assert (registry.fetch(version) / "config.json").read_text() == '{"model_type": "tiny"}'

    stored = next((settings.data_dir / "mlflow" / "artifacts").rglob("model.safetensors"))
    stored.write_bytes(b"bitrot" + stored.read_bytes()[6:])
    import shutil

    shutil.rmtree(cached)
    with pytest.raises(ArtifactIntegrityError, match=r"model\.safetensors: sha256 differs"):
        registry.fetch(version)
    assert not (settings.data_dir / "models" / version).exists()


@pytest.fixture
def postgres_uri() -> Iterator[str]:
    psycopg2 = pytest.importorskip("psycopg2")
    try:
        admin = psycopg2.connect(
            host="127.0.0.1", port=5432, user="postgres", dbname="test", connect_timeout=2
        )
    except psycopg2.OperationalError:
        pytest.skip("PostgreSQL does not answer on 127.0.0.1:5432")
    admin.autocommit = True
    name = f"flywheel_registry_{uuid.uuid4().hex[:10]}"
    admin.cursor().execute(f"CREATE DATABASE {name}")
    try:
        # psycopg2 named explicitly: SQLAlchemy 2.1 defaults to psycopg 3, not a dependency
        yield f"postgresql+psycopg2://postgres@127.0.0.1:5432/{name}"
    finally:
        # FORCE: MLflow's pooled connections to the database are still open
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


def test_registry_on_postgresql(settings: Settings, postgres_uri: str, tmp_path: Path) -> None:
    pg = settings.model_copy(update={"mlflow_tracking_uri": postgres_uri})
    _exercise(ModelRegistry(pg), tmp_path)


def test_verify_names_the_bad_file_and_keeps_nothing(settings: Settings, tmp_path: Path) -> None:
    registry = ModelRegistry(settings)
    version = registry.register(_checkpoint(tmp_path / "ck"), ModelLineage(base="tiny"))
    registry.verify(version)  # intact: no error
    stored = next((settings.data_dir / "mlflow" / "artifacts").rglob("tokenizer.json"))
    stored.write_text('{"evil": 1}')
    with pytest.raises(ArtifactIntegrityError, match=r"tok/tokenizer\.json: "):
        registry.verify(version)
    assert not (settings.data_dir / "models" / version).exists()


@pytest.mark.parametrize("version", ["999", "0", "-1", "abc", "1" * 30, "1 OR 1=1", ""])
def test_a_malformed_or_missing_version_is_unknown(settings: Settings, tmp_path: Path, version: str) -> None:
    registry = ModelRegistry(settings)
    registry.register(_checkpoint(tmp_path / "ck"), ModelLineage(base="tiny"))
    with pytest.raises(UnknownVersion):
        registry.gate_state(version)


def test_an_unreachable_tracking_server_is_reported_without_its_uri(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from launcher.embedded import free_port
    from model_registry import RegistryUnavailable

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://user:pa55word@127.0.0.1:{free_port()}"
    registry = ModelRegistry(settings.model_copy(update={"mlflow_tracking_uri": uri}))
    for call in (registry.versions, lambda: registry.alias("champion"), lambda: registry.gate_state("1")):
        with pytest.raises(RegistryUnavailable) as err:
            call()
        assert "pa55word" not in str(err.value)
