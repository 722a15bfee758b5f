"""Manifests of a checkpoint directory (per-file and per-tensor sha256), and their verification.

A manifest is written when a version is registered and checked every time a version
is fetched, so a corrupted or truncated artifact is refused instead of served. It describes
the *result* (the checkpoint serving loads), whatever the version stores: `files` and
`tensors` are the rebuilt checkpoint's, and `artifact` says what is stored (full weights, or a
delta against a parent: which parent, whose manifest hash, chain length, and each stored
file's hash, checked before anything is applied).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from model_registry.delta import DeltaError, tensor_hashes

MANIFEST_FORMAT = 2  # 2 adds `tensors` and `artifact`; format 1 manifests read as full artifacts
_CHUNK = 1 << 20


class ArtifactIntegrityError(RuntimeError):
    """A fetched checkpoint does not match the manifest recorded at registration."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(model_dir: Path) -> dict[str, Any]:
    """The manifest of every file under `model_dir`.

    Shape: {"format", "files": {relative path: {"sha256", "bytes"}}, "total_bytes"}.
    """
    files = {}
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        files[path.relative_to(model_dir).as_posix()] = {
            "sha256": file_sha256(path),
            "bytes": path.stat().st_size,
        }
    if not files:
        raise ValueError(f"{model_dir} holds no files; pass a directory with a saved checkpoint")
    tensors = {}
    for name in files:
        if name.endswith(".safetensors"):
            try:
                tensors[name] = tensor_hashes((model_dir / name).read_bytes())
            except DeltaError:  # not a real safetensors file: the file hash alone covers it
                continue
    return {"format": MANIFEST_FORMAT, "files": files, "total_bytes": sum(f["bytes"] for f in files.values()),
            "tensors": tensors}


def artifact_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the version stores; a manifest without the record (format 1) is a full artifact."""
    default = {"kind": "full", "parent": None, "chain_length": 0, "stored": manifest["files"]}
    return dict(manifest.get("artifact") or default)


def verify_tensors(model_dir: Path, manifest: dict[str, Any]) -> None:
    """Raise `ArtifactIntegrityError` naming every tensor whose bits differ from the manifest's record."""
    problems = []
    for name, want in manifest.get("tensors", {}).items():
        try:
            got = tensor_hashes((model_dir / name).read_bytes())
        except (OSError, DeltaError) as exc:
            problems.append(f"{name}: {exc}")
            continue
        for tensor in sorted(set(want) | set(got)):
            if want.get(tensor) != got.get(tensor):
                problems.append(f"{name}:{tensor}: differs from the manifest")
    if problems:
        raise ArtifactIntegrityError("; ".join(problems[:10]) + (f" (+{len(problems) - 10} more)"
                                                                 if len(problems) > 10 else ""))


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, indent=1).encode()


def verify(model_dir: Path, manifest: dict[str, Any], files: dict[str, Any] | None = None) -> None:
    """Raise `ArtifactIntegrityError` naming every missing, unexpected or altered file.

    `files`: the records to check against (default: the manifest's result files; a delta's
    stored files are checked with `artifact_of(manifest)["stored"]`)."""
    problems = []
    expected = manifest["files"] if files is None else files
    present = {p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*") if p.is_file()}
    for name in sorted(set(expected) - present):
        problems.append(f"{name}: missing")
    for name in sorted(present - set(expected)):
        problems.append(f"{name}: not in the manifest")
    for name in sorted(set(expected) & present):
        path = model_dir / name
        want = expected[name]
        if path.stat().st_size != want["bytes"]:
            problems.append(f"{name}: {path.stat().st_size} bytes, expected {want['bytes']}")
        elif file_sha256(path) != want["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
    if problems:
        raise ArtifactIntegrityError("; ".join(problems))
