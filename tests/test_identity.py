"""Identities behind bearer tokens: the token store and the bootstrap admin token."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from flywheel.identity import (
    BOOTSTRAP_NAME,
    Authenticator,
    IdentityError,
    NotAllowed,
    NotAuthenticated,
    TokenStore,
)
from flywheel.settings import Settings


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory) -> TokenStore:
    return TokenStore(f"sqlite:///{tmp_path_factory.mktemp('tokens') / 'tokens.db'}")


def test_roles_are_ordered_and_each_token_names_its_holder(store: TokenStore) -> None:
    auth = Authenticator(Settings(approval_token=SecretStr("bootstrap-token-for-this-test")), store)
    viewer, approver, admin = store.issue("vi", "viewer"), store.issue("ap", "approver"), store.issue("ad", "admin")
    assert auth.require(f"Bearer {approver}", "approver").name == "ap"
    assert auth.require(f"bearer {admin}", "approver").name == "ad"  # the scheme is case-insensitive
    assert auth.require(f"Bearer {viewer}", "viewer").name == "vi"
    with pytest.raises(NotAllowed, match="vi is a viewer"):
        auth.require(f"Bearer {viewer}", "approver")
    assert auth.require("Bearer bootstrap-token-for-this-test", "admin").name == BOOTSTRAP_NAME


def test_an_empty_configured_token_never_matches_an_empty_bearer(store: TokenStore) -> None:
    # Settings refuse an empty token at load; this is the second line, should one slip through
    # (model_copy skips validation).
    settings = Settings().model_copy(update={"approval_token": SecretStr("")})
    auth = Authenticator(settings, store)
    for header in ("Bearer ", "Bearer", "Bearer  ", "", None):
        with pytest.raises(NotAuthenticated):
            auth.require(header, "viewer")


def test_names_roles_and_revocation_are_checked(store: TokenStore) -> None:
    for bad in ("", "two words", BOOTSTRAP_NAME, "ana (local CLI)", "x" * 65, "-dash-first"):
        with pytest.raises(IdentityError):
            store.issue(bad, "approver")
    with pytest.raises(IdentityError, match="unknown role"):
        store.issue("ana", "root")  # type: ignore[arg-type]
    token = store.issue("ana", "approver")
    with pytest.raises(IdentityError, match="no active token"):
        store.revoke("bob")
    store.revoke("ana")
    assert store.identify(token) is None and store.identify("") is None
    assert [(t.name, t.revoked_at is not None) for t in store.list()] == [("ana", True)]
