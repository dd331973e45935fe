"""Qwen2/Qwen3 decoder, HF-format checkpoints and tokenizers."""

from rose.model.checkpoint import load_model, save_model
from rose.model.config import CheckpointError, ModelConfig
from rose.model.presets import PRESETS, init_model, preset_config, random_model
from rose.model.qwen import AttentionBackend, QwenForCausalLM
from rose.model.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "PRESETS",
    "AttentionBackend",
    "CheckpointError",
    "ModelConfig",
    "QwenForCausalLM",
    "Tokenizer",
    "init_model",
    "load_model",
    "load_tokenizer",
    "preset_config",
    "random_model",
    "save_model",
]
