"""A `tokenizers` tokenizer rebuilt from a GGUF file's metadata (llama.cpp's `tokenizer.ggml.*` keys).

A GGUF carries no `tokenizer.json`: it stores the vocabulary, the merges, each token's type and
the special token ids, and names the way text is split before BPE (`tokenizer.ggml.pre`). Only
byte-level BPE (`tokenizer.ggml.model` "gpt2", the Llama 3 / Qwen / SmolLM family) is rebuilt;
the splits are llama.cpp's own (llama-vocab.cpp), since llama.cpp is what wrote and runs the file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from rose.model.config import CheckpointError

# GGUF token types (llama.cpp's llama_token_type).
CONTROL, USER_DEFINED = 3, 4

# Qwen2's and Llama 3's split patterns (they differ in digits: one each, or runs of up to three).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's own pattern


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # llama.cpp splits every digit off first ("\p{N}"), then applies GPT-2's pattern.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    return lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.pre -> the pre-tokenizer llama.cpp applies for it.
PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt2": _gpt2,
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r"), _digits_then_gpt2),
    "qwen2": _split(_QWEN2_SPLIT),
    "llama-bpe": _split(_LLAMA3_SPLIT),
}


def required(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise CheckpointError(f"GGUF metadata has no {key!r}, which the import needs")
    return meta[key]


def build_gguf_tokenizer(meta: Mapping[str, Any]) -> HFTokenizer:
    """The byte-level BPE that the metadata `meta` (key -> value) describes.

    Control tokens (`<|im_start|>`, ...) become special added tokens and user-defined ones plain
    added tokens, both matched whole in text as llama.cpp matches them."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"tokenizer.ggml.model {model!r} is not supported; expected 'gpt2' "
                              "(byte-level BPE; SentencePiece vocabularies are not rebuilt)")
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"tokenizer.ggml.pre {pre!r} is not supported; expected one of "
                              f"{', '.join(sorted(PRE_TOKENIZERS))}")
    tokens: list[str] = required(meta, "tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        twice = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise CheckpointError(f"tokenizer.ggml.tokens: {twice!r} appears more than once; "
                              "expected distinct tokens")
    merges = [tuple(m.split(" ")) for m in required(meta, "tokenizer.ggml.merges")]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise CheckpointError(f"tokenizer.ggml.merges: {' '.join(bad)!r} is not two tokens "
                              "separated by one space")
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types, strict=False) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED])
    return tok
