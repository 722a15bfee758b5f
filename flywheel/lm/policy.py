"""A loaded causal LM and its tokenizer: sample completions and log their behaviour log-probs.

Any local Hugging Face causal-LM checkpoint works (the bootstrapped one or the user's own).

`Policy.generate_batch` samples many requests in shared forward passes; `Policy.generate` is a
batch of one. What must hold, whatever the batch:
- a request's random draws come only from its own `torch.Generator` seeded with its own seed, so
  which other requests share its batch never changes the stream of draws it sees;
- the logged behaviour log-probs are those of the sampled tokens, recomputed per sample by
  `token_logprobs` (the trainer's own function), never the padded batch's sampling logits.
A padded batch's logits differ from a lone sample's in the last bits (bench/lm_logprob_agreement.py);
`torch.multinomial` draws one token as the argmax of `probs / exponential noise`, so such a difference
changes a sampled token only on a near-tie of two candidates, and the log-probs stay exact either way.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from flywheel.lm.adapter_info import AdapterInfo, adapter_base_dir, read_adapter_info
from flywheel.lm.bootstrap import quiet_transformers
from flywheel.lm.errors import CheckpointError
from flywheel.lm.scoring import token_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FALLBACK_CONTEXT = 2048
MAX_TOP_LOGPROBS = 20

FinishReason = Literal["stop", "length", "declined"]


@dataclass(frozen=True)
class GenerationRequest:
    """One completion to sample. `seed=None` draws a fresh one; `stop` strings end the completion
    (the text shown stops before the first of them); `top_logprobs=k` also returns the k likeliest
    tokens at each position."""

    prompt: str
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0

    def check(self) -> None:
        """ValueError naming what is out of range (the serving request checks these first)."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        if any(not s for s in self.stop):
            raise ValueError("a stop sequence must not be empty.")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}.")


@dataclass(frozen=True)
class Generation:
    """One sampled completion.

    `completion_token_ids` are the tokens the policy chose, including a final end-of-text
    token when it chose to stop (the trainer needs the log-prob of stopping, and of declining,
    as much as of any other action), and the token that completed a stop sequence; `completion`
    is the text shown: their text without special tokens, cut before the first stop sequence.
    `logprobs[i]` is the behaviour log-prob of `completion_token_ids[i]` at temperature 1,
    computed by `token_logprobs`, the same function the trainer uses. `top_logprobs[i]`, when
    asked for, holds the k likeliest `(token_id, log-prob)` at that position, likeliest first.
    """

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion: str
    logprobs: list[float]
    finish_reason: FinishReason
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class _Row:
    """One request's decoding state."""

    prompt_ids: list[int]
    request: GenerationRequest
    generator: torch.Generator
    chosen: list[int] = field(default_factory=list)
    shown: str | None = None  # set when a stop sequence cut the text


