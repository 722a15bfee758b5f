"""Text-only generations as token ids of the current policy (what the trainer needs to score them).

A product that serves its own model logs only text; a generation posted without serving's signature is
trusted only as text. Either becomes a sample by tokenising prompt + completion with the policy's own
tokenizer. What must hold: such ids carry no behaviour log-probs, so they feed only objectives that need
none (trainer/objectives.py: "kto", "rwl"), never an importance ratio.
"""

from __future__ import annotations

from collections.abc import Callable

from flywheel.lm import Policy

# (prompt, completion, finish_reason) -> (prompt ids, completion ids), or None when it cannot fit the context.
TextEncoder = Callable[[str, str, str], tuple[list[int], list[int]] | None]


def text_encoder(policy: Policy) -> TextEncoder:
    """Tokenise a text-only generation like serving would have: the completion's ids as the policy's
    tokenizer splits prompt + completion (so a word straddling the boundary is split as in context), then
    the end-of-text token when the completion ended by stopping (the policy's action of stopping, as in
    `Generation.completion_token_ids`); the prompt cut from the left to leave the completion room."""
    tokenizer = policy.tokenizer

    def encode(prompt: str, completion: str, finish_reason: str) -> tuple[list[int], list[int]] | None:
        alone = list(tokenizer(prompt)["input_ids"])
        joint = list(tokenizer(prompt + completion)["input_ids"])
        if completion and joint[: len(alone)] == alone:
            completion_ids = joint[len(alone) :]
        else:  # the boundary merged across: tokenise the completion on its own
            completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
        if finish_reason != "length":
            completion_ids.append(policy.stop_ids[0])
        try:
            prompt_ids = policy.encode_prompt(prompt, max_tokens=len(completion_ids))
        except ValueError:  # the completion alone fills the context
            return None
        return prompt_ids, completion_ids

    return encode
