"""The configuration reference, generated from the fields themselves: `docs/configuration.md`.

Every setting Flywheel reads is a typed field of one of five pydantic-settings objects, read from the
environment (a field's variable is its object's prefix plus its name in capitals, or an alias): `Settings`,
`SignalsConfig`, `RolloutConfig`, `TrainerConfig` (also from a JSON file of its fields, given with
`flywheel trainer schedule --config FILE`, over the environment) and `OfflineGateConfig`. A field's
`group` (TrainerConfig's: the base, then each objective's part) makes a section of its own. This module walks
those fields, so the reference cannot drift from the code: `tests/test_settings_reference.py` fails when a
field, a default or a variable changes and the page was not regenerated with

    .venv/bin/python -m launcher.settings_reference > docs/configuration.md

A variable read before any settings object exists would be listed in `OTHER_VARIABLES`; none is.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from pydantic import AliasChoices
from pydantic_settings import BaseSettings

# Read straight from the environment, with why no settings object holds them (none today: a variable that
# must be read before any settings object exists goes here, so it is still documented).
OTHER_VARIABLES: dict[str, str] = {}


@dataclass(frozen=True)
class Field:
    """One setting: where it lives, how it is set, its type, default, bounds and help."""

    owner: str  # the object that holds it
    name: str
    variables: tuple[str, ...]  # environment variables
    type: str
    default: str
    bounds: str
    help: str
    group: str = ""  # the part of its object it belongs to (TrainerConfig's objectives), "" where none


def _type_name(annotation: Any) -> str:
    plain = isinstance(annotation, type) and not getattr(annotation, "__args__", None)
    text = annotation.__name__ if plain else str(annotation)
    return re.sub(r"\btyping\.|\bpathlib\.|\bpydantic\.types\.|<class '|'>", "", text)


def _default_text(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"' if value else '""'
    if getattr(value, "get_secret_value", None) is not None:
        return "(a development secret)"
    if isinstance(value, PurePath):
        return str(value)
    return repr(value) if not isinstance(value, float) else f"{value:g}"


def _comments_above(cls: type) -> dict[str, str]:
    """Each field's comment block right above it in the class body: its help where it has no description."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    block: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("# "))
            continue
        m = re.match(r"    (\w+)\s*:", line)
        if m and block:
            out[m.group(1)] = " ".join(block)
        block = []
    return out


def _env_fields(cls: type[BaseSettings]) -> Iterator[Field]:
    prefix = str(cls.model_config.get("env_prefix", ""))
    comments = _comments_above(cls)
    for name, info in cls.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            variables = tuple(str(c) for c in alias.choices)
        else:
            variables = ((prefix + name).upper(),)
        bounds = ", ".join(
            f"{k} {getattr(m, k)}" for m in info.metadata for k in ("gt", "ge", "lt", "le") if hasattr(m, k)
        )
        if info.default_factory is not None:
            default = _default_text(info.default_factory())  # type: ignore[call-arg]
        else:
            default = _default_text(info.default)
        extra = info.json_schema_extra
        group = str(extra.get("group", "")) if isinstance(extra, dict) else ""
        yield Field(cls.__name__, name, variables, _type_name(info.annotation), default, bounds,
                    " ".join((info.description or comments.get(name, "")).split()), group)  # fmt: skip


def owners() -> list[tuple[type[BaseSettings], str]]:
    """Every configuration object, with how it is set."""
    from deploy_gate.offline import OfflineGateConfig
    from deploy_gate.rollout import RolloutConfig
    from flywheel.settings import Settings
    from signals.config import SignalsConfig
    from trainer.config import TrainerConfig

    return [
        (Settings, "every process, from the environment"),
        (SignalsConfig, "the signals worker, from the environment"),
        (RolloutConfig, "the rollout controller, from the environment"),
        (TrainerConfig, "the trainer, from the environment, under a JSON file of its fields (the key is the field's "
         "name): `flywheel trainer schedule --config FILE` (or `run-once`)"),
        (OfflineGateConfig, "the offline gates (in the deploy gate), from the environment"),
    ]


def fields() -> list[Field]:
    out: list[Field] = []
    for cls, _ in owners():
        out.extend(_env_fields(cls))
    return out


def variables() -> set[str]:
    """Every environment variable the reference documents."""
    return {v for f in fields() for v in f.variables} | set(OTHER_VARIABLES)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the fields by `launcher/settings_reference.py` "
        "(`.venv/bin/python -m launcher.settings_reference > docs/configuration.md`); do not edit by hand.",
        "`flywheel up` runs the demo's overrides (`launcher/demo.py`) where the environment does not set a variable;",
        "`flywheel config show --demo` shows them, each marked `demo`.",
        "",
    ]
    by_owner: dict[str, list[Field]] = {}
    for f in fields():
        by_owner.setdefault(f.owner, []).append(f)
    for cls, how in owners():
        rows = by_owner.get(cls.__name__, [])
        lines += [f"## {cls.__name__}", "", f"Read by {how}.", ""]
        groups: dict[str, str] = getattr(cls, "GROUPS", {})
        for group in dict.fromkeys(f.group for f in rows):
            if group:
                lines += [f"### {cls.__name__}: {group}", "", f"{groups.get(group, group).capitalize()}.", ""]
            lines += ["| variable | type | default | bounds | what it is |", "| --- | --- | --- | --- | --- |"]
            for f in (f for f in rows if f.group == group):
                names = " or ".join(f"`{v}`" for v in f.variables)
                lines.append(f"| {names} | `{_cell(f.type)}` | `{_cell(f.default)}` | {f.bounds} | {_cell(f.help)} |")
            lines.append("")
    if OTHER_VARIABLES:
        lines += ["## Other variables", "", "| variable | what it is |", "| --- | --- |"]
        lines += [f"| `{k}` | {v} |" for k, v in OTHER_VARIABLES.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
