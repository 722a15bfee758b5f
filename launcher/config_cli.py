"""`flywheel config`: every setting's effective value and where it came from, and a check that starts nothing.

The five configuration objects are the ones the reference documents (`launcher/settings_reference.py`), all
read from the environment; `TrainerConfig` and `OfflineGateConfig` also from a JSON file of their fields
(`--trainer-config`, `--offline-config`, as `flywheel trainer schedule --config` takes it), which wins over the
environment.

- `show [--component NAME] [--demo]`: one line per setting: its variable, the value in force and its source:
  `file <path>`, `environment`, `demo` (with `--demo`: what `flywheel up` sets, `launcher.demo.DEMO`, where the
  environment does not) or `default`. Secrets show as pydantic masks them, and a password in a URL as
  `***`: what an operator pastes into a ticket must not leak one.
- `check`: builds each object as its process does, so every check a process makes at start runs here (bounds,
  unknown variables, secrets in production, the objects' cross-field checks), and exits 1 naming the first bad
  setting and why; 0 when all hold. Nothing is started or connected to.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError

from launcher.settings_reference import fields, owners

app = typer.Typer(help="Every setting's effective value and source; a check that starts nothing.", no_args_is_help=True)

COMPONENTS = {
    "settings": "Settings",
    "signals": "SignalsConfig",
    "rollout": "RolloutConfig",
    "trainer": "TrainerConfig",
    "offline": "OfflineGateConfig",
}
_URL_PASSWORD = re.compile(r"(\w[\w+.-]*://[^:/@\s]*:)[^@\s]+@")


@dataclass(frozen=True)
class Setting:
    owner: str
    name: str  # the variable (a file's key sets the same field)
    value: str
    source: str


class BadSetting(Exception):
    """The first bad setting of a configuration object: which one, and why."""

    def __init__(self, owner: str, setting: str, why: str) -> None:
        super().__init__(f"{owner}: {setting}: {why}")
        self.owner, self.setting, self.why = owner, setting, why


def _masked(value: Any) -> str:
    text = (value or '""') if isinstance(value, str) else json.dumps(value, default=str)
    return _URL_PASSWORD.sub(r"\1***@", text)


def _environment() -> dict[str, str]:
    return {k.upper(): v for k, v in os.environ.items()}  # pydantic-settings reads variables case-insensitively


def _variables(owner: str) -> dict[str, tuple[str, ...]]:
    return {f.name: f.variables for f in fields() if f.owner == owner}


def _first_error(owner: str, exc: ValidationError, variables: dict[str, tuple[str, ...]],
                 given: Collection[str] = ()) -> BadSetting:  # fmt: skip
    """The first error of `exc`, named by the key of the file (`given`) or the variable that set it."""
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else ""
    env = _environment()
    names = variables.get(field, ())
    name = field if field in given else next((v for v in names if v in env), names[0] if names else field)
    why = str(err["msg"]).removeprefix("Value error, ")
    inner = ".".join(str(part) for part in err["loc"][1:])  # where inside a structured value (the ramp's steps)
    # A model-level check names no field; its message does (RolloutConfig's unknown variables, the secrets).
    return BadSetting(owner, name or "(the object as a whole)", f"{inner}: {why}" if inner else why)


def _file_values(owner: str, path: Path | None) -> dict[str, Any]:
    """The fields a JSON file gives `owner` ({} without a file)."""
    if path is None:
        return {}
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadSetting(owner, str(path), f"not a readable JSON object ({exc})") from exc
    if not isinstance(values, dict):
        raise BadSetting(owner, str(path), "not a JSON object")
    return values


def _demo_values(owner: str, files: dict[str, Path | None], demo: bool) -> dict[str, Any]:
    """What `flywheel up` sets on `owner` where the environment does not (a trainer file replaces the demo's).
    The embedded stack's own settings (ports, data dir) and `--train-interval` are `flywheel up`'s flags, not
    shown here."""
    if not demo or files.get(owner) is not None:
        return {}
    from launcher.demo import DEMO  # the objects' modules load only when a command needs them

    return DEMO.of(owner, _environment())


def build(owner: str, files: dict[str, Path | None], demo: bool = False) -> Any:
    """The object `owner` as its process builds it (as `flywheel up` starts it, with `demo`); `BadSetting` names
    the first bad setting."""
    cls = next(c for c, _ in owners() if c.__name__ == owner)
    values = _file_values(owner, files.get(owner))
    unknown = sorted(set(values) - set(cls.model_fields))
    if unknown:
        raise BadSetting(owner, unknown[0], f"not a field of {owner} (in {files.get(owner)}); known: "
                         f"{', '.join(cls.model_fields)}")  # fmt: skip
    try:
        return cls(**{**_demo_values(owner, files, demo), **values})
    except ValidationError as exc:
        raise _first_error(owner, exc, _variables(owner), set(values)) from exc


def settings_of(owner: str, files: dict[str, Path | None], demo: bool = False) -> list[Setting]:
    """Every setting of `owner`: its effective value and its source."""
    obj = build(owner, files, demo)
    path = files.get(owner)
    in_file = set(_file_values(owner, path))
    in_demo = set(_demo_values(owner, files, demo))
    env = _environment()
    values = obj.model_dump(mode="json")  # secrets come out masked
    out = []
    for name, variables in _variables(owner).items():
        given = next((v for v in variables if v in env), None)  # the alias read, where a field has several
        shown = given or (variables[0] if variables else name)
        source = (f"file {path}" if name in in_file else "environment" if given else "demo" if name in in_demo
                  else "default")  # fmt: skip
        out.append(Setting(owner, shown, _masked(values[name]), source))
    return out


def _owners(component: str | None) -> list[str]:
    if component is None:
        return [c.__name__ for c, _ in owners()]
    key = component.lower()
    by_class = {v.lower(): v for v in COMPONENTS.values()}
    if key in COMPONENTS:
        return [COMPONENTS[key]]
    if key in by_class:
        return [by_class[key]]
    raise typer.BadParameter(f"{component!r}: one of {', '.join(COMPONENTS)}", param_hint="--component")


ComponentOpt = typer.Option(None, "--component", "-c", help=f"Only this one: {', '.join(COMPONENTS)}.")
TrainerOpt = typer.Option(None, "--trainer-config", help="The trainer's JSON file, as `flywheel trainer schedule` "
                          "takes it (default: TrainerConfig's defaults).", dir_okay=False)  # fmt: skip
DemoOpt = typer.Option(False, "--demo", help="As `flywheel up` runs: the demo's overrides (launcher/demo.py) "
                       "where the environment does not set them.")  # fmt: skip
OfflineOpt = typer.Option(None, "--offline-config", help="A JSON file of OfflineGateConfig fields (default: "
                          "its defaults).", dir_okay=False)  # fmt: skip


@app.command("show")
def show(component: str | None = ComponentOpt, trainer_config: Path | None = TrainerOpt,
         offline_config: Path | None = OfflineOpt, demo: bool = DemoOpt) -> None:  # fmt: skip
    """Every setting's effective value and where it came from (file, environment, demo or default)."""
    files = {"TrainerConfig": trainer_config, "OfflineGateConfig": offline_config}
    bad = None
    for owner in _owners(component):
        typer.echo(f"{owner}:")
        try:
            rows = settings_of(owner, files, demo)
        except BadSetting as exc:
            typer.echo(f"  not valid: {exc.setting}: {exc.why} (flywheel config check)")
            bad = bad or exc
            continue
        width = max(len(r.name) for r in rows)
        for r in rows:
            typer.echo(f"  {r.name:<{width}}  {r.value}  [{r.source}]")
    if bad is not None:
        raise typer.Exit(1)


@app.command("check")
def check(component: str | None = ComponentOpt, trainer_config: Path | None = TrainerOpt,
          offline_config: Path | None = OfflineOpt, demo: bool = DemoOpt) -> None:  # fmt: skip
    """Validate the configuration without starting anything; exit 1 naming the first bad setting."""
    files = {"TrainerConfig": trainer_config, "OfflineGateConfig": offline_config}
    checked = _owners(component)
    for owner in checked:
        try:
            build(owner, files, demo)
        except BadSetting as exc:
            typer.echo(f"bad setting {exc.setting} ({exc.owner}): {exc.why}", err=True)
            raise typer.Exit(1) from exc
    typer.echo(f"ok: {', '.join(checked)}")
