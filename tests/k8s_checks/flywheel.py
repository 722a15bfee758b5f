"""Flywheel's own contract with its manifests: every variable a container gets is a setting that validates,
every command is in the CLI, every long-running process is probed on its health endpoints."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

from tests.k8s_checks.manifests import Manifests, Problem, Resource, where
from tests.k8s_checks.objects import containers


def flywheel_args(c: Resource) -> list[str] | None:
    """The `flywheel` command line a container runs (after torchrun's own options), or None."""
    line = list(c.get("command") or []) + list(c.get("args") or [])
    if not line:
        return None
    if Path(line[0]).name == "flywheel":
        return line[1:]
    if Path(line[0]).name == "torchrun":
        for i, word in enumerate(line[1:], start=1):
            if Path(word).name == "flywheel":
                return line[i + 1:]
    return None


def environment(m: Manifests, c: Resource) -> dict[str, str]:
    """The container's environment as the manifests give it (ConfigMap and Secret values resolved)."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        kind, ref = ("ConfigMap", src["configMapRef"]) if "configMapRef" in src else ("Secret", src["secretRef"])
        env.update(m.data(kind, ref["name"]) or {})
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        ref = e.get("valueFrom", {})
        if "configMapKeyRef" in ref:
            kind, r = "ConfigMap", ref["configMapKeyRef"]
        else:
            kind, r = "Secret", ref.get("secretKeyRef")
        if r is not None:
            env[e["name"]] = (m.data(kind, r["name"]) or {}).get(r["key"], "")
    return env


def settings_classes() -> list[tuple[Any, str]]:
    from deploy_gate.rollout.config import RolloutConfig
    from flywheel.settings import Settings
    from signals.config import SignalsConfig

    return [(Settings, "FLYWHEEL_"), (SignalsConfig, "FLYWHEEL_SIGNALS_"), (RolloutConfig, "FLYWHEEL_ROLLOUT_")]


# The setting that decides where each long-running command serves /metrics (0: on its API's port).
METRICS_PORT_SETTING = {
    ("serve",): "FLYWHEEL_SERVING_METRICS_PORT",
    ("ingest", "collector"): "FLYWHEEL_COLLECTOR_METRICS_PORT",
    ("ingest", "worker"): "FLYWHEEL_INGEST_METRICS_PORT",
    ("signals", "worker"): "FLYWHEEL_SIGNALS_METRICS_PORT",
    ("gate", "serve"): "FLYWHEEL_GATE_METRICS_PORT",
    ("gate", "rollout"): "FLYWHEEL_ROLLOUT_METRICS_PORT",
    ("trainer", "schedule"): "FLYWHEEL_TRAINER_METRICS_PORT",
}


def command_of(args: list[str]) -> tuple[str, ...]:
    """The sub-command words of a `flywheel` command line (its options and their values left out)."""
    words: list[str] = []
    for i, word in enumerate(args):
        if word.startswith("-") or (i and args[i - 1].startswith("--") and "=" not in args[i - 1]):
            continue
        words.append(word)
    return tuple(words)


def setting_value(env: dict[str, str], variable: str) -> str:
    """The value a process reads for `variable`: the environment's, else the setting's default."""
    if variable in env:
        return env[variable]
    for cls, prefix in settings_classes():
        name = variable.removeprefix(prefix).lower()
        if variable.startswith(prefix) and name in cls.model_fields:
            return str(cls.model_fields[name].default)
    raise KeyError(f"{variable} is no setting")


def known_variables() -> dict[str, tuple[Any, str]]:
    """Environment variable -> (settings class, field) for every setting any Flywheel process reads."""
    from pydantic import AliasChoices

    out = {}
    for cls, prefix in settings_classes():
        for name, f in cls.model_fields.items():
            out[(prefix + name).upper()] = (cls, name)
            if isinstance(f.validation_alias, AliasChoices):
                for alias in f.validation_alias.choices:
                    out[str(alias).upper()] = (cls, name)
    return out


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """The process environment with the Flywheel variables replaced by `env`, put back after.

    Only the variables that differ are set or removed: clearing and refilling the whole environment would
    setenv/unsetenv every variable (PATH, TZ, ...), and a thread still running from an earlier test (a
    library's, reading the environment from C: getenv is not safe against a concurrent setenv) could then
    read freed memory and crash the whole pytest run."""
    ours = [k for k in os.environ if k.startswith("FLYWHEEL_") or k in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL",
                                                                       "MLFLOW_TRACKING_URI")]  # fmt: skip
    saved = {k: os.environ.get(k) for k in {*ours, *env}}
    for key in ours:
        if key not in env:
            del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, was in saved.items():
            if was is None:
                os.environ.pop(key, None)
            elif os.environ.get(key) != was:
                os.environ[key] = was


def library_variables() -> frozenset[str]:
    """Variables a Flywheel container may get that a library reads rather than its settings: the lake's storage
    credentials and endpoint (`flywheel.lake.STORAGE_VARIABLES`, read by delta-rs and pyarrow)."""
    from flywheel.lake import STORAGE_VARIABLES

    return STORAGE_VARIABLES


def check_settings(m: Manifests) -> list[Problem]:
    """Every variable a Flywheel container gets is a setting (or one the lake's storage library reads); the
    settings it gets validate; none is missing."""
    problems = []
    known = known_variables()
    for owner, c in containers(m):
        if flywheel_args(c) is None:
            continue
        env = environment(m, c)
        for key in sorted(env):
            if key not in known and key not in library_variables():
                problems.append(Problem("settings", where(owner),
                                        f"{c['name']}: {key} is no setting of any component"))
        with _environ({k: v for k, v in env.items() if k in known}):
            for cls, _prefix in settings_classes():
                try:
                    cls()
                except Exception as exc:  # a value a process would refuse at start
                    problems.append(Problem("settings", where(owner), f"{c['name']}: {cls.__name__}: {exc}"))
    return problems


@cache
def _cli() -> Any:
    import typer

    from launcher.cli import app

    return typer.main.get_command(app)


def mounted_file(m: Manifests, owner: Resource, c: Resource, path: str) -> str | None:
    """The text of the file at `path` inside the container when a ConfigMap or Secret volume puts it there, else
    None (a path on another volume, or not a path)."""
    if not path.startswith("/"):
        return None
    tpl = next(t for o, t in m.workloads() if o is owner and c in t["spec"]["containers"])
    volumes = {v["name"]: v for v in tpl["spec"].get("volumes", [])}
    for mount in c.get("volumeMounts", []):
        root = mount["mountPath"].rstrip("/") + "/"
        vol = volumes.get(mount["name"], {})
        if not path.startswith(root) or not ({"configMap", "secret"} & set(vol)):
            continue
        kind, name = ("ConfigMap", vol["configMap"]["name"]) if "configMap" in vol else (
            "Secret", vol["secret"]["secretName"])
        return (m.data(kind, name) or {}).get(path[len(root):])
    return None


def _trainer_config_problem(args: list[str], files: dict[str, str]) -> str | None:
    """A trainer's `--config` file that TrainerConfig refuses (the process would exit 2 at start)."""
    if args[:1] != ["trainer"] or "--config" not in args[:-1]:
        return None
    text = files.get(args[args.index("--config") + 1])
    if text is None:
        return None
    from trainer.config import TrainerConfig

    try:
        TrainerConfig.from_dict(json.loads(text))
    except (ValueError, TypeError) as exc:
        return f"--config: {exc}"
    return None


def check_commands(m: Manifests) -> list[Problem]:
    """Every `flywheel ...` a container runs is a command of the CLI, with options it takes; a file an option
    names that a ConfigMap or Secret volume provides is read from it (a trainer's config must validate)."""
    problems = []
    scratch = Path(tempfile.mkdtemp(prefix="k8s-commands-"))
    for owner, c in containers(m):
        args = flywheel_args(c)
        if args is None:
            continue
        files = {a: text for a in args if (text := mounted_file(m, owner, c, a)) is not None}
        if (bad := _trainer_config_problem(args, files)) is not None:
            problems.append(Problem("commands", where(owner), f"{c['name']}: {bad}"))
        local = {}
        for i, (a, text) in enumerate(files.items()):
            (scratch / str(i)).write_text(text)
            local[a] = str(scratch / str(i))
        args = [local.get(a, a) for a in args]
        cmd, words, path = _cli(), list(args), ["flywheel"]
        # Typer carries its own copy of click: groups are told by their sub-commands, not by class.
        while hasattr(cmd, "commands") and words and words[0] in cmd.commands:
            path.append(words[0])
            cmd = cmd.commands[words.pop(0)]
        if hasattr(cmd, "commands") and not getattr(cmd, "invoke_without_command", False):
            problems.append(Problem("commands", where(owner), f"{' '.join([*path, *words[:1]])}: no such command"))
            continue
        try:
            cmd.make_context(" ".join(path), words)
        except Exception as exc:  # click's usage errors: no such option, a bad value, a missing argument
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            problems.append(Problem("commands", where(owner), f"{' '.join([*path, *words])}: {message}"))
    shutil.rmtree(scratch, ignore_errors=True)
    return problems


def check_probes(m: Manifests) -> list[Problem]:
    """Every long-running Flywheel process is probed on its health endpoints, on a port it declares."""
    problems = []
    for owner in m.of("Deployment"):
        for c in owner["spec"]["template"]["spec"]["containers"]:
            if flywheel_args(c) is None:
                continue
            ports = {p.get("name") for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
            for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
                get = (c.get(probe) or {}).get("httpGet")
                if get is None:
                    problems.append(Problem("probes", where(owner), f"{c['name']}: no {probe} on {path}"))
                elif get.get("path") != path or get.get("port") not in ports:
                    problems.append(Problem("probes", where(owner),
                                            f"{c['name']}: {probe} asks {get.get('port')}{get.get('path')}, "
                                            f"not {path} on a declared port"))
    return problems
