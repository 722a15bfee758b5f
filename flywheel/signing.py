"""Serving's signature on the generations it logs: what lets the trainer trust a sample.

Anyone holding a write key can post events to the collector, `generation` events included,
so neither the event type nor its `source` says who produced one. Off-policy training takes a
generation's token ids and behaviour log-probs as the truth about what the policy did; a forged
one would teach the model whatever its author wrote. So serving signs every generation it logs
with an HMAC-SHA256 under `Settings.serving_key` (held by serving and the trainer only, never
by products), and the trainer learns off-policy only from generations whose signature verifies.

What must hold:
- the signature covers everything the trainer reads from a generation: the envelope's
  `generation_id` and `user_id`, and the record's prompt, token ids, completion, behaviour
  log-probs, model version, arm, experiment, temperature and finish reason. Changing any of
  them, or moving a signed record to another generation id or user, voids it;
- the signed bytes are rebuilt from parsed values (canonical JSON), so a record that travelled
  through Kafka and the lake as JSON verifies exactly as it was signed;
- fields outside that list (latency) may change freely; adding a field to the record does not
  void old signatures, adding one to the signed list needs a new `SCHEME`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from enum import StrEnum

from flywheel.contract import GenerationRecord

SCHEME = "v1"
_DOMAIN = "flywheel.generation"  # keeps these MACs apart from any other use of the same key


class Untrusted(StrEnum):
    """Why a generation's signature does not make it trainable (the trainer counts these)."""

    UNSIGNED = "unsigned (not logged by serving)"
    UNKNOWN_SCHEME = "signed with an unknown scheme"
    MISMATCH = "with a signature that does not verify"


def signed_bytes(generation_id: str, user_id: str, record: GenerationRecord) -> bytes:
    """The canonical bytes the signature is computed over."""
    covered = {
        "generation_id": generation_id,
        "user_id": user_id,
        "prompt": record.prompt,
        "prompt_token_ids": record.prompt_token_ids,
        "completion": record.completion,
        "completion_token_ids": record.completion_token_ids,
        "behaviour_logprobs": record.behaviour_logprobs,
        "model_version": record.model_version,
        "arm": record.arm,
        "experiment": record.experiment,
        "temperature": record.temperature,
        "finish_reason": record.finish_reason,
    }
    # repr of a float round-trips exactly, so the same parsed values always give the same bytes.
    text = json.dumps([_DOMAIN, SCHEME, covered], sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return text.encode()


def sign_generation(key: str, generation_id: str, user_id: str, record: GenerationRecord) -> str:
    """The signature serving stores in `record.signature` (its own value is not covered)."""
    mac = hmac.new(key.encode(), signed_bytes(generation_id, user_id, record), hashlib.sha256)
    return f"{SCHEME}:{mac.hexdigest()}"


def check_generation(key: str, generation_id: str, user_id: str, record: GenerationRecord) -> Untrusted | None:
    """None when serving signed exactly this generation under `key`; otherwise why not."""
    if not record.signature:
        return Untrusted.UNSIGNED
    scheme, _, _ = record.signature.partition(":")
    if scheme != SCHEME:
        return Untrusted.UNKNOWN_SCHEME
    expected = sign_generation(key, generation_id, user_id, record)
    if not hmac.compare_digest(expected.encode(), record.signature.encode()):
        return Untrusted.MISMATCH
    return None
