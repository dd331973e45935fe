"""Checkpoints vLLM's CPU build can run, for the tests that use it."""

from __future__ import annotations

from pathlib import Path

from rose.model import Tokenizer, preset_config, random_model, save_model
from rose.model.tokenizer import build_tokenizer


def tiny_qwen3_for_vllm(root: Path, seed: int) -> Path:
    """The tiny Qwen3 preset with head_dim 32 (vLLM's CPU attention takes no smaller), weights of
    std 0.15 for peaked, varied generations, and its tokenizer (vLLM loads one)."""
    config = preset_config("qwen3", "tiny", head_dim=32)
    save_model(random_model(config, seed, std=0.15), root)
    Tokenizer(build_tokenizer(config.vocab_size)).save(root, config.max_position_embeddings)
    return root
