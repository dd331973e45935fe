"""The Llama / Qwen2 / Qwen3 decoder-only transformer in plain PyTorch.

The three differ only in switches of `ModelConfig` (attention biases, Qwen3's q/k norms), so one
definition serves all of them, for training and inference alike. Module and parameter names
mirror Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...) so checkpoints load without
renaming. The attention core is pluggable: with no `attn` argument a layer runs causal SDPA
over `[B, T]` (the training path); the engine passes an `AttentionBackend` that owns the paged KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rose.model.config import ModelConfig


class AttentionBackend(Protocol):
    """What the engine plugs into every attention layer.

    `q` is `[B, T, H, D]`, `k` and `v` are `[B, T, KV, D]`, already normed and rotated; the
    backend stores `k`/`v` for `layer` and returns the attention output `[B, T, H, D]`.
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as the reference does, so that
        # bf16 results round the same way.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[B, T, D]` for integer positions `[B, T]`, computed in float32."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[B, T, heads, D]` by `cos`/`sin` `[B, T, D]`."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if attn is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads,
            ).transpose(1, 2)
        else:
            out = attn(self.layer, q, k, v)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The decoder stack: embeddings, layers, final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.gradient_checkpointing = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn: AttentionBackend | None = None,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """Final hidden states `[B, T, hidden]`; positions default to `0..T-1` per row.
        `between_layers` runs before each layer (it may raise to give up the forward)."""
        x = self.embed_tokens(input_ids)
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            if between_layers is not None:
                between_layers()
            if self.gradient_checkpointing and self.training and attn is None:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn)
        return self.norm(x)


class CausalLM(nn.Module):
    """`model(input_ids)` -> logits `[B, T, vocab]`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn: AttentionBackend | None = None) -> torch.Tensor:
        return self.lm_head(self.model(input_ids, positions, attn))

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each layer's activations in backward: less memory, about 30% more compute."""
        self.model.gradient_checkpointing = enabled

    def checkpoint_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Parameters (or `state`, this model's state dict gathered elsewhere) under their
        checkpoint names; a tied lm_head is stored once, as HF does."""
        state = dict(self.state_dict() if state is None else state)
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state
