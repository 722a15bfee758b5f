"""The front door holds: every link in the README and the pages it links to resolves (file and heading),
and every `flywheel` command the README names exists with the options it shows.

A README that says `flywheel gate plan --users` or links `docs/releasing.md#offline-gates` after a rename
sends a newcomer nowhere; this fails instead. Commands are resolved in the `flywheel` command's own tree
(no process is started), so the check costs a second.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
         ROOT / "CONTRIBUTING.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(_anchor(line.lstrip("#")))
    return out


def _links(page: Path) -> list[str]:
    return [m for m in LINK.findall(page.read_text()) if not m.startswith(("http://", "https://", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page: Path) -> None:
    broken = []
    for link in _links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading with that anchor in {target.relative_to(ROOT)}")
    assert not broken, broken


def _flywheel_commands(text: str) -> list[list[str]]:
    """The `flywheel ...` invocations in code spans and blocks, as argument lists after `flywheel`."""
    found: list[list[str]] = []
    lines = list(CODE_SPAN.findall(text))
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            lines.append(line.rstrip("\\ "))
    for line in lines:
        for part in re.split(r"&&|;|\|", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:  # an unbalanced quote or a trailing backslash: a plain split names the command
                words = part.split()
            for i, w in enumerate(words):
                if w.endswith("bin/flywheel") or w == "flywheel":
                    found.append(words[i + 1 :])
                elif w in ("scripts/up.sh",):
                    found.append(["up", *words[i + 1 :]])
    return found


def _resolve(root: Any, args: list[str]) -> str | None:
    """None when `args` name an existing command with existing options; otherwise what is wrong."""
    cmd, path = root, ["flywheel"]
    for arg in args:
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            options = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
            if name not in options:
                return f"{' '.join(path)} has no option {name}"
            continue
        commands = getattr(cmd, "commands", None)  # a group (typer may bring its own click)
        if commands is not None:
            if arg.isupper() or not re.fullmatch(r"[a-z][a-z0-9-]*", arg):
                return None  # a placeholder (VERSION, NAME, ...) where a sub-command goes
            sub = commands.get(arg)
            if sub is None:
                return f"{' '.join(path)} has no command {arg}"
            cmd, path = sub, [*path, arg]
        # an argument or an option's value: nothing to resolve
    return None


def test_every_command_in_the_readme_exists() -> None:
    from launcher.cli import app

    root = typer.main.get_command(app)
    commands = _flywheel_commands((ROOT / "README.md").read_text())
    assert len(commands) >= 3, "the README names the flywheel commands a newcomer runs"
    problems = [p for args in commands if (p := _resolve(root, args))]
    assert not problems, problems
    for script in re.findall(r"bash (scripts/[\w.]+)", (ROOT / "README.md").read_text()):
        assert (ROOT / script).exists(), script


def test_the_check_catches_a_wrong_command() -> None:
    from launcher.cli import app

    root = typer.main.get_command(app)
    assert _resolve(root, ["gate", "no-such-command"]) == "flywheel gate has no command no-such-command"
    assert _resolve(root, ["up", "--no-such-option"]) == "flywheel up has no option --no-such-option"
    assert _resolve(root, ["registry", "list"]) is None