class Policy:
    """A loaded HF causal LM + tokenizer on one device, in eval mode.

    `weights`: entered around every forward pass of `generate_batch` and `sample_token_ids`; a view of a
    shared base model (`flywheel.lm.adapters.SharedBase`) activates its own LoRA adapter there. `adapter`:
    the base a LoRA policy (`model` a peft model) was trained on; None for full weights.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        *,
        weights: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
        adapter: AdapterInfo | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.weights = weights or contextlib.nullcontext
        self.adapter = adapter
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

    def count_prompt_tokens(self, prompt: str) -> int:
        """Tokens the prompt takes in the context (an empty prompt is conditioned on one token)."""
        return max(1, len(self.tokenizer(prompt)["input_ids"]))

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text, special tokens included (what `logprobs.tokens` shows)."""
        return [cast(str, self.tokenizer.decode([t])) for t in token_ids]

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

    def _decode(self, token_ids: Sequence[int]) -> str:
        # decode of one flat id list is a str; the stubs also allow list[str] for batches
        return cast(str, self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def _text(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> str:
        """The text `token_ids` add after the prompt, special tokens left out.

        Decoded after the prompt's last token and cut after that token's own text: SentencePiece-style
        decoders (Llama, Mistral, Phi-3) drop the leading space of the first token decoded, so a completion
        decoded on its own would lose the space it starts with (and prompt + completion would not be the text
        the model saw). Falls back to decoding alone when the two do not line up (a character whose bytes
        straddle the boundary)."""
        anchor = self._decode(prompt_ids[-1:])
        joint = self._decode([*prompt_ids[-1:], *token_ids])
        return joint[len(anchor) :] if joint.startswith(anchor) else self._decode(token_ids)

    def _finished(self, row: _Row, stop_ids: set[int]) -> bool:
        token = row.chosen[-1]
        if row.request.stop:
            text = self._text(row.prompt_ids, row.chosen)
            cuts = [i for i in (text.find(s) for s in row.request.stop) if i >= 0]
            if cuts:
                row.shown = text[: min(cuts)]
                return True
        return token in stop_ids or self._ends_line(token) or len(row.chosen) >= row.request.max_tokens

    @staticmethod
    def _draw(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
        """One token from `logits` (vocab,), with the request's own generator."""
        if temperature == 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / temperature, dim=-1)  # (vocab,)
        return int(torch.multinomial(probs, 1, generator=generator))

    @torch.inference_mode()
    def _sample(self, rows: list[_Row]) -> None:
        """Decode every row to its end in shared forward passes; rows that finish leave the batch."""
        stop_ids = set(self.stop_ids)
        width = max(len(r.prompt_ids) for r in rows)
        padded = any(len(r.prompt_ids) < width for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # (B, W)
        mask = torch.zeros(len(rows), width, dtype=torch.long)  # (B, W), 1 = a real token
        for i, r in enumerate(rows):  # left padding: every row's last token is in the last column
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        mask = mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, W): pads do not shift a row's positions
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": positions} if padded else {}
        out = self.model(input_ids=ids.to(self.device), use_cache=True, logits_to_keep=1, **kwargs)
        active = list(range(len(rows)))  # rows[active[j]] is batch row j
        while True:
            logits = out.logits[:, -1]  # (B, vocab)
            for j, i in enumerate(active):
                rows[i].chosen.append(self._draw(logits[j], rows[i].request.temperature, rows[i].generator))
            keep = [j for j, i in enumerate(active) if not self._finished(rows[i], stop_ids)]
            if not keep:
                return
            cache = out.cache
            if len(keep) < len(active):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask, positions = mask[index], positions[index]
                active = [active[j] for j in keep]
            step = torch.tensor([[rows[i].chosen[-1]] for i in active], device=self.device)  # (B', 1)
            if padded:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (B', W+t)
                positions = positions[:, -1:] + 1  # (B', 1)
                kwargs = {"attention_mask": mask, "position_ids": positions}
            out = self.model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1, **kwargs)

    def generate_batch(
        self, requests: Sequence[GenerationRequest], *, behaviour_logprobs: bool = True
    ) -> list[Generation]:
        """Sample every request (each at most one line) in shared forward passes, with behaviour log-probs.

        A completion stops at end-of-text, at its `max_tokens`, after the first token containing a
        newline (that token is kept) or at the token that completes one of its `stop` strings. An
        end-of-text first token means the policy declined to suggest. `temperature=0` is greedy.
        The same request with the same seed gives the same completion on the same device, whatever
        else is in the batch (see the module docstring for the one caveat).
        `behaviour_logprobs=False` leaves `logprobs` empty and skips their recompute (a full forward per
        sample, most of the cost of a short completion on a CPU), for callers that only judge the text;
        the completions are the same.
        """
        for request in requests:
            request.check()
        if not requests:
            return []
        with self.weights():
            return self._generate_batch(requests, behaviour_logprobs)

    def _generate_batch(self, requests: Sequence[GenerationRequest], behaviour_logprobs: bool) -> list[Generation]:
        rows = []
        for request in requests:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(request.seed if request.seed is not None else secrets.randbits(63))
            rows.append(_Row(self.encode_prompt(request.prompt, request.max_tokens), request, generator))
        self._sample(rows)
        if not behaviour_logprobs:
            return [self._result(r, []) for r in rows]

        # Logged log-probs come from a fresh full forward per sample through the trainer's own function,
        # not from the sampling logits (padded, KV-cache steps accumulate differently), so the trainer
        # recomputes exactly these numbers on the same device and dtype.
        with torch.no_grad():
            logprobs, _ = token_logprobs(
                self.model, [r.prompt_ids for r in rows], [r.chosen for r in rows], self.pad_id
            )  # (B, T)
        return [self._result(r, logprobs[i, : len(r.chosen)].tolist()) for i, r in enumerate(rows)]

    def sample_token_ids(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, seeds: Sequence[int], temperature: float = 1.0
    ) -> list[list[int]]:
        """The chosen token ids of one seeded completion of each already-tokenised prompt (as `generate_batch`
        samples: one line at most, end-of-text kept): for the trainer, whose samples carry ids, not text."""
        request = GenerationRequest("", max_tokens, temperature)
        request.check()
        if not prompts:
            return []
        rows = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            if len(prompt) + max_tokens > self.context:
                raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room for {max_tokens} in {self.context}")
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            rows.append(_Row(list(prompt), request, generator))
        with self.weights():
            self._sample(rows)
        return [r.chosen for r in rows]

    def finish_reason(self, token_ids: Sequence[int], *, cut_by_stop: bool = False) -> FinishReason:
        """Why a completion of these chosen ids ended: "declined" (end-of-text first), "stop" (end-of-text, the
        end of its line, or `cut_by_stop`: a stop sequence) or "length" (its max_tokens)."""
        last = token_ids[-1]
        stopped = last in self.stop_ids
        if stopped and len(token_ids) == 1:
            return "declined"
        if stopped or cut_by_stop or self._ends_line(last):
            return "stop"
        return "length"

    def _result(self, row: _Row, logprobs: list[float]) -> Generation:
        finish = self.finish_reason(row.chosen, cut_by_stop=row.shown is not None)
        return Generation(
            prompt_token_ids=row.prompt_ids,
            completion_token_ids=row.chosen,
            completion=row.shown if row.shown is not None else self._text(row.prompt_ids, row.chosen),
            logprobs=logprobs,
            finish_reason=finish,
            top_logprobs=self._top_logprobs(row) if row.request.top_logprobs else None,
        )

    @torch.no_grad()
    def _top_logprobs(self, row: _Row) -> list[list[tuple[int, float]]]:
        # The same single-sample forward `token_logprobs` runs, so the sampled token's entry, when it is
        # among the top k, carries the logged value.
        inputs = torch.tensor([row.prompt_ids + row.chosen[:-1]], device=self.device)  # (1, L)
        logits = self.model(input_ids=inputs, use_cache=False).logits[0, len(row.prompt_ids) - 1 :]  # (T, V)
        top = torch.log_softmax(logits.float(), dim=-1).topk(row.request.top_logprobs, dim=-1)
        return [
            list(zip(map(int, ids), map(float, values), strict=True))
            for ids, values in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        ]

    def generate(
        self,
        prompt: str,
        max_tokens: int = 16,
        temperature: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> Generation:
        """Sample one completion of `prompt`: `generate_batch` with a batch of one."""
        return self.generate_batch([GenerationRequest(prompt, max_tokens, temperature, seed, tuple(stop))])[0]

    def save(self, path: Path) -> Path:
        """Write the model (safetensors) and tokenizer to `path` in HF format."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with quiet_transformers():
            self.model.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
        return path


def load_policy(
    path: str | Path, device: str = "cpu", dtype: str = "float32", *, base: str | Path | None = None,
    trainable: bool = False,
) -> Policy:
    """Load a local HF causal-LM checkpoint (no hub access) in eval mode on `device`.

    A LoRA adapter directory (`flywheel.lm.adapters`) loads as base + adapter (a peft model): its base from
    `base`, or from beside it where the registry's fetch put it. `trainable`: the adapter's weights require
    grad (the trainer continuing from it); a full checkpoint's always do.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if (path / "adapter_config.json").is_file():
        return _load_adapter_policy(path, device, dtype, base, trainable)
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


def _load_adapter_policy(path: Path, device: str, dtype: str, base: str | Path | None, trainable: bool) -> Policy:
    from peft import PeftModel

    info = read_adapter_info(path)
    base_policy = load_policy(base if base is not None else adapter_base_dir(path), device=device, dtype=dtype)
    try:
        with quiet_transformers():
            model = PeftModel.from_pretrained(base_policy.model, str(path), is_trainable=trainable)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{path} could not be loaded as a LoRA adapter of {info.describe()}: {exc}") from exc
    model.eval()
    return Policy(cast("PreTrainedModel", model), base_policy.tokenizer, base_policy.device, adapter=info)
