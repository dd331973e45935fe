"""Small GGUF files written the way llama.cpp's converter writes them, for the import tests.

Tensor names come from the `gguf` package's own name map (llama.cpp's), and Llama's query/key
rows are permuted as llama.cpp's `permute` does, so that the importer is checked against both
rather than against its own tables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from rose.model import CausalLM

F32 = gguf.GGMLQuantizationType.F32
_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
# llama.cpp's token types: normal and control.
_NORMAL, _CONTROL = 1, 3


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order of a head's rows: its two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def metadata(model: CausalLM, checkpoint: Path, pre: str = "gpt2") -> dict[str, Any]:
    """The metadata llama.cpp writes for `model` with the tokenizer files of `checkpoint`."""
    c, arch = model.config, model.config.model_type
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    control = {t["content"] for t in tok["added_tokens"] if t["special"]}
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    return {
        f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.block_count": c.num_hidden_layers,
        f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.attention.key_length": c.head_dim,
        f"{arch}.attention.value_length": c.head_dim,
        f"{arch}.rope.dimension_count": c.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        f"{arch}.rope.freq_base": c.rope_theta,
        f"{arch}.vocab_size": c.vocab_size,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [_CONTROL if t in control else _NORMAL for t in tokens],
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]],
        "tokenizer.ggml.eos_token_id": vocab[config["eos_token"]],
        "tokenizer.ggml.padding_token_id": vocab[config["pad_token"]],
        "tokenizer.chat_template": config["chat_template"],
    }


def tensors(model: CausalLM, qtype: gguf.GGMLQuantizationType = F32
            ) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """`model`'s tensors under llama.cpp's names; matrices quantised to `qtype`, norms in F32."""
    c = model.config
    names = gguf.get_tensor_name_map(_ARCHS[c.model_type], c.num_hidden_layers)
    heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}
    out = {}
    for name, w in model.checkpoint_state_dict().items():
        proj = name.split(".")[-2]
        if c.model_type == "llama" and proj in heads:
            w = llama_cpp_permute(w, heads[proj])
        values = w.detach().float().numpy()
        quantised = qtype != F32 and values.ndim == 2
        out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = (
            (gguf.quants.quantize(values, qtype), qtype) if quantised else (values, F32))
    return out


def write_gguf(path: Path, arch: str, meta: dict[str, Any],
               data: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    for key, value in meta.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_array(key, value)
    for name, (values, qtype) in data.items():
        writer.add_tensor(name, values, raw_dtype=None if qtype == F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
