"""`flywheel gate`: approvals, the traffic split, API tokens and the dashboard server.

Every change is planned, shown, and applied only after confirmation (or `--yes`); a refusal
prints the reason and exits non-zero.

Who is recorded: the HTTP API records the identity behind the bearer token. These commands
talk to the registry and Redis directly (whoever can run them holds those credentials), so
they record the local operator's name, `--by` (default: the login name), marked
"(local CLI)" in the history so it is never mistaken for a token identity, with the role
"operator". Every attempt, refused or applied, and every token issued or revoked, goes to the
audit log (`flywheel gate audit` shows it).
"""

from __future__ import annotations

import getpass
import threading
from collections.abc import Callable
from typing import Annotated, NoReturn, cast

import typer
from rich.console import Console
from rich.table import Table

from deploy_gate.audit import AuditLog
from deploy_gate.errors import NoChampion, as_gate_error
from deploy_gate.gate import DeployGate
from deploy_gate.plan import Plan
from deploy_gate.policy import AutoApprove
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


OPERATOR_ROLE = "operator"


def _plan_and_apply(
    action: str,
    version: str | None,
    reason: str,
    make_plan: Callable[[DeployGate, str], Plan],
    by: str,
    yes: bool,
) -> None:
    operator = _operator(by)
    try:
        gate = _gate()
        target = f"version {version}" if version else f"experiment {gate.experiment}"
        with gate.audit.attempt(action, who=operator, role=OPERATOR_ROLE, target=target, reason=reason) as at:
            at.before = gate.snapshot(version)
            plan = make_plan(gate, operator)
            if plan.version:  # promote and roll back act on the challenger: name it, as `apply` does
                at.target = f"version {plan.version}"
            console.print(f"[bold]Plan: {plan.action} {plan.version or ''}[/] by {plan.by}: {plan.reason}")
            for i, step in enumerate(plan.describe(), 1):
                console.print(f"  {i}. {step}")
            # Declining is not an attempt to record: nothing was asked of the gate.
            confirmed = yes or typer.confirm("Apply this plan?", default=False)
            split = gate.apply(plan, role=OPERATOR_ROLE) if confirmed else None
    except Exception as exc:
        _refuse(exc)
    if not confirmed:
        console.print("Nothing changed.")
        raise typer.Exit(1)
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
    _plan_and_apply("approve", version, reason, lambda g, who: g.plan_approve(version, by=who, reason=reason), by, yes)


@app.command()
def reject(version: str, reason: Reason, by: By = "", yes: Yes = False) -> None:
    """Reject a pending candidate."""
    _plan_and_apply("reject", version, reason, lambda g, who: g.plan_reject(version, by=who, reason=reason), by, yes)


@app.command()
def promote(reason: Reason, by: By = "", yes: Yes = False) -> None:
    """Make the running challenger the champion (all traffic; its artifacts verified first)."""
    _plan_and_apply("promote", None, reason, lambda g, who: g.plan_promote(by=who, reason=reason), by, yes)


@app.command()
def rollback(reason: Reason, by: By = "", yes: Yes = False) -> None:
    """Send all traffic back to the champion and mark the challenger rolled back."""
    _plan_and_apply("rollback", None, reason, lambda g, who: g.plan_rollback(by=who, reason=reason), by, yes)


@app.command()
def check(
    version: Annotated[str | None, typer.Argument(help="The candidate to check; omit with --pending.")] = None,
    pending: Annotated[bool, typer.Option("--pending", help="Check every pending candidate not yet checked.")] = False,
) -> None:
    """Run the offline gates on a candidate against the champion and record the results on it.

    Exits 1 when a gate failed; a pending candidate that failed is marked refused (it can no longer be approved).
    """
    try:
        gate = _gate()
        offline = gate.offline
        assert offline is not None  # from_settings always wires the offline gates in
        champion = gate.status().champion
        if champion is None:
            raise NoChampion("the registry has no champion to compare with; make one the champion first")
        if pending:
            versions = [v.version for v in gate.status().pending if offline.current(v.version, champion) is None]
        elif version:
            versions = [version]
        else:
            console.print("[red]refused:[/] name a VERSION or pass --pending")
            raise typer.Exit(1)
        failed = False
        for v in versions:
            report = offline.check(v, champion)
            failed |= not report.passed
            if gate.refuse_if_failed(v, report):  # a refusal is a state: nothing tries it again
                console.print(f"version {v} is marked [red]refused[/] (flywheel registry show {v} says why)")
            table = Table("gate", "verdict", "value", "bound", "detail", title=f"version {v} vs champion {champion}")
            for r in report.results:
                colour = {"passed": "green", "failed": "red"}.get(r.status, "yellow")
                value = "-" if r.value is None else f"{r.value:.4g}"
                table.add_row(r.name, f"[{colour}]{r.status}[/]", value, r.bound, r.detail)
            console.print(table)
    except Exception as exc:
        _refuse(exc)
    if failed:
        raise typer.Exit(1)


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
    _plan_and_apply(
        "ramp", None, reason, lambda g, who: g.plan_ramp(share, by=who, reason=reason, state=state), by, yes
    )


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
    _plan_and_apply("holdout", v, reason, lambda g, who: g.plan_holdout(v, share, by=who, reason=reason), by, yes)


