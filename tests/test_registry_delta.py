"""Delta artifacts in the registry: exact rebuilds along a chain, the chain limit, and every broken link refused."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flywheel.contract import ModelLineage
from flywheel.lm import load_policy
from flywheel.settings import Settings
from model_registry import ArtifactIntegrityError, ModelRegistry
from model_registry.delta import DeltaError, apply_delta, describe_delta, make_delta

WEIGHTS = "model.safetensors"


def trained_step(src: Path, out: Path, seed: int, share: float = 0.05) -> Path:
    """A checkpoint like one optimizer step's: a few percent of the values nudged, the rest bit-equal
    (in bfloat16, as the trainer stores them)."""
    policy = load_policy(src, dtype="bfloat16")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            mask = torch.rand(p.shape, generator=gen) < share
            p.add_(mask * torch.randn(p.shape, generator=gen) * 1e-3)
    return policy.save(out)


def chain(registry: ModelRegistry, start: Path, tmp_path: Path, n: int) -> tuple[list[str], list[Path]]:
    """A full version and `n` children, each trained from the one before; (versions, checkpoint dirs)."""
    dirs = [start]
    versions = [registry.register(start, ModelLineage(base="tiny"))]
    for i in range(n):
        dirs.append(trained_step(dirs[-1], tmp_path / f"ck{i + 1}", seed=i))
        versions.append(registry.register(dirs[-1], ModelLineage(base="tiny", parent_version=versions[-1])))
    return versions, dirs


def stored_file(settings: Settings, registry: ModelRegistry, version: str, name: str) -> Path:
    run_id = registry.lineage(version).run_id
    assert run_id
    root = settings.data_dir / "mlflow" / "artifacts"
    return next(p for p in root.rglob(name) if run_id in p.parts)


def fresh(settings: Settings) -> ModelRegistry:
    """A registry with nothing cached: every fetch rebuilds from the artifact store."""
    shutil.rmtree(settings.data_dir / "models", ignore_errors=True)
    return ModelRegistry(settings)


def test_a_chain_of_deltas_rebuilds_bit_identically_and_the_limit_writes_a_snapshot(
    settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings.registry_max_chain = 3
    registry = ModelRegistry(settings)
    versions, dirs = chain(registry, tiny_model_dir, tmp_path, 5)
    kinds = [(registry.manifest(v)["artifact"]["kind"], registry.manifest(v)["artifact"]["chain_length"])
             for v in versions]  # fmt: skip
    # v1 full; three deltas; the fourth would make the chain too long: a full snapshot starts a new chain
    assert kinds == [("full", 0), ("delta", 1), ("delta", 2), ("delta", 3), ("full", 0), ("delta", 1)]
    assert registry.manifest(versions[1])["artifact"]["stored_bytes"] * 5 < (dirs[1] / WEIGHTS).stat().st_size

    registry = fresh(settings)
    for version, source in zip(versions, dirs, strict=True):
        rebuilt = registry.fetch(version)
        for name in registry.manifest(version)["files"]:
            assert (rebuilt / name).read_bytes() == (source / name).read_bytes(), f"v{version} {name}"
        ours, theirs = load_file(rebuilt / WEIGHTS), load_file(source / WEIGHTS)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        digest = hashlib.sha256(ours["model.embed_tokens.weight"].view(torch.uint8).numpy().tobytes()).hexdigest()
        assert registry.manifest(version)["tensors"][WEIGHTS]["model.embed_tokens.weight"]["sha256"] == digest
        registry.verify(version)


def test_a_flipped_byte_in_a_stored_delta_is_refused(
    settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    registry = ModelRegistry(settings)
    versions, _ = chain(registry, tiny_model_dir, tmp_path, 1)
    stored = stored_file(settings, registry, versions[1], WEIGHTS + ".fwdelta")
    raw = bytearray(stored.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    stored.write_bytes(bytes(raw))
    registry = fresh(settings)
    with pytest.raises(ArtifactIntegrityError, match=r"stored delta is corrupted: model\.safetensors\.fwdelta: sha256"):
        registry.fetch(versions[1])
    with pytest.raises(ArtifactIntegrityError, match="stored delta is corrupted"):
        registry.verify(versions[1])
    assert not (settings.data_dir / "models" / versions[1]).exists()
    registry.fetch(versions[0])  # the parent is unharmed


def test_a_missing_link_is_refused(settings: Settings, tiny_model_dir: Path, tmp_path: Path) -> None:
    registry = ModelRegistry(settings)
    versions, _ = chain(registry, tiny_model_dir, tmp_path, 2)
    # the middle version's stored files are gone from the artifact store
    shutil.rmtree(stored_file(settings, registry, versions[1], WEIGHTS + ".fwdelta").parent)
    registry = fresh(settings)
    with pytest.raises(ArtifactIntegrityError, match=rf"version {versions[2]} cannot be rebuilt: its parent.*missing"):
        registry.fetch(versions[2])
    # the middle version is deleted from the registry altogether
    registry.client.delete_model_version(settings.registered_model_name, versions[1])
    with pytest.raises(ArtifactIntegrityError, match=rf"delta against version {versions[1]}.*missing link"):
        fresh(settings).fetch(versions[2])


def _rewrite_manifest(settings: Settings, registry: ModelRegistry, version: str, **artifact: object) -> None:
    """Replace fields of a version's artifact record and re-record the manifest's hash: a manifest that is
    self-consistent but describes a delta against another parent (a registration bug, not bit rot)."""
    path = stored_file(settings, registry, version, "checkpoint_manifest.json")
    manifest = json.loads(path.read_bytes())
    manifest["artifact"].update(artifact)
    raw = json.dumps(manifest, sort_keys=True, indent=1).encode()
    path.write_bytes(raw)
    registry.client.set_model_version_tag(settings.registered_model_name, version, "flywheel.manifest_sha256",
                                          hashlib.sha256(raw).hexdigest())  # fmt: skip


def test_a_manifest_naming_another_parent_is_refused(settings: Settings, tiny_model_dir: Path, tmp_path: Path) -> None:
    registry = ModelRegistry(settings)
    versions, dirs = chain(registry, tiny_model_dir, tmp_path, 1)
    other = registry.register(trained_step(tiny_model_dir, tmp_path / "other", seed=9, share=0.5),
                              ModelLineage(base="tiny"), full=True)  # fmt: skip

    _rewrite_manifest(settings, registry, versions[1], parent=other)
    with pytest.raises(ArtifactIntegrityError, match="its manifest names another parent"):
        fresh(settings).fetch(versions[1])

    # Even when the parent's manifest hash is forged too, the delta itself knows its parent's bits.
    other_sha = fresh(settings).client.get_model_version(settings.registered_model_name, other).tags[
        "flywheel.manifest_sha256"]  # fmt: skip
    _rewrite_manifest(settings, registry, versions[1], parent=other, parent_manifest_sha256=other_sha)
    with pytest.raises(ArtifactIntegrityError, match="made against a parent file with sha256"):
        fresh(settings).fetch(versions[1])


def test_delta_encoding_round_trips_every_dtype_and_refuses_the_wrong_parent() -> None:
    from safetensors.torch import save

    gen = torch.Generator().manual_seed(0)
    parent = {
        "f32": torch.randn(64, 33, generator=gen),
        "bf16": torch.randn(257, generator=gen).to(torch.bfloat16),
        "i64": torch.arange(10),
        "gone": torch.zeros(3),
        "reshaped": torch.zeros(4, 4),
    }
    child = {k: v.clone() for k, v in parent.items() if k != "gone"}
    child["f32"][3, :5] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40, 7.0])
    child["bf16"] += 1
    child["reshaped"] = torch.ones(2, 8)
    child["new"] = torch.ones(5, dtype=torch.float16)
    # An optimizer-like step: every value moves by the same small amount, so in bf16 only the small ones change.
    parent["step"] = (torch.randn(4096, generator=gen) * 0.02).to(torch.bfloat16)
    child["step"] = (parent["step"].float() + 1e-4).to(torch.bfloat16)
    p, c = save(parent, {"format": "pt"}), save(child, {"format": "pt"})
    delta = make_delta(p, c)
    assert apply_delta(p, delta) == c
    encodings = {name: d["enc"] for name, d in describe_delta(delta).items()}
    assert encodings["i64"] == "same" and encodings["new"] == encodings["reshaped"] == "raw"
    assert encodings["step"] == "xor_mag"
    # Sparse patches win where a few scattered values change to unrelated bits.
    parent2 = {"rows": torch.randn(131072, generator=gen)}
    child2 = {"rows": parent2["rows"].clone()}
    child2["rows"][torch.randperm(131072, generator=gen)[:300]] = torch.randn(300, generator=gen)
    p2, c2 = save(parent2), save(child2)
    delta2 = make_delta(p2, c2)
    assert describe_delta(delta2)["rows"]["enc"] == "sparse" and apply_delta(p2, delta2) == c2
    with pytest.raises(DeltaError, match="made against a parent file"):
        apply_delta(c, make_delta(p, c))


def test_cli_lists_kinds_shows_manifests_diffs_and_verifies(
    settings: Settings, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from flywheel.settings import get_settings
    from model_registry.cli import app

    for key, value in {"FLYWHEEL_DATA_DIR": str(settings.data_dir), "FLYWHEEL_REDIS_URL": settings.redis_url,
                       "FLYWHEEL_MLFLOW_TRACKING_URI": settings.mlflow_tracking_uri}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    # A wide terminal, whatever width the CLI's console took when another test first imported it.
    from rich.console import Console

    import model_registry.cli as registry_cli

    monkeypatch.setattr(registry_cli, "console", Console(width=200))
    get_settings.cache_clear()
    registry = ModelRegistry(settings)
    versions, _ = chain(registry, tiny_model_dir, tmp_path, 1)
    runner = CliRunner()
    try:
        listed = runner.invoke(app, ["list"])
        assert listed.exit_code == 0, listed.output
        assert "delta" in listed.output and "full" in listed.output
        # An 80-column terminal reads whole headers and version names; the detail columns wait for --wide.
        with monkeypatch.context() as narrow_terminal:
            narrow_terminal.setattr(registry_cli, "console", Console(width=80))
            narrow = runner.invoke(app, ["list"])
            assert narrow.exit_code == 0, narrow.output
            assert all(len(line) <= 80 for line in narrow.output.splitlines())
            for header in ("version", "gate state", "aliases", "parent", "artifact", "why"):
                assert header in narrow.output
            assert "…" not in narrow.output and "samples" not in narrow.output
            assert all(f" {v} " in narrow.output for v in versions)
            assert "samples" in runner.invoke(app, ["list", "--wide"]).output
        shown = runner.invoke(app, ["show", versions[1], "--manifest"])
        assert shown.exit_code == 0
        assert json.loads(shown.output)["artifact"]["parent"] == versions[0]
        diffed = runner.invoke(app, ["diff", versions[0], versions[1]])
        assert diffed.exit_code == 0 and "model.embed_tokens.weight" in diffed.output and "changed" in diffed.output
        rows = {r.name: r for r in registry.diff(versions[0], versions[1])}
        assert 0.0 < rows["model.embed_tokens.weight"].changed_share < 0.2  # 5% of values were nudged
        assert runner.invoke(app, ["verify", versions[1]]).exit_code == 0

        stored = stored_file(settings, registry, versions[1], WEIGHTS + ".fwdelta")
        raw = stored.read_bytes()
        stored.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
        failed = runner.invoke(app, ["verify", versions[1]])
        assert failed.exit_code == 1 and "stored delta is corrupted" in failed.output
    finally:
        get_settings.cache_clear()
