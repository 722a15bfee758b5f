"""The layer rule holds: imports only point down (docs/design.md, "Layers").

The contracts live in pyproject.toml under [tool.importlinter]; `lint-imports` checks them. The
second test proves the check bites: a copy of the code with one upward import must fail it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES: list[str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(root / "pyproject.toml")],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )


def test_the_code_keeps_every_import_contract() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_layers(tmp_path: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    # The core reaching up into a component: the one thing the layers forbid most.
    with (tmp_path / "flywheel" / "traffic.py").open("a") as f:
        f.write("\nimport ingest.worker.dedup  # noqa: E402,F401\n")

    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "flywheel.traffic -> ingest.worker.dedup" in result.stdout