@app.command()
def unquarantine(version: str, reason: Reason, by: By = "", yes: Yes = False) -> None:
    """Lift a rolled-back version's quarantine: its served data may be trained on again."""
    _plan_and_apply(
        "unquarantine", version, reason, lambda g, who: g.plan_unquarantine(version, by=who, reason=reason), by, yes
    )


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


@app.command("plan")
def plan_duration(
    users_per_day: Annotated[float, typer.Option("--users-per-day", help="New users a day, all arms.", min=0.001)],
    accept_rate: Annotated[float, typer.Option("--accept-rate", help="The champion's accepts per generation.",
                                               min=0.0001, max=1.0)] = 0.3,
    per_user_sd: Annotated[float | None, typer.Option("--per-user-sd", help="Measured per-user sd of the reward; "
                                                      "default: from simulated users at the accept rate.")] = None,
) -> None:
    """How long an experiment needs at this traffic, before it starts: each ramp step's days, what the maximum
    duration resolves (margin, effect sizes) and what the decision rule risks. Configured by FLYWHEEL_ROLLOUT_*.
    Exits 1 when the ramp's minimums do not fit in the maximum duration."""
    from deploy_gate.rollout import RolloutConfig
    from deploy_gate.rollout.duration import plan

    config = RolloutConfig()
    p = plan(config, users_per_day, accept_rate, per_user_sd)
    for line in p.lines(config, accept_rate):
        console.print(line)
    if not p.reachable:
        raise typer.Exit(1)


def _store() -> TokenStore:
    return TokenStore.from_settings(get_settings())


def _audit_token(action: str, name: str, role: str, allowed: bool, detail: str) -> None:
    """Token changes are release actions too: who may approve is part of the record."""
    AuditLog.from_settings(get_settings()).record(
        who=_operator(""),
        role=OPERATOR_ROLE,
        action=action,
        allowed=allowed,
        target=f"token of {name}",
        detail=detail,
        after={"name": name, "role": role} if allowed else None,
    )


@tokens.command("issue")
def issue_token(
    name: Annotated[str, typer.Option("--name", help="Who holds the token (recorded on every change).")],
    role: Annotated[str, typer.Option("--role", help=f"One of {', '.join(ROLES)}.")] = "approver",
) -> None:
    """Issue a new random token for NAME and print it once; only its sha256 is stored."""
    if role not in ROLES:
        why = f"unknown role {role!r}; use one of {', '.join(ROLES)}"
        _audit_token("issue token", name, role, False, f"refused: {why}")
        console.print(f"[red]refused:[/] {why}")
        raise typer.Exit(1)
    try:
        token = _store().issue(name, cast(Role, role))
    except IdentityError as exc:
        _audit_token("issue token", name, role, False, f"refused: {exc}")
        console.print(f"[red]refused:[/] {exc}")
        raise typer.Exit(1) from None
    _audit_token("issue token", name, role, True, f"issued a {role} token")
    console.print(f"Token for {name} ({role}); shown only now, store it in a secret manager:")
    typer.echo(token)


@tokens.command("revoke")
def revoke_token(name: Annotated[str, typer.Argument(help="Whose active token to revoke.")]) -> None:
    """Revoke NAME's active token: it is refused (401) from now on."""
    try:
        _store().revoke(name)
    except IdentityError as exc:
        _audit_token("revoke token", name, "", False, f"refused: {exc}")
        console.print(f"[red]refused:[/] {exc}")
        raise typer.Exit(1) from None
    _audit_token("revoke token", name, "revoked", True, "revoked; the token is refused (401) from now on")
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
def audit(
    limit: Annotated[int, typer.Option(min=1, max=10000, help="How many entries, newest first.")] = 30,
) -> None:
    """The audit log: every release action, allowed or refused (who, role, when, what, why)."""
    try:
        entries = AuditLog.from_settings(get_settings()).entries(limit)
    except Exception as exc:
        _refuse(exc)
    # One line per entry, not a table: reasons and details are long, and lines stay greppable.
    for e in entries:
        outcome = "allowed" if e.allowed else "[red]refused[/]"
        console.print(
            f"{e.at:%Y-%m-%d %H:%M:%S} {outcome} {e.action} {e.target} by {e.who} ({e.role}): "
            f"{e.reason or '-'} [dim]| {e.detail}[/]",
            markup=True,
            highlight=False,
        )


@app.command("auto-approve")
def auto_approve() -> None:
    """Run the auto-approve policy once (only when FLYWHEEL_AUTO_APPROVE is on; the gate runs it every 5 s)."""
    try:
        gate = _gate()
        if not gate.settings.auto_approve:
            console.print("The auto-approve policy is off (FLYWHEEL_AUTO_APPROVE=false); nothing done.")
            return
        version = AutoApprove(gate).tick()
    except Exception as exc:
        _refuse(exc)
    console.print(f"auto-approved {version}." if version else "No candidate to approve now.")


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
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info", log_config=None, proxy_headers=False,
                timeout_keep_alive=settings.http_keep_alive_s)
