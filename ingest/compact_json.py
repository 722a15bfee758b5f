"""`json.dumps(obj, separators=(",", ":"))`, without rebuilding an encoder per call.

json.dumps with options, and `JSONEncoder.encode`, build a new C encoder on every call, which
is most of the cost for the small objects ingest encodes per event. `compact_json_encoder`
builds the very encoder `encode` would build, once: same output, pure Python where CPython's
C accelerator is missing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def compact_json_encoder(default: Callable[[Any], Any] | None = None) -> Callable[[Any], str]:
    """An encoder equal to `json.dumps(obj, separators=(",", ":"), default=default)`.

    >>> compact_json_encoder()({"a": [1, "é"]}) == json.dumps({"a": [1, "é"]}, separators=(",", ":"))
    True
    """
    encoder = json.JSONEncoder(separators=(",", ":"), default=default)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return encoder.encode
    c_encoder = make(None, encoder.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)

    def encode(obj: Any) -> str:
        if not isinstance(obj, dict | list):  # `encode` special-cases bare strings and scalars
            return encoder.encode(obj)
        return "".join(c_encoder(obj, 0))

    return encode
