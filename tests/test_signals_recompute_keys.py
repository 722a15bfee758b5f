"""The batch recompute's lookup of each feedback event's generation by id (`signals.recompute._rows_of`): by the
ids' hashes, yet the same rows as a join on the ids themselves, hash collisions and nulls included."""

from __future__ import annotations

import polars as pl
import pytest

from signals.recompute import _rows_of


def _by_length(self: pl.Series, *args: object) -> pl.Series:
    """A hash that collides a lot: the text's length (0 for null)."""
    return self.str.len_bytes().cast(pl.UInt64).fill_null(0)


def test_each_value_finds_the_row_of_its_key_and_no_other() -> None:
    keys = pl.Series(["g1", "g22", None, "g4"])
    values = pl.Series(["g4", "g1", None, "nope", "g22", "g1"])
    assert _rows_of(values, keys).to_list() == [3, 0, None, None, 1, 0]


def test_a_value_whose_hash_only_collides_with_a_key_finds_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pl.Series, "hash", _by_length)
    keys = pl.Series(["a", "bb", "ccc"])  # hashes 1, 2, 3: distinct
    assert _rows_of(pl.Series(["a", "xx", "ccc", None, "dddd", "bb"]), keys).to_list() == [0, None, 2, None, None, 1]


def test_keys_that_share_a_hash_are_matched_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pl.Series, "hash", _by_length)
    keys = pl.Series(["a", "b", None])  # "a" and "b" share a hash
    assert _rows_of(pl.Series(["b", "a", "c", None]), keys).to_list() == [1, 0, None, None]
