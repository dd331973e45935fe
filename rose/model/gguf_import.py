"""`rose import-gguf`: a GGUF file (llama.cpp's format) into this project's HF-format checkpoint.

Every tensor is dequantised to float32 with the `gguf` package (whatever GGML types it
implements), renamed from llama.cpp's names (`blk.N.attn_q.weight`) to HF's, and for Llama the
query and key rows are put back in HF's order: llama.cpp's converter interleaves the two rotary
halves of every head for its own RoPE kernel (`permute` in its convert_hf_to_gguf.py), which
Qwen2 and Qwen3 files are spared. The config comes from the `{architecture}.*` metadata, the
tokenizer from `tokenizer.ggml.*` (`rose.model.gguf_tokenizer`), the chat template from
`tokenizer.chat_template`.
"""

from __future__ import annotations

import argparse
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from rose.model.checkpoint import assemble_model, save_model
from rose.model.config import CheckpointError, ModelConfig
from rose.model.device import DTYPES
from rose.model.gguf_tokenizer import build_gguf_tokenizer, required
from rose.model.tokenizer import CHAT_TEMPLATE, Tokenizer

# general.architecture (the same name as HF's model_type) -> whether llama.cpp permuted q/k rows.
PERMUTED_QK = {"llama": True, "qwen2": False, "qwen3": False}

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """HF's name for a llama.cpp tensor name, or None when a Llama/Qwen decoder has no such tensor."""
    m = _GGUF_NAME.fullmatch(gguf_name)
    if m is None:
        return None
    layer, part, kind = m.groups()
    table = _TOP_NAMES if layer is None else _LAYER_NAMES
    if part not in table:
        return None
    return f"{'' if layer is None else f'model.layers.{layer}.'}{table[part]}.{kind}"


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's row order from llama.cpp's: within each head llama.cpp stores the rows of the two
    rotary halves interleaved (0, d/2, 1, d/2 + 1, ...), HF stores them as two blocks."""
    head_dim = w.shape[0] // heads
    return w.reshape(heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_REQUIRED = object()


def _uniform_value(meta: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """A metadata value that llama.cpp may write per layer: it must be the same for all."""
    value = required(meta, key) if default is _REQUIRED else meta.get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise CheckpointError(f"{key} differs between layers ({value}); expected one value")
        value = value[0]
    return value


def gguf_config(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> ModelConfig:
    """The model config of a GGUF's metadata `meta` and tensor shapes `shapes` (HF order);
    refuses what the decoder does not implement, naming the key."""
    arch = meta.get("general.architecture")
    if arch not in PERMUTED_QK:
        raise CheckpointError(f"general.architecture {arch!r} is not supported; expected one of "
                              f"{', '.join(PERMUTED_QK)}")

    def key(name: str, default: Any = _REQUIRED) -> Any:
        return _uniform_value(meta, f"{arch}.{name}", default)

    if key("expert_count", 0):
        raise CheckpointError(f"{arch}.expert_count is {key('expert_count')}: mixture-of-experts "
                              "models are not supported; expected a dense MLP")
    scaling = key("rope.scaling.type", "none")
    if scaling != "none":
        raise CheckpointError(f"{arch}.rope.scaling.type {scaling!r} is not supported; expected "
                              "'none' (plain rotary embeddings)")
    if "rope_freqs.weight" in shapes:
        raise CheckpointError("tensor 'rope_freqs.weight' (per-dimension rotary frequency factors, "
                              "Llama 3.1-style rope scaling) is not supported; "
                              "expected plain rotary embeddings")
    if f"{arch}.attention.sliding_window" in meta:
        raise CheckpointError(f"{arch}.attention.sliding_window: sliding-window attention is not "
                              "supported; expected full attention only")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    for other in ("attention.value_length", "rope.dimension_count"):
        if key(other, head_dim) != head_dim:
            raise CheckpointError(f"{arch}.{other} is {key(other)}, expected the head size {head_dim} "
                                  "(partial rotary embeddings and value heads of another size are "
                                  "not supported)")
    if "token_embd.weight" not in shapes:
        raise CheckpointError("no tensor 'token_embd.weight'; expected the token embeddings")
    return ModelConfig(
        model_type=arch,
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=key("context_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_theta=float(key("rope.freq_base", 10_000.0)),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias=arch != "qwen2" and "blk.0.attn_q.bias" in shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def gguf_tokenizer(meta: Mapping[str, Any], vocab_rows: int) -> Tokenizer:
    """The tokenizer, its special tokens and chat template; the vocabulary must fit the embedding."""
    tok = build_gguf_tokenizer(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    if len(tokens) > vocab_rows:
        raise CheckpointError(f"tokenizer.ggml.tokens has {len(tokens)} tokens but token_embd.weight "
                              f"only {vocab_rows} rows; expected at most one token per row")

    def special(name: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{name}")
        if idx is not None and not 0 <= idx < len(tokens):
            raise CheckpointError(f"tokenizer.ggml.{name} {idx} is not a token id (0..{len(tokens) - 1})")
        return None if idx is None else tokens[idx]

    eos = special("eos_token_id")
    if eos is None:
        raise CheckpointError("GGUF metadata has no 'tokenizer.ggml.eos_token_id'; expected the "
                              "end-of-sequence token")
    template = meta.get("tokenizer.chat_template")
    if template is None:
        warnings.warn("GGUF metadata has no 'tokenizer.chat_template'; ChatML is assumed", stacklevel=2)
    return Tokenizer(tok, template or CHAT_TEMPLATE, eos, special("padding_token_id") or eos,
                     special("bos_token_id"))


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; expected a .gguf file")
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as exc:  # what a damaged file raises in the reader
        raise CheckpointError(f"{path}: not a GGUF file the gguf package can read ({exc})") from exc


def _hf_shape(t: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))  # GGML lists dimensions innermost first


def _tensors(reader: GGUFReader, path: Path, config: ModelConfig
             ) -> Iterator[tuple[str, str, torch.Tensor]]:
    """`(where, HF name, float32 tensor)` for every tensor of the file, dequantised one by one."""
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for t in reader.tensors:
        where = f"{path.name}[{t.name}]"
        name = hf_name(t.name)
        if name is None:
            raise CheckpointError(f"{where}: no tensor of a {config.model_type} decoder has this name")
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise CheckpointError(f"{where}: the gguf package cannot dequantise GGML type "
                                  f"{t.tensor_type.name} ({exc})") from exc
        w = torch.from_numpy(np.array(values, dtype=np.float32).reshape(_hf_shape(t)))
        proj = name.split(".")[-2]
        # (a shape that cannot be unpermuted is wrong anyway: assemble_model names it)
        if PERMUTED_QK[config.model_type] and proj in heads and w.shape[0] % (2 * heads[proj]) == 0:
            w = unpermute_rows(w, heads[proj])
        yield where, name, w


def _read_config(reader: GGUFReader) -> tuple[dict[str, Any], ModelConfig]:
    meta = {name: field.contents() for name, field in reader.fields.items()}
    return meta, gguf_config(meta, {t.name: _hf_shape(t) for t in reader.tensors})


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The model config of the GGUF file `path`, from its metadata alone (no tensor is read)."""
    return _read_config(_open(Path(path)))[1]


def import_gguf(path: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the GGUF file `path` to `out` as `config.json`, safetensors in `dtype`, and the
    tokenizer files (`tokenizer.json`, `tokenizer_config.json` with the chat template,
    `generation_config.json`); return `out`."""
    path, out = Path(path), Path(out)
    reader = _open(path)
    meta, config = _read_config(reader)
    tok = gguf_tokenizer(meta, config.vocab_size)
    model = assemble_model(config, _tensors(reader, path, config), str(path), dtype)
    save_model(model, out)
    tok.save(out, config.max_position_embeddings)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a .gguf file: Llama, Qwen2 or Qwen3, with a byte-level BPE vocabulary")
    p.add_argument("--out", required=True, help="output directory (HF format)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="the weights' dtype once dequantised (default: float32)")


def run(args: argparse.Namespace) -> int:
    out = import_gguf(args.file, args.out, DTYPES[args.dtype])
    print(f"wrote {args.file} to {out} as an HF-format checkpoint ({args.dtype})")
    return 0
