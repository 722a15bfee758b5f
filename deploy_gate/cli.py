"""`flywheel gate`: approvals, the traffic split, API tokens and the dashboard server.

Every change is planned, shown, and applied only after confirmation (or `--yes`); a refusal
prints the reason and exits non-zero.

Who is recorded: the HTTP API records the identity behind the bearer token. These commands
talk to the registry and Redis directly (whoever can run them holds those credentials), so
they record the local operator's name, `--by` (default: the login name), marked
"(local CLI)" in the history so it is never mistaken for a token identity.
"""

from __future__ import annotations

import getpass
import threading
from collections.abc import Callable
from typing import Annotated, NoReturn, cast

import typer
from rich.console import Console
from rich.table import Table

from deploy_gate.errors import as_gate_error
from deploy_gate.gate import DeployGate
from deploy_gate.plan import Plan
from flywheel.identity import ROLES, IdentityError, Role, TokenStore
from flywheel.settings import get_settings

app = typer.Typer(no_args_is_help=True)
tokens = typer.Typer(no_args_is_help=True, help="API tokens: issue, revoke, list (only hashes are stored).")
app.add_typer(tokens, name="tokens")
console = Console(soft_wrap=True)  # long reasons and plans stay on one line, also in pipes


def _login() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name in this environment (some containers)
        return ""


By = Annotated[
    str,
    typer.Option(
        "--by",
        help="Your name, recorded as '<name> (local CLI)'; default: your login name. "
        "(Over HTTP the token's identity is recorded instead.)",
    ),
]
Reason = Annotated[str, typer.Option("--reason", help="Why (kept in the history).")]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Apply without asking.")]


def _gate() -> DeployGate:
    return DeployGate.from_settings(get_settings())


def _operator(by: str) -> str:
    name = (by or _login()).strip()
    if not name:
        console.print("[red]refused:[/] say who you are: --by NAME")
        raise typer.Exit(1)
    return f"{name} (local CLI)"


def _plan_and_apply(make_plan: Callable[[DeployGate, str], Plan], by: str, yes: bool) -> None:
    operator = _operator(by)
    try:
        gate = _gate()
        plan = make_plan(gate, operator)
        console.print(f"[bold]Plan: {plan.action} {plan.version or ''}[/] by {plan.by}: {plan.reason}")
        for i, step in enumerate(plan.describe(), 1):
            console.print(f"  {i}. {step}")
        if not yes and not typer.confirm("Apply this plan?", default=False):
            console.print("Nothing changed.")
            raise typer.Exit(1)
        split = gate.apply(plan)
    except Exception as exc:
        _refuse(exc)
    console.print(f"[green]applied.[/] split: {split.model_dump_json() if split else 'none'}")


@app.command()
def status() -> None:
    """The split, the champion and challenger, and candidates waiting for approval."""
    try:
        st = _gate().status()
    except Exception as exc:
        _refuse(exc)
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


def _refuse(exc: Exception) -> NoReturn:
    """Print why and exit 1 for a gate refusal; re-raise anything else (a bug)."""
    err = as_gate_error(exc)
    if err is None:
        raise exc
    console.print(f"[red]refused:[/] {err}")
    raise typer.Exit(1) from None


@app.command()
def approve(version: str, reason: Reason, by: By = "", yes: Yes = False) -> None:
    """Approve a pending candidate (its artifacts verified first): it becomes the challenger."""
    _plan_and_apply(lambda g, who: g.plan_approve(version, by=who, reason=reason), by, yes)


@app.command()
def reject(version: str, reason: Reason, by: By = "", yes: Yes = False) -> None:
    """Reject a pending candidate."""
    _plan_and_apply(lambda g, who: g.plan_reject(version, by=who, reason=reason), by, yes)


@app.command()
def promote(reason: Reason, by: By = "", yes: Yes = False) -> None:
    """Make the running challenger the champion (all traffic; its artifacts verified first)."""
    _plan_and_apply(lambda g, who: g.plan_promote(by=who, reason=reason), by, yes)


@app.command()
def rollback(reason: Reason, by: By = "", yes: Yes = False) -> None:
    """Send all traffic back to the champion and mark the challenger rolled back."""
    _plan_and_apply(lambda g, who: g.plan_rollback(by=who, reason=reason), by, yes)


