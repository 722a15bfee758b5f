"""The `flywheel` command's processes run polars' allocator keeping freed pages (`flywheel.allocator`)."""

from __future__ import annotations

import os
import subprocess
import sys

from flywheel.allocator import ENV, KEEP_FREED_PAGES

_SHOW = "import launcher.cli, os, polars; print(os.environ['_RJEM_MALLOC_CONF'])"


def _conf_seen_by_polars(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", _SHOW], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_command_sets_polars_allocator_before_polars_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    conf = _conf_seen_by_polars(env)
    # polars' import puts its own settings first and what the variable held after them: the later setting wins
    assert conf.endswith("," + KEEP_FREED_PAGES), conf


def test_an_operators_own_allocator_setting_is_kept() -> None:
    env = {**os.environ, ENV: "dirty_decay_ms:1000"}
    conf = _conf_seen_by_polars(env)
    assert conf.endswith(",dirty_decay_ms:1000") and KEEP_FREED_PAGES not in conf, conf
