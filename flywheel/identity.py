"""Who is behind a bearer token: issued tokens, their roles, and the bootstrap admin token.

The gate and the trainer API both authorise changes with `Authorization: Bearer <token>`.
A token belongs to an identity with a role (viewer < approver < admin). Issued tokens are
random, shown once, and stored only as their sha256 with the name, role and times, in a
SQLAlchemy database (`settings.token_store_url`; SQLite under data_dir by default). The
configured `FLYWHEEL_APPROVAL_TOKEN` stays valid as the bootstrap admin identity, so a fresh
install can act before any token is issued.

What must hold: a token's value is never stored, logged or put in an error; an empty,
unknown or revoked token identifies nobody; a name has at most one active token.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Literal, cast, get_args

from sqlalchemy import DateTime, Engine, MetaData, Select, String, create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from flywheel.settings import Settings

Role = Literal["viewer", "approver", "admin"]
ROLES: tuple[Role, ...] = get_args(Role)
BOOTSTRAP_NAME = "admin (FLYWHEEL_APPROVAL_TOKEN)"
TOKEN_PREFIX = "fwt_"
# Letters, digits and . _ @ -: no spaces, so no issued name can pose as the bootstrap identity
# or as a CLI operator ("ana (local CLI)").
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")


class IdentityError(Exception):
    """A token store refusal; `str(err)` is safe to show (it never holds a token)."""


class NotAuthenticated(IdentityError):
    """No token, or one that identifies nobody (unknown, revoked): HTTP 401."""


class NotAllowed(IdentityError):
    """A valid token whose role is below what the action needs: HTTP 403."""


@dataclass(frozen=True)
class Identity:
    name: str
    role: Role

    def allows(self, needed: Role) -> bool:
        return ROLES.index(self.role) >= ROLES.index(needed)


class _Base(DeclarativeBase):
    pass


class IssuedToken(_Base):
    __tablename__ = "flywheel_tokens"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), index=True)
    role: Mapped[str] = mapped_column(String(16))
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def store_url(settings: Settings) -> str:
    """The SQLAlchemy URL of the token store (the gate's audit log lives in the same database)."""
    if settings.token_store_url is not None and settings.token_store_url.get_secret_value():
        return settings.token_store_url.get_secret_value()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(settings.data_dir / 'tokens.db').resolve()}"


def open_store(url: str, metadata: MetaData) -> Engine:
    """An engine on the token store's database (`store_url`) with `metadata`'s tables made (idempotent)."""
    engine = create_engine(url, pool_pre_ping=True)
    metadata.create_all(engine)
    return engine


class TokenStore:
    """Issued tokens (hashes only) in a SQLAlchemy database; tables are made on first use."""

    def __init__(self, url: str) -> None:
        self._url = url

    @classmethod
    def from_settings(cls, settings: Settings) -> TokenStore:
        return cls(store_url(settings))

    @cached_property
    def _engine(self) -> Engine:
        return open_store(self._url, _Base.metadata)

    def issue(self, name: str, role: Role) -> str:
        """A new random token for `name` (returned once; only its hash is kept)."""
        if not NAME.match(name):
            raise IdentityError(
                "a name is 1-64 letters, digits, '.', '_', '@' or '-', starting with a letter or digit"
            )
        if role not in ROLES:
            raise IdentityError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with Session(self._engine) as session, session.begin():
            if session.scalar(_active(name)) is not None:
                raise IdentityError(f"{name} already has an active token; revoke it first")
            session.add(
                IssuedToken(name=name, role=role, token_sha256=token_hash(token), created_at=_now())
            )
        return token

    def revoke(self, name: str) -> None:
        with Session(self._engine) as session, session.begin():
            row = session.scalar(_active(name))
            if row is None:
                raise IdentityError(f"{name} has no active token")
            row.revoked_at = _now()

    def list(self) -> list[IssuedToken]:
        """Every token ever issued (hashes omitted by callers), oldest first."""
        with Session(self._engine, expire_on_commit=False) as session:
            return list(session.scalars(select(IssuedToken).order_by(IssuedToken.id)))

    def holder(self, token: str) -> IssuedToken | None:
        """The issued token row for `token`, revoked or not (to name who tried a revoked token)."""
        if not token:
            return None
        with Session(self._engine, expire_on_commit=False) as session:
            return session.scalar(select(IssuedToken).where(IssuedToken.token_sha256 == token_hash(token)))

    def identify(self, token: str) -> Identity | None:
        """The active identity holding `token`, or None."""
        if not token:
            return None
        with Session(self._engine) as session:
            row = session.scalar(
                select(IssuedToken).where(
                    IssuedToken.token_sha256 == token_hash(token), IssuedToken.revoked_at.is_(None)
                )
            )
            if row is None or row.role not in ROLES:
                return None
            return Identity(row.name, cast(Role, row.role))


class Authenticator:
    """Bearer header -> identity: the bootstrap admin token, else the token store."""

    def __init__(self, settings: Settings, store: TokenStore | None = None) -> None:
        self._bootstrap = settings.approval_token.get_secret_value().encode()
        self.store = store or TokenStore.from_settings(settings)

    def identify(self, authorization: str | None) -> Identity:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise NotAuthenticated("a bearer token is required: Authorization: Bearer <token>")
        # Settings refuse an empty approval token, and an empty one never gets here.
        if hmac.compare_digest(token.encode(), self._bootstrap):
            return Identity(BOOTSTRAP_NAME, "admin")
        identity = self.store.identify(token)
        if identity is None:
            raise NotAuthenticated("the bearer token is unknown or revoked")
        return identity

    def claimant(self, authorization: str | None) -> tuple[str, str]:
        """(who, role) to record for a request `identify` refused; never the token itself.

        A revoked token is named by its former holder with the role "revoked", so an audit
        reader sees who still uses one; otherwise "anonymous" (no token) or "unknown token".
        """
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return "anonymous", "none"
        row = self.store.holder(token)
        if row is not None and row.revoked_at is not None:
            return row.name, "revoked"
        return "unknown token", "none"

    def require(self, authorization: str | None, role: Role) -> Identity:
        """The identity behind the header, when its role allows `role`; else NotAuthenticated/NotAllowed."""
        identity = self.identify(authorization)
        if not identity.allows(role):
            raise NotAllowed(f"{identity.name} is a {identity.role}; this needs the {role} role")
        return identity


def _active(name: str) -> Select[IssuedToken]:
    return select(IssuedToken).where(IssuedToken.name == name, IssuedToken.revoked_at.is_(None))


def _now() -> datetime:
    return datetime.now(UTC)
