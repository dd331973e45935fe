"""The decoder's forward for CPU float32 inference: fused projections and C++ element-wise steps.

`rose.model.decoder` is the model as Hugging Face writes it, one PyTorch op per step, which the
trainer differentiates through. Serving a small model on a CPU, the dispatch of those ops costs
as much as the products: a 32-sequence decode iteration of SmolLM2-135M spent 21 of its 114 ms
in norms, RoPE, residual adds, SiLU, the K/V store and their Python (docs/engine.md). This
forward runs the same computation as vLLM's CPU backend lays it out: per layer four products on
oneDNN (q, k and v as one; gate and up as one) and three steps of `csrc/cpu_ops.cpp` (the
residual add with RMSNorm; q/k norms with RoPE and the K/V store; SiLU times up), the residual
stream carried beside the hidden state. It reads the model's own parameters, repacking a
product when a weight changes (`PackedLinear`), so weight loads need nothing more. LoRA adapters'
products are added to each packed product's output, each to its linear's columns (`lora.Rows`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rose.engine import cpu_kernels
from rose.engine.attention import PagedAttention
from rose.engine.cpu_linear import PackedLinear
from rose.engine.cpu_linear import available as packable
from rose.engine.lora import Part, Rows
from rose.model.decoder import CausalLM, DecoderLayer


def available(model: CausalLM, attention: PagedAttention) -> bool:
    """CPU float32 with the C++ kernels (the `cpu` attention backend means they build here)."""
    return attention.backend == "cpu" and packable(model.lm_head.weight)


class _Layer:
    def __init__(self, layer: DecoderLayer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.index = attn.layer
        self.qkv = PackedLinear(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = PackedLinear(attn.o_proj)
        self.gate_up = PackedLinear(mlp.gate_proj, mlp.up_proj)
        self.down_proj = PackedLinear(mlp.down_proj)
        self.input_norm = layer.input_layernorm
        self.post_attention_norm = layer.post_attention_layernorm
        self.qk_norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None
        # Each product's linears by module path, and their columns in its output (LoRA's).
        attn_path, mlp_path = f"model.layers.{self.index}.self_attn", f"model.layers.{self.index}.mlp"
        self.qkv_parts = _parts(attn_path, attn, ("q_proj", "k_proj", "v_proj"))
        self.o_parts = _parts(attn_path, attn, ("o_proj",))
        self.gate_up_parts = _parts(mlp_path, mlp, ("gate_proj", "up_proj"))
        self.down_parts = _parts(mlp_path, mlp, ("down_proj",))


def _parts(path: str, block: torch.nn.Module, names: tuple[str, ...]) -> tuple[Part, ...]:
    """The linears `names` of the block at `path`, side by side in one product's output."""
    parts, start = [], 0
    for name in names:
        width = getattr(block, name).out_features
        parts.append((f"{path}.{name}", slice(start, start + width)))
        start += width
    return tuple(parts)


class FusedForward:
    def __init__(self, model: CausalLM, attention: PagedAttention) -> None:
        cpu_kernels.load()
        config = model.config
        self.model, self.attention = model, attention
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        self.eps = config.rms_norm_eps
        self.layers = [_Layer(layer) for layer in model.model.layers]  # type: ignore[arg-type]
        self.lm_head = PackedLinear(model.lm_head)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, between_layers: Callable[[], None],
                 lora: Rows | None = None) -> torch.Tensor:
        """The final hidden states `[T, hidden]` of tokens `ids` at `positions` (both `[T]`),
        their K/V stored where `attention.prepare` put their slots; `lora`: the adapters' rows."""
        ops, attention, decoder = torch.ops.rose, self.attention, self.model.model
        cos, sin = (t[0].contiguous() for t in decoder.rotary_emb(positions[None], torch.float32))
        slot_rows = attention.slot_pages * attention.rows_per_page
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        residual = decoder.embed_tokens(ids)  # the residual stream; x: what each block adds to it
        x = torch.zeros_like(residual)
        for layer in self.layers:
            between_layers()
            ops.add_rms_norm(x, residual, layer.input_norm.weight, self.eps, x)
            qkv = layer.qkv(x)
            if lora is not None:
                lora.add(x, qkv, layer.qkv_parts)
            q_norm, k_norm = (norm.weight for norm in layer.qk_norms) if layer.qk_norms else (None, None)
            ops.rope_store(qkv, heads, kv_heads, cos, sin, q_norm, k_norm, self.eps, attention.rows,
                           slot_rows + layer.index * 2 * kv_heads, attention.slot_offsets)
            q, k, v = qkv.view(-1, heads + 2 * kv_heads, dim).split((heads, kv_heads, kv_heads), 1)
            attended = attention.attend(layer.index, q, k, v).reshape(-1, heads * dim)
            x = layer.o_proj(attended)
            if lora is not None:
                lora.add(attended, x, layer.o_parts)
            ops.add_rms_norm(x, residual, layer.post_attention_norm.weight, self.eps, x)
            gate_up = layer.gate_up(x)
            if lora is not None:
                lora.add(x, gate_up, layer.gate_up_parts)
            gated = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            ops.silu_mul(gate_up, gated)
            x = layer.down_proj(gated)
            if lora is not None:
                lora.add(gated, x, layer.down_parts)
        ops.add_rms_norm(x, residual, decoder.norm.weight, self.eps, x)
        return x
