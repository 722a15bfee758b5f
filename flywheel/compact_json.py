"""Compact JSON text of decoded JSON values, fast: the lake's `properties` column and refused items' bytes.

msgspec writes the values `json.dumps(obj, separators=(",", ":"))` would, with no spaces, in a few
times less time than building a `json` encoder per call. The text differs from `json.dumps` only in
spelling, never in value (`json.loads` of either gives the same object): non-ASCII text is written as
UTF-8 rather than `\\uXXXX` escapes, and float exponents without a sign or leading zero (`1e300`,
not `1e+300`).

What must hold for callers: msgspec writes NaN and Infinity as `null`, so values that may hold them
(decoded leniently by `json.loads`) are refused before they get here (`flywheel.contract.check_properties`)
or encoded with `json.dumps` (`ingest.collector.intake`). Text holding a lone surrogate, which UTF-8 cannot
carry, falls back to `json.dumps` and its `\\ud800` escape.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec


def compact_json_encoder(default: Callable[[Any], Any] | None = None) -> Callable[[Any], str]:
    """An encoder giving the values of `json.dumps(obj, separators=(",", ":"), default=default)`.

    >>> encode = compact_json_encoder()
    >>> encode({"a": [1, 2.5, None, True, "é"]})
    '{"a":[1,2.5,null,true,"é"]}'
    >>> json.loads(encode({"s": "\\ud800"})) == {"s": "\\ud800"}
    True
    """
    encoder = msgspec.json.Encoder(enc_hook=default)

    def encode(obj: Any) -> str:
        try:
            return encoder.encode(obj).decode()
        except UnicodeEncodeError:  # a lone surrogate: only an ASCII escape can write it
            return json.dumps(obj, separators=(",", ":"), default=default)

    return encode
