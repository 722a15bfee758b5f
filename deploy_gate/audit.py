"""The gate's audit log: every release action, allowed or refused, in one append-only table.

One entry per attempt: who (the token's identity, "<name> (local CLI)", "auto-approve policy",
"anonymous"...), their role, when, what (action and target), why (the reason they gave),
whether it was allowed, and the state before and after (gate state of the version, the
traffic split). Refusals are recorded as faithfully as approvals: a viewer or a revoked token
trying to approve is exactly what an auditor wants to see.

Why a SQL table in the token store's database (`flywheel.identity.store_url`) rather than a
JSONL file: the gate may run as several replicas and the CLI on another machine; a file is
local to one of them, a database is shared, and it already holds the identities the entries
name. A committed insert is durable (SQLite syncs its journal on commit; PostgreSQL its WAL),
so entries survive restarts. Append-only is enforced twice: this module only ever inserts
(there is no update or delete method), and on SQLite triggers abort any UPDATE or DELETE of
the table; on PostgreSQL grant the gate INSERT and SELECT only.

What must hold: an entry is written before the caller hears the outcome (a crash after the
answer cannot lose it); a token's value never appears in an entry; text is stored as given
and escaped only where it is shown (the dashboard's templates and DOM text nodes).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import DDL, Boolean, DateTime, Engine, String, Text, event, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from deploy_gate.errors import as_gate_error
from flywheel.identity import open_store, store_url
from flywheel.settings import Settings

POLICY_ACTOR = "auto-approve policy"
# Set on an exception whose refusal is already in the log, so an outer `attempt` does not add it twice.
_AUDITED = "_flywheel_audited"


class _Base(DeclarativeBase):
    pass


class AuditRow(_Base):
    __tablename__ = "flywheel_audit"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    who: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(32))
    action: Mapped[str] = mapped_column(String(64))
    allowed: Mapped[bool] = mapped_column(Boolean)
    target: Mapped[str] = mapped_column(String(200))
    reason: Mapped[str] = mapped_column(Text)
    detail: Mapped[str] = mapped_column(Text)
    before: Mapped[str | None] = mapped_column(Text)  # JSON
    after: Mapped[str | None] = mapped_column(Text)  # JSON


for _verb in ("UPDATE", "DELETE"):
    event.listen(
        AuditRow.__table__,
        "after_create",
        DDL(
            f"CREATE TRIGGER flywheel_audit_no_{_verb.lower()} BEFORE {_verb} ON flywheel_audit "
            "BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END"
        ).execute_if(dialect="sqlite"),
    )


class AuditEntry(BaseModel):
    """One entry as the API answers it (`GET /api/audit`)."""

    model_config = ConfigDict(extra="forbid")

    at: datetime
    who: str
    role: str
    action: str
    allowed: bool
    reason: str
    target: str
    detail: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


class AuditPage(BaseModel):
    entries: list[AuditEntry]


class AuditLog:
    """Insert and read audit entries; the table is made on first use."""

    def __init__(self, url: str) -> None:
        self._url = url

    @classmethod
    def from_settings(cls, settings: Settings) -> AuditLog:
        return cls(store_url(settings))

    @cached_property
    def _engine(self) -> Engine:
        return open_store(self._url, _Base.metadata)

    def record(
        self,
        *,
        who: str,
        role: str,
        action: str,
        allowed: bool,
        target: str = "",
        reason: str = "",
        detail: str = "",
        before: dict[str, Any] | None = None,
        after: dict[str, Any] | None = None,
    ) -> AuditEntry:
        entry = AuditEntry(
            at=datetime.now(UTC),
            who=who,
            role=role,
            action=action,
            allowed=allowed,
            reason=reason,
            target=target,
            detail=detail,
            before=before,
            after=after,
        )
        row = AuditRow(
            **entry.model_dump(exclude={"before", "after"}),
            before=_json(before),
            after=_json(after),
        )
        with Session(self._engine) as session, session.begin():
            session.add(row)
        return entry

    def entries(self, limit: int = 100, *, target: str | None = None) -> list[AuditEntry]:
        """The newest `limit` entries, newest first; only those about `target` when given."""
        query = select(AuditRow).order_by(AuditRow.id.desc()).limit(limit)
        if target is not None:
            query = query.where(AuditRow.target == target)
        with Session(self._engine) as session:
            return [_entry(r) for r in session.scalars(query)]

    def check(self) -> None:
        """Raise when the log cannot be written to (before an action that must be recorded)."""
        with self._engine.connect():
            pass

    @contextmanager
    def attempt(self, action: str, *, who: str, role: str, target: str, reason: str) -> Iterator[Attempt]:
        """Record the attempt's refusal if the block raises (the block records its own success).

        The block may learn who the caller is part-way (after authentication) and update
        `attempt.who`/`role`, and fill `attempt.before` once the state could be read.
        """
        attempt = Attempt(action, who, role, target, reason)
        try:
            yield attempt
        except Exception as exc:
            if not getattr(exc, _AUDITED, False):
                self.refused(attempt, exc)
            raise

    def refused(self, attempt: Attempt, exc: BaseException) -> None:
        """Record `exc` as the refusal of `attempt` and mark it recorded."""
        err = as_gate_error(exc)
        self.record(
            who=attempt.who,
            role=attempt.role,
            action=attempt.action,
            allowed=False,
            target=attempt.target,
            reason=attempt.reason,
            # An unknown error's text may hold a path or URL: only its type is kept.
            detail=f"refused ({err.code}): {err}" if err else f"failed: internal error ({type(exc).__name__})",
            before=attempt.before,
        )
        # An exception type with __slots__ refuses the mark; at worst its refusal is recorded twice.
        with suppress(AttributeError):
            setattr(exc, _AUDITED, True)

    def allowed(self, attempt: Attempt, *, detail: str, after: dict[str, Any] | None) -> None:
        self.record(
            who=attempt.who,
            role=attempt.role,
            action=attempt.action,
            allowed=True,
            target=attempt.target,
            reason=attempt.reason,
            detail=detail,
            before=attempt.before,
            after=after,
        )


@dataclass
class Attempt:
    """An action being tried: what an entry will say about it, filled in as it is learned."""

    action: str
    who: str
    role: str
    target: str
    reason: str
    before: dict[str, Any] | None = field(default=None)


def _json(value: dict[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, default=str)


def _entry(row: AuditRow) -> AuditEntry:
    at = row.at if row.at.tzinfo else row.at.replace(tzinfo=UTC)  # SQLite drops the zone
    return AuditEntry(
        at=at,
        who=row.who,
        role=row.role,
        action=row.action,
        allowed=row.allowed,
        reason=row.reason,
        target=row.target,
        detail=row.detail,
        before=json.loads(row.before) if row.before else None,
        after=json.loads(row.after) if row.after else None,
    )
