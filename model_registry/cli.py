"""`flywheel registry`: list versions (lineage, artifact kind, chain length), show one (lineage, gate history,
manifest), diff two (which tensors changed, by how much), verify one end to end."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from flywheel.settings import get_settings
from model_registry.manifest import ArtifactIntegrityError
from model_registry.registry import ModelRegistry, UnknownVersion

app = typer.Typer(no_args_is_help=True)
console = Console()


# The columns `flywheel registry list` shows, in order, and the ones a terminal under `WIDE` columns leaves out
# (so an 80-column terminal reads whole headers and whole version names, not "vers…"; `--wide` shows them all).
LIST_COLUMNS = ("version", "created", "gate state", "aliases", "parent", "artifact", "chain", "stored", "samples",
                "mean reward", "why")  # fmt: skip
NARROW_LEAVES_OUT = frozenset({"created", "chain", "stored", "samples", "mean reward"})
WIDE = 140


@app.command("list")
def list_versions(
    limit: int = typer.Option(20, help="How many versions, newest first."),
    wide: bool = typer.Option(False, "--wide", help="Every column, whatever the terminal's width."),
) -> None:
    """Model versions, newest first: gate state and why (a refusal names its offline gates), aliases, parent,
    artifact (full or delta, chain length, size). Under 140 columns the creation time, chain, size, samples and
    mean reward are left out (`--wide` keeps them)."""
    registry = ModelRegistry(get_settings())
    columns = [c for c in LIST_COLUMNS if wide or console.width >= WIDE or c not in NARROW_LEAVES_OUT]
    table = Table(expand=False)
    for name in columns:  # a header and a version name are never cut; the reason wraps
        table.add_column(name, no_wrap=name != "why", min_width=len(name), overflow="fold")
    for info in registry.versions()[:limit]:
        reward = info.lineage.metrics.get("mean_reward")
        try:
            art = registry.artifact(info.version)
            kind, chain = art.kind, str(art.chain_length)
            stored = f"{_size(art.stored_bytes)} ({art.checkpoint_bytes / max(art.stored_bytes, 1):.0f}x)"
        except ArtifactIntegrityError:
            kind, chain, stored = "[red]unreadable[/]", "-", "-"
        cells = {
            "version": info.version,
            "created": info.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            "gate state": info.gate_state,
            "aliases": ", ".join(info.aliases),
            "parent": info.lineage.parent_version or "-",
            "artifact": kind,
            "chain": chain,
            "stored": stored,
            "samples": str(info.lineage.sample_count),
            "mean reward": "-" if reward is None else f"{reward:.3f}",
            "why": _why(info.reason),
        }
        table.add_row(*(cells[c] for c in columns))
    if wide:  # past the terminal's edge (a pager or a file reads it whole) rather than squeezed
        console.print(table, width=max(console.width, 2 * WIDE), crop=False)
    else:
        console.print(table)


def _why(reason: str, chars: int = 160) -> str:
    """The latest gate-state reason, cut for a table cell (`flywheel registry show` has it whole)."""
    return reason if len(reason) <= chars else reason[: chars - 3] + "..."


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.1f} GiB"


@app.command("show")
def show(
    version: str = typer.Argument(..., help="The version number."),
    manifest: bool = typer.Option(False, "--manifest", help="Print the manifest (every file, tensor) as JSON."),
) -> None:
    """One version: lineage (parent, data window, config, metrics), artifact, gate-state history."""
    registry = ModelRegistry(get_settings())
    try:
        lineage = registry.lineage(version)
        history = registry.gate_history(version)
        doc = registry.manifest(version)
        art = registry.artifact(version)
    except (UnknownVersion, ArtifactIntegrityError) as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    if manifest:
        console.print_json(json.dumps(doc))
        return
    against = {"delta": f" against v{art.parent}, chain length {art.chain_length}",
               "adapter": f" (LoRA) on base v{art.parent}"}.get(art.kind, "")  # fmt: skip
    tensors = sum(len(t) for t in doc.get("tensors", {}).values())
    console.print(f"artifact: [bold]{art.kind}[/]{against}; stores {_size(art.stored_bytes)} for a "
                  f"{_size(art.checkpoint_bytes)} checkpoint; {len(doc['files'])} files, {tensors} tensors hashed")
    console.print(f"[bold]version {version}[/]  gate state: [bold]{registry.gate_state(version)}[/]")
    console.print_json(json.dumps(lineage.model_dump(mode="json")))
    table = Table("when", "state", "from", "by", "why")
    for change in history:
        table.add_row(
            change.at.strftime("%Y-%m-%d %H:%M:%S"),
            change.state,
            change.previous or "-",
            change.by,
            change.reason,
        )
    console.print(table)


@app.command("diff")
def diff(
    a: str = typer.Argument(..., help="The version to compare from."),
    b: str = typer.Argument(..., help="The version to compare to."),
    all_tensors: bool = typer.Option(False, "--all", help="List unchanged tensors too."),
) -> None:
    """Which tensors changed from version A to B, and by how much (share of values whose bits changed,
    largest absolute change, relative L2 norm of the change)."""
    registry = ModelRegistry(get_settings())
    try:
        rows = registry.diff(a, b)
    except (UnknownVersion, ArtifactIntegrityError) as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    table = Table("tensor", "status", "elements", "changed", "max |change|", "relative L2")
    for row in rows:
        if row.status == "same" and not all_tensors:
            continue
        table.add_row(row.name, row.status, f"{row.elements:,}", f"{row.changed_share:.2%}",
                      f"{row.max_abs:.3g}", f"{row.rel_l2:.3g}")  # fmt: skip
    console.print(table)
    changed = sum(r.changed for r in rows)
    total = sum(r.elements for r in rows)
    n_changed = sum(r.status != "same" for r in rows)
    console.print(f"{n_changed} of {len(rows)} tensors differ; {changed:,} of {total:,} values "
                  f"({changed / max(total, 1):.2%})")


@app.command("verify")
def verify(version: str = typer.Argument(..., help="The version number.")) -> None:
    """Download the version's artifacts, rebuild it along its delta chain, and check every stored file,
    rebuilt file and tensor against its manifest. Exit 1 with the reason when anything differs."""
    registry = ModelRegistry(get_settings())
    try:
        registry.verify(version)
        art = registry.artifact(version)
    except (UnknownVersion, ArtifactIntegrityError) as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    chain = {"delta": f" (a delta, {art.chain_length} links from a full snapshot)",
             "adapter": f" (a LoRA adapter on base v{art.parent}, whose hash it matches)"}.get(art.kind, " (full)")
    console.print(f"[green]version {version} verified[/]{chain}: every file and tensor matches its manifest")
