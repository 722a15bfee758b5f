"""Tiny, randomly initialised checkpoints of the Hugging Face model families Flywheel runs: Llama, Qwen2,
Mistral, Phi-3 and GPT-2, each with a tokenizer that has its family's quirks.

No hub is reachable from where Flywheel is tested, so a "Qwen2" here is the real `Qwen2ForCausalLM`
architecture at about 110k-140k parameters, and a tokenizer trained locally (the `tokenizers`
library, on the bootstrap corpus: `flywheel.lm.corpus`) that reproduces what makes the real one different.
The loop must not care which family it gets, and these quirks are where it would:

| family  | tokens                  | BOS added | EOS             | pad             | chat template        |
|---------|-------------------------|-----------|-----------------|-----------------|----------------------|
| gpt2    | byte-level BPE          | no        | `<|endoftext|>` | none            | none                 |
| llama   | SentencePiece-style `▁` | `<s>`     | `</s>`          | none (left)     | none                 |
| mistral | SentencePiece-style `▁` | `<s>`     | `</s>`          | none (right)    | `[INST] ... [/INST]` |
| qwen2   | byte-level BPE          | no        | `<|endoftext|>` | `<|endoftext|>` | ChatML `<|im_end|>`  |
| phi3    | SentencePiece-style `▁` | no        | `<|endoftext|>` | `<|endoftext|>` | `<|user|>` `<|end|>` |

SentencePiece-style decoders drop the leading space of the first token decoded (a completion decoded on
its own loses the space it starts with), and the chat models end a turn with a token of their own
(`<|im_end|>`, `<|end|>`) that their generation config lists as an end-of-text id beside the EOS.
GPT-2, Qwen2 and Phi-3 add no BOS, so an empty prompt has no token of its own. Padding side differs
(Flywheel pads its own batches and never reads it). GPT-2 and Qwen2 tie their output layer to the input
embeddings, Phi-3 fuses its attention and MLP projections: the weight names differ in each safetensors file.

`tiny_checkpoint(family, out)` writes one; `flywheel model tiny --family qwen2 --out DIR` is its CLI.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.lm.bootstrap import quiet_transformers
from flywheel.lm.corpus import stdlib_corpus

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

FAMILIES = ("llama", "qwen2", "mistral", "phi3", "gpt2")
CONTEXT = 256
_ENDOFTEXT = "<|endoftext|>"

_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_PHI3 = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class _Spec:
    """One family's tokenizer: pieces, its special tokens and which of them it adds or names."""

    byte_level: bool
    specials: tuple[str, ...]  # in id order, first ids of the vocabulary
    bos: str | None  # the BOS token the tokenizer names
    add_bos: bool  # whether encoding adds it
    eos: str
    pad: str | None
    padding_side: str
    chat_template: str | None = None
    unk: str | None = None
    end_of_turn: str | None = None  # a chat model's end of its turn, an extra end-of-text id


_SENTENCEPIECE = ("<unk>", "<s>", "</s>")
_SPECS = {
    "gpt2": _Spec(
        byte_level=True, specials=(_ENDOFTEXT,), bos=_ENDOFTEXT, add_bos=False, eos=_ENDOFTEXT, pad=None,
        padding_side="right",
    ),
    "llama": _Spec(
        byte_level=False, specials=_SENTENCEPIECE, bos="<s>", add_bos=True, eos="</s>", pad=None,
        padding_side="left", unk="<unk>",
    ),
    "mistral": _Spec(
        byte_level=False, specials=_SENTENCEPIECE, bos="<s>", add_bos=True, eos="</s>", pad=None,
        padding_side="right", chat_template=_MISTRAL, unk="<unk>",
    ),
    "qwen2": _Spec(
        byte_level=True, specials=(_ENDOFTEXT, "<|im_start|>", "<|im_end|>"), bos=None, add_bos=False,
        eos=_ENDOFTEXT, pad=_ENDOFTEXT, padding_side="right", chat_template=_CHATML, end_of_turn="<|im_end|>",
    ),
    "phi3": _Spec(
        byte_level=False, specials=(*_SENTENCEPIECE, _ENDOFTEXT, "<|user|>", "<|assistant|>", "<|end|>"),
        bos="<s>", add_bos=False, eos=_ENDOFTEXT, pad=_ENDOFTEXT, padding_side="left", chat_template=_PHI3,
        unk="<unk>", end_of_turn="<|end|>",
    ),
}  # fmt: skip


