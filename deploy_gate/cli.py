"""`flywheel gate`: approvals, the traffic split and the dashboard server.

Every change is planned, shown, and applied only after confirmation (or `--yes`); a refusal
prints the reason and exits non-zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from deploy_gate.errors import GateError
from deploy_gate.gate import DeployGate
from deploy_gate.plan import Plan
from flywheel.settings import get_settings

app = typer.Typer(no_args_is_help=True)
console = Console(soft_wrap=True)  # long reasons and plans stay on one line, also in pipes

By = Annotated[str, typer.Option("--by", help="Who makes the change (kept in the history).")]
Reason = Annotated[str, typer.Option("--reason", help="Why (kept in the history).")]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Apply without asking.")]


def _gate() -> DeployGate:
    return DeployGate.from_settings(get_settings())


def _plan_and_apply(make_plan: Callable[[DeployGate], Plan], yes: bool) -> None:
    try:
        gate = _gate()
        plan = make_plan(gate)
        console.print(f"[bold]Plan: {plan.action} {plan.version or ''}[/] by {plan.by}: {plan.reason}")
        for i, step in enumerate(plan.describe(), 1):
            console.print(f"  {i}. {step}")
        if not yes and not typer.confirm("Apply this plan?", default=False):
            console.print("Nothing changed.")
            raise typer.Exit(1)
        split = gate.apply(plan)
    except GateError as exc:
        console.print(f"[red]refused:[/] {exc}")
        raise typer.Exit(1) from None
    console.print(f"[green]applied.[/] split: {split.model_dump_json() if split else 'none'}")


@app.command()
def status() -> None:
    """The split, the champion and challenger, and candidates waiting for approval."""
    try:
        st = _gate().status()
    except GateError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    s = st.split
    if s is None:
        console.print("No traffic split yet (it is created with the champion on the first gate action).")
    else:
        console.print(
            f"[bold]{s.state}[/] experiment {s.experiment}: champion v{s.champion_version}, "
            f"challenger {('v' + s.challenger_version) if s.challenger_version else '-'} "
            f"at {s.challenger_share:.0%}; last change by {s.changed_by} "
            f"at {s.changed_at:%Y-%m-%d %H:%M:%S}: {s.reason}"
        )
    table = Table("version", "gate state", "aliases", "registered", "parent", "samples")
    for v in st.versions:
        table.add_row(
            v.version,
            v.gate_state,
            ", ".join(v.aliases),
            f"{v.created_at:%Y-%m-%d %H:%M}",
            v.parent_version or "-",
            str(v.sample_count),
        )
    console.print(table)
    if st.pending:
        console.print("Waiting for approval: " + ", ".join(v.version for v in st.pending))


@app.command()
def approve(version: str, by: By, reason: Reason, yes: Yes = False) -> None:
    """Approve a pending candidate: it becomes the challenger with the configured share of traffic."""
    _plan_and_apply(lambda g: g.plan_approve(version, by=by, reason=reason), yes)


@app.command()
def reject(version: str, by: By, reason: Reason, yes: Yes = False) -> None:
    """Reject a pending candidate."""
    _plan_and_apply(lambda g: g.plan_reject(version, by=by, reason=reason), yes)


@app.command()
def promote(by: By, reason: Reason, yes: Yes = False) -> None:
    """Make the running challenger the champion (all traffic)."""
    _plan_and_apply(lambda g: g.plan_promote(by=by, reason=reason), yes)


@app.command()
def rollback(by: By, reason: Reason, yes: Yes = False) -> None:
    """Send all traffic back to the champion and mark the challenger rolled back."""
    _plan_and_apply(lambda g: g.plan_rollback(by=by, reason=reason), yes)


@app.command()
def serve(
    port: Annotated[int | None, typer.Option(help="Default: settings.gate_port.")] = None,
    host: Annotated[str | None, typer.Option(help="Interface to bind; default settings.bind_host.")] = None,
) -> None:
    """Run the gate's API and dashboard (on 127.0.0.1 unless --host or FLYWHEEL_BIND_HOST says otherwise)."""
    import uvicorn

    from deploy_gate.app import create_app

    settings = get_settings()
    port = port or settings.gate_port
    host = host or settings.bind_host
    console.print(f"Dashboard: http://{host}:{port}/")
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info", log_config=None)
