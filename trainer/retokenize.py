"""Text-only generations as token ids of the current policy (what the trainer needs to score them).

A product that serves its own model logs only text; a generation posted without serving's signature is
trusted only as text. Either becomes a sample by tokenising prompt + completion with the policy's own
tokenizer. What must hold: such ids carry no behaviour log-probs, so they feed only objectives that need
none (trainer/objectives.py: "kto", "rwl"), never an importance ratio.

A generation of the chat surface, when the policy's tokenizer has a chat template (Qwen2's ChatML, Phi-3's
`<|user|>` turns, Mistral's `[INST]`), is tokenised as the model saw it in the product: the user's turn
rendered by the template with the assistant's turn opened, then the reply, then the template's own
end-of-turn token (`<|im_end|>`, `<|end|>`; the policy's EOS when the template ends a turn with it) as the
action of stopping. Without a template the chat text is tokenised as plain text, like every other surface.
"""

from __future__ import annotations

from collections.abc import Callable

from flywheel.lm import Policy

CHAT_SURFACE = "chat"

# (prompt, completion, finish_reason, surface) -> (prompt ids, completion ids), or None when it cannot fit.
TextEncoder = Callable[[str, str, str, str], tuple[list[int], list[int]] | None]


def text_encoder(policy: Policy) -> TextEncoder:
    """Tokenise a text-only generation like serving would have: the completion's ids as the policy's
    tokenizer splits prompt + completion (so a word straddling the boundary is split as in context), then
    the end-of-text token when the completion ended by stopping (the policy's action of stopping, as in
    `Generation.completion_token_ids`); the prompt cut from the left to leave the completion room.
    A chat generation goes through the chat template when the tokenizer has one (the module docstring)."""
    tokenizer = policy.tokenizer

    def encode(prompt: str, completion: str, finish_reason: str, surface: str) -> tuple[list[int], list[int]] | None:
        if surface == CHAT_SURFACE and getattr(tokenizer, "chat_template", None):
            return _chat(policy, prompt, completion, finish_reason)
        alone = list(tokenizer(prompt)["input_ids"])
        joint = list(tokenizer(prompt + completion)["input_ids"])
        if completion and joint[: len(alone)] == alone:
            completion_ids = joint[len(alone) :]
        else:  # the boundary merged across: tokenise the completion on its own
            completion_ids = _continuation(policy, completion)
        if finish_reason != "length":
            completion_ids.append(policy.stop_ids[0])
        try:
            prompt_ids = policy.encode_prompt(prompt, max_tokens=len(completion_ids))
        except ValueError:  # the completion alone fills the context
            return None
        return prompt_ids, completion_ids

    return encode


def _continuation(policy: Policy, text: str) -> list[int]:
    """`text`'s ids as text that follows other text. SentencePiece-style tokenizers (Llama, Mistral, Phi-3)
    prepend a space to text encoded on its own, so `text` is encoded after a line break and that break's ids
    taken off; encoded alone when they do not line up (a byte-level tokenizer joins a break to the spaces
    after it)."""
    tokenizer = policy.tokenizer
    anchor = list(tokenizer("\n", add_special_tokens=False)["input_ids"])
    joint = list(tokenizer("\n" + text, add_special_tokens=False)["input_ids"])
    if anchor and joint[: len(anchor)] == anchor:
        return joint[len(anchor) :]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat(policy: Policy, prompt: str, completion: str, finish_reason: str) -> tuple[list[int], list[int]] | None:
    """A chat turn through the tokenizer's template: the opened assistant turn as prompt, the reply and the
    template's end-of-turn token as completion (the token the template writes right after the reply)."""
    tokenizer = policy.tokenizer
    user = [{"role": "user", "content": prompt}]
    opened = _ids(tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True))
    full = _ids(tokenizer.apply_chat_template(
        [*user, {"role": "assistant", "content": completion}], add_generation_prompt=False, tokenize=True
    ))  # fmt: skip
    if full[: len(opened)] != opened:  # a template that renders a finished turn otherwise
        raise ValueError("the chat template renders the user's turn differently once the reply follows it")
    reply = full[len(opened) :]
    special = set(tokenizer.all_special_ids)
    end = next((i for i, t in enumerate(reply) if t in special), None)
    # A template that ends no turn with a token of its own: stopping is the EOS.
    completion_ids = [*reply, policy.stop_ids[0]] if end is None else reply[: end + 1]
    if finish_reason == "length":
        completion_ids = completion_ids[:-1]
    if len(opened) + len(completion_ids) > policy.context:
        return None  # a conversation's turn is not cut: its opening is what the template made it
    return opened, completion_ids


def _ids(rendered: object) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list of ids.
    if isinstance(rendered, list):
        return [int(t) for t in rendered]
    return [int(t) for t in rendered["input_ids"]]  # type: ignore[index]
