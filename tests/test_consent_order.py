"""Consent from those allowed to state it: ordered by arrival, a revocation outranks any grant a client dates
ahead (real lake tables, written by ingest's writer)."""

from __future__ import annotations

from datetime import timedelta

from flywheel.contract import utcnow
from flywheel.lake.tables import EVENTS
from flywheel.settings import Settings
from simulator.telemetry import feedback_event, write_events
from trainer.config import TrainerConfig
from trainer.data import _consenting_users


def statement(user: str, grant: bool, ts, received_at):  # noqa: ANN001, ANN201
    return feedback_event(f"g-{user}", "shown", ts, user_id=user, received_at=received_at,
                          training_consent=grant)  # fmt: skip


def test_a_future_dated_grant_sent_after_a_revocation_does_not_make_the_user_trainable(settings: Settings) -> None:
    t = utcnow() - timedelta(hours=1)
    write_events(settings, [
        # granted, then revoked; then a grant dated years ahead arrives (any write key's holder could send it)
        statement("victim", True, t, t),
        statement("victim", False, t + timedelta(minutes=1), t + timedelta(minutes=1)),
        statement("victim", True, t.replace(year=t.year + 5), t + timedelta(minutes=2)),
        # a revocation dated in the past but arriving last still wins over an earlier-arrived grant
        statement("late-revoker", True, t + timedelta(minutes=1), t + timedelta(minutes=1)),
        statement("late-revoker", False, t - timedelta(days=3), t + timedelta(minutes=2)),
        # the same arrival: the revocation wins
        statement("tied", True, t, t),
        statement("tied", False, t, t),
        # a user who revoked and later consents again, stated honestly, is trainable
        statement("returning", False, t, t),
        statement("returning", True, t + timedelta(minutes=3), t + timedelta(minutes=3)),
    ])  # fmt: skip
    table = EVENTS.at(settings.lake_root)
    assert _consenting_users(table, EVENTS.version(table) or 0, TrainerConfig()) == {"returning"}