def train_family_tokenizer(family: str, texts: list[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A BPE tokenizer trained on `texts` with `family`'s pieces, special tokens, BOS/EOS/pad and template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = _spec(family)
    tok = Tokenizer(models.BPE(unk_token=spec.unk))
    if spec.byte_level:  # GPT-2, Qwen2: every byte is a token, spaces are part of the next piece
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # Llama, Mistral, Phi-3: SentencePiece's `▁` for a space, one prepended to the text
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        # Pieces never span a line (SentencePiece's own models split there too).
        tok.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
        # As SentencePiece's: the first decoded token's leading space is dropped.
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        alphabet = sorted(set(string.printable.replace(" ", "▁")))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(spec.specials), initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    if spec.add_bos and spec.bos is not None:
        bos = spec.bos
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    elif spec.byte_level:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    kwargs: dict[str, Any] = {"eos_token": spec.eos, "padding_side": spec.padding_side, "model_max_length": CONTEXT}
    for name, value in (("bos_token", spec.bos), ("pad_token", spec.pad), ("unk_token", spec.unk)):
        if value is not None:
            kwargs[name] = value
    extra = [s for s in spec.specials if s not in {spec.bos, spec.eos, spec.pad, spec.unk}]
    if extra:
        kwargs["additional_special_tokens"] = extra
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    if spec.chat_template is not None:
        tokenizer.chat_template = spec.chat_template
    return tokenizer


def family_config(family: str, tokenizer: PreTrainedTokenizerFast, head_dim: int = 16) -> PretrainedConfig:
    """A tiny config of `family`'s own architecture (110k-140k parameters with a 512-token vocabulary).

    `head_dim`: the width of an attention head (64 / head_dim heads, half as many key-value heads where the family
    groups them). 16 by default; vLLM's CPU attention has no kernel that narrow, and runs 32."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    spec = _spec(family)
    ids: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.convert_tokens_to_ids(spec.bos) if spec.bos else None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    heads, rest = divmod(64, head_dim)
    if rest or not heads:
        raise ValueError(f"head_dim must divide the hidden size 64, got {head_dim}")
    if family == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=heads, n_inner=128, n_positions=CONTEXT, **ids)
    shape: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
                             "max_position_embeddings": CONTEXT}  # fmt: skip
    if family == "llama":
        return LlamaConfig(**shape, **ids)
    if family == "mistral":
        return MistralConfig(**shape, sliding_window=CONTEXT, **ids)
    if family == "qwen2":
        return Qwen2Config(**shape, tie_word_embeddings=True, **ids)
    return Phi3Config(**shape, **ids)


def tiny_checkpoint(
    family: str, out: Path, *, seed: int = 0, vocab_size: int = 512, n_files: int = 30, head_dim: int = 16
) -> Path:
    """Write a randomly initialised `family` checkpoint and its tokenizer to `out` (save_pretrained); returns
    `out`. Its tokenizer is trained on `n_files` files of the bootstrap corpus (seeded, so the same each time);
    `head_dim` as `family_config` (32 for vLLM on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = _spec(family)
    tokenizer = train_family_tokenizer(family, stdlib_corpus(n_files, 4000, seed), vocab_size)
    config = family_config(family, tokenizer, head_dim)
    torch.manual_seed(seed)
    with quiet_transformers():
        model = AutoModelForCausalLM.from_config(config)
    stops = [tokenizer.eos_token_id]
    if spec.end_of_turn is not None:  # as the real chat models: their turn's end also ends generation
        stops.append(tokenizer.convert_tokens_to_ids(spec.end_of_turn))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=stops if len(stops) > 1 else stops[0],
        pad_token_id=config.pad_token_id,
    )  # fmt: skip
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_transformers():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


def _spec(family: str) -> _Spec:
    if family not in _SPECS:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    return _SPECS[family]
