"""Random-initialised checkpoints of fixed shapes, for tests (`tiny`) and CPU benchmarks (`small`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from rose.model.checkpoint import save_model
from rose.model.config import SUPPORTED_MODEL_TYPES, ModelConfig
from rose.model.decoder import CausalLM
from rose.model.tokenizer import Tokenizer, build_tokenizer

# tiny: ~0.1 M parameters, milliseconds per forward. small: the 34 M-parameter shape of the
# design's reference figures (hidden 512, 8 layers, 8 heads, 4 KV heads, head dim 64, vocab 8192).
PRESETS: dict[str, dict[str, int | bool]] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=2048, tie_word_embeddings=True),
    "small": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  max_position_embeddings=4096, tie_word_embeddings=False),
}
ARCHS = SUPPORTED_MODEL_TYPES


def preset_config(arch: str, preset: str, **overrides: int | bool) -> ModelConfig:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    return ModelConfig(model_type=arch, **{**PRESETS[preset], **overrides})


def random_model(config: ModelConfig, seed: int = 0, std: float = 0.02) -> CausalLM:
    """Weights and biases drawn normal with `std` (HF's initialiser range by default), norms
    at 1. Tests use a larger std for peakier, more varied generations."""
    gen = torch.Generator().manual_seed(seed)
    model = CausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()


def init_model(arch: str, preset: str, out: str | Path, seed: int = 0,
               **overrides: int | bool) -> Path:
    """Write a random `arch`/`preset` checkpoint with its tokenizer to `out`; return the path."""
    out = Path(out)
    config = preset_config(arch, preset, **overrides)
    tok = Tokenizer(build_tokenizer(config.vocab_size))
    config = dataclasses.replace(config, eos_token_id=tok.eos_token_id)
    save_model(random_model(config, seed), out)
    tok.save(out, config.max_position_embeddings)
    return out