@app.command()
def ramp(
    share: Annotated[float, typer.Argument(help="The challenger's new share of users, e.g. 0.25.")],
    reason: Reason,
    freeze: Annotated[bool, typer.Option("--freeze", help="Freeze the ramp at this share.")] = False,
    by: By = "",
    yes: Yes = False,
) -> None:
    """Set the live challenger's share by hand, freeze the ramp, or resume a frozen one."""
    state = "paused" if freeze else "running"
    _plan_and_apply(lambda g, who: g.plan_ramp(share, by=who, reason=reason, state=state), by, yes)


@app.command()
def holdout(
    version: Annotated[str, typer.Argument(help="The version held-out users stay on; 'none' ends the holdout.")],
    reason: Reason,
    share: Annotated[float, typer.Option(help="Share of users held out (at most 0.5).")] = 0.02,
    by: By = "",
    yes: Yes = False,
) -> None:
    """Keep a share of users on a fixed version across releases (the long-term holdout)."""
    v = None if version.lower() == "none" else version
    _plan_and_apply(lambda g, who: g.plan_holdout(v, share, by=who, reason=reason), by, yes)


@app.command()
def unquarantine(version: str, reason: Reason, by: By = "", yes: Yes = False) -> None:
    """Lift a rolled-back version's quarantine: its served data may be trained on again."""
    _plan_and_apply(lambda g, who: g.plan_unquarantine(version, by=who, reason=reason), by, yes)


@app.command()
def experiment() -> None:
    """The rollout: state, ramp, the last analysis and decision (as JSON, as `GET /api/experiment`)."""
    from deploy_gate.rollout import RolloutController

    try:
        view = RolloutController(_gate()).view()
    except Exception as exc:
        _refuse(exc)
    console.print_json(view.model_dump_json())


@app.command()
def rollout(
    once: Annotated[bool, typer.Option("--once", help="Look once, print the experiment and exit.")] = False,
) -> None:
    """Run the rollout controller: ramp, analyse per user, freeze on SRM, roll back or promote by itself.

    Configured by FLYWHEEL_ROLLOUT_* (ramp, alpha, guardrail bounds, holdout_share, metrics_port).
    """
    from deploy_gate.rollout import RolloutController
    from flywheel.ops import freeze_startup, stop_on_signals

    controller = RolloutController(_gate())
    if once:
        rec = controller.tick()
        console.print_json(rec.model_dump_json())
        return
    stop = threading.Event()
    stop_on_signals(stop)
    freeze_startup()
    controller.run(stop)


def _store() -> TokenStore:
    return TokenStore.from_settings(get_settings())


@tokens.command("issue")
def issue_token(
    name: Annotated[str, typer.Option("--name", help="Who holds the token (recorded on every change).")],
    role: Annotated[str, typer.Option("--role", help=f"One of {', '.join(ROLES)}.")] = "approver",
) -> None:
    """Issue a new random token for NAME and print it once; only its sha256 is stored."""
    if role not in ROLES:
        console.print(f"[red]refused:[/] unknown role {role!r}; use one of {', '.join(ROLES)}")
        raise typer.Exit(1)
    try:
        token = _store().issue(name, cast(Role, role))
    except IdentityError as exc:
        console.print(f"[red]refused:[/] {exc}")
        raise typer.Exit(1) from None
    console.print(f"Token for {name} ({role}); shown only now, store it in a secret manager:")
    typer.echo(token)


@tokens.command("revoke")
def revoke_token(name: Annotated[str, typer.Argument(help="Whose active token to revoke.")]) -> None:
    """Revoke NAME's active token: it is refused (401) from now on."""
    try:
        _store().revoke(name)
    except IdentityError as exc:
        console.print(f"[red]refused:[/] {exc}")
        raise typer.Exit(1) from None
    console.print(f"Revoked the token of {name}.")


@tokens.command("list")
def list_tokens() -> None:
    """Every issued token: name, role, created, revoked (never the token or its hash)."""
    table = Table("name", "role", "created", "revoked")
    for t in _store().list():
        table.add_row(
            t.name,
            t.role,
            f"{t.created_at:%Y-%m-%d %H:%M:%S}",
            f"{t.revoked_at:%Y-%m-%d %H:%M:%S}" if t.revoked_at else "-",
        )
    console.print(table)


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
