"""Per-file sha256 manifests of a checkpoint directory, and their verification.

A manifest is written when a version is registered and checked every time a version
is fetched, so a corrupted or truncated artifact is refused instead of served.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST_FORMAT = 1
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
    return {"format": MANIFEST_FORMAT, "files": files, "total_bytes": sum(f["bytes"] for f in files.values())}


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, indent=1).encode()


def verify(model_dir: Path, manifest: dict[str, Any]) -> None:
    """Raise `ArtifactIntegrityError` naming every missing, unexpected or altered file."""
    problems = []
    expected = manifest["files"]
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
