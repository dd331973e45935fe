"""Llama / Qwen2 / Qwen3 decoder, HF-format checkpoints and tokenizers (GGUF files: `gguf_import`)."""

from rose.model.checkpoint import load_model, save_model
from rose.model.config import CheckpointError, ModelConfig
from rose.model.decoder import AttentionBackend, CausalLM
from rose.model.presets import PRESETS, init_model, preset_config, random_model
from rose.model.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "PRESETS",
    "AttentionBackend",
    "CausalLM",
    "CheckpointError",
    "ModelConfig",
    "Tokenizer",
    "init_model",
    "load_model",
    "load_tokenizer",
    "preset_config",
    "random_model",
    "save_model",
]
