"""A loaded causal LM and its tokenizer: sample completions and log their behaviour log-probs.

Any local Hugging Face causal-LM checkpoint works (the bootstrapped one or the user's own).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

import torch

from flywheel.lm.bootstrap import quiet_transformers
from flywheel.lm.scoring import token_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FALLBACK_CONTEXT = 2048


class CheckpointError(ValueError):
    """The path given is not a loadable Hugging Face causal-LM checkpoint."""


@dataclass(frozen=True)
class Generation:
    """One sampled completion.

    `completion_token_ids` are the tokens the policy chose, including a final end-of-text
    token when it chose to stop (the trainer needs the log-prob of stopping, and of declining,
    as much as of any other action); `completion` is their text without special tokens.
    `logprobs[i]` is the behaviour log-prob of `completion_token_ids[i]` at temperature 1,
    computed by `token_logprobs`, the same function the trainer uses.
    """

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion: str
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "declined"]


class Policy:
    """A loaded HF causal LM + tokenizer on one device, in eval mode."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self._newline_tokens: dict[int, bool] = {}

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.stop_ids[0])

    @property
    def stop_ids(self) -> list[int]:
        """End-of-text ids: the tokenizer's EOS and any the model's generation config adds."""
        ids: list[int] = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        config_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for extra in config_eos if isinstance(config_eos, list) else [config_eos]:
            if extra is not None and int(extra) not in ids:
                ids.append(int(extra))
        if not ids:
            raise CheckpointError("the tokenizer has no EOS token; set eos_token in tokenizer_config.json.")
        return ids

    @property
    def context(self) -> int:
        """Longest sequence (prompt + completion) the model was made for."""
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if n else _FALLBACK_CONTEXT

    def encode_prompt(self, prompt: str, max_tokens: int) -> list[int]:
        """Prompt token ids, cut from the left (keeping a leading BOS) to leave room for max_tokens."""
        if max_tokens >= self.context:
            raise ValueError(
                f"max_tokens={max_tokens} leaves no room for a prompt in a {self.context}-token context."
            )
        ids = list(self.tokenizer(prompt)["input_ids"])
        if not ids:  # tokenizers that add no BOS: condition an empty prompt on EOS (start of a document)
            bos = self.tokenizer.bos_token_id
            ids = [int(bos if bos is not None else self.stop_ids[0])]
        limit = self.context - max_tokens
        if len(ids) > limit:
            bos = self.tokenizer.bos_token_id
            # The end of the prompt is what the completion continues, so the start goes.
            ids = (
                [ids[0], *ids[len(ids) - limit + 1 :]] if bos is not None and ids[0] == bos else ids[-limit:]
            )
        return ids

    def _ends_line(self, token_id: int) -> bool:
        cached = self._newline_tokens.get(token_id)
        if cached is None:
            cached = "\n" in self.tokenizer.decode([token_id])
            self._newline_tokens[token_id] = cached
        return cached

    @torch.inference_mode()
    def _sample(
        self, prompt_ids: list[int], max_tokens: int, temperature: float, generator: torch.Generator
    ) -> list[int]:
        stop_ids = set(self.stop_ids)
        out = self.model(input_ids=torch.tensor([prompt_ids], device=self.device), use_cache=True)
        chosen: list[int] = []
        while True:
            logits = out.logits[0, -1].float()  # (vocab,)
            if temperature == 0.0:
                token = int(torch.argmax(logits))
            else:
                probs = torch.softmax(logits / temperature, dim=-1)  # (vocab,)
                token = int(torch.multinomial(probs, 1, generator=generator))
            chosen.append(token)
            if token in stop_ids or self._ends_line(token) or len(chosen) >= max_tokens:
                return chosen
            out = self.model(
                input_ids=torch.tensor([[token]], device=self.device),
                past_key_values=out.past_key_values,
                use_cache=True,
            )

    def generate(
        self, prompt: str, max_tokens: int = 16, temperature: float = 1.0, seed: int | None = None
    ) -> Generation:
        """Sample one completion of `prompt` (at most one line), with behaviour log-probs.

        Stops at end-of-text, at `max_tokens`, or after the first token containing a newline
        (that token is kept). An end-of-text first token means the policy declined to suggest.
        `temperature=0` is greedy. The same seed gives the same completion on the same device.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}.")
        prompt_ids = self.encode_prompt(prompt, max_tokens)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if seed is not None else secrets.randbits(63))
        completion_ids = self._sample(prompt_ids, max_tokens, temperature, generator)

        # Logged log-probs come from a fresh full forward through the trainer's own function,
        # not from the sampling logits (KV-cache steps accumulate differently), so the trainer
        # recomputes exactly these numbers on the same device and dtype.
        with torch.no_grad():
            logprobs, _ = token_logprobs(self.model, [prompt_ids], [completion_ids], self.pad_id)  # (1, T)
        stopped = completion_ids[-1] in self.stop_ids
        if stopped and len(completion_ids) == 1:
            finish: Literal["stop", "length", "declined"] = "declined"
        elif stopped or self._ends_line(completion_ids[-1]):
            finish = "stop"
        else:
            finish = "length"
        return Generation(
            prompt_token_ids=prompt_ids,
            completion_token_ids=completion_ids,
            # decode of one flat id list is a str; the stubs also allow list[str] for batches
            completion=cast(str, self.tokenizer.decode(completion_ids, skip_special_tokens=True)),
            logprobs=logprobs[0].tolist(),
            finish_reason=finish,
        )

    def save(self, path: Path) -> Path:
        """Write the model (safetensors) and tokenizer to `path` in HF format."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with quiet_transformers():
            self.model.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
        return path


def load_policy(path: str | Path, device: str = "cpu", dtype: str = "float32") -> Policy:
    """Load a local HF causal-LM checkpoint (no hub access) in eval mode on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{path} is not a Hugging Face checkpoint (no config.json). Point it at a directory written "
            "by save_pretrained, or make one with `flywheel model bootstrap --out DIR`."
        )
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}.")
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here; use device='cpu'.")
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype], local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path} could not be loaded as a causal LM checkpoint: {exc}") from exc
    if tokenizer.pad_token is None:  # GPT-2-style tokenizers have none; padding is never scored
        tokenizer.pad_token = tokenizer.eos_token
    model.to(target)  # type: ignore[arg-type]  # transformers wraps .to with functools.wraps; the stub drops self
    model.eval()
    return Policy(model, tokenizer, target)
