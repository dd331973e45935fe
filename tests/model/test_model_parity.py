"""ROSE's decoder against Hugging Face `transformers` on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from rose.model import load_model, preset_config, random_model, save_model

# (arch, overrides): GQA ratios 1, 2 and 4+, tied/untied, Qwen2 biases, Qwen3 q/k norm and
# attention_bias, Llama without and with attention_bias, head dims that are not hidden/heads.
SHAPES = [
    ("qwen3", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                   tie_word_embeddings=False)),
    ("qwen3", dict(num_attention_heads=8, num_key_value_heads=1, head_dim=12, attention_bias=True)),
    ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False)),
    ("qwen2", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=10, hidden_size=60,
                   tie_word_embeddings=True)),
    ("llama", dict(num_attention_heads=9, num_key_value_heads=3, head_dim=8, hidden_size=72,
                   tie_word_embeddings=True)),
    ("llama", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=20, attention_bias=True,
                   tie_word_embeddings=False)),
]
IDS = [f"{arch}-h{o['num_attention_heads']}kv{o['num_key_value_heads']}" for arch, o in SHAPES]


def _hf(path: Path, dtype: torch.dtype) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _write(tmp_path: Path, arch: str, overrides: dict, seed: int = 0) -> Path:
    config = preset_config(arch, "tiny", rope_theta=10_000.0 + 17 * seed, **overrides)
    save_model(random_model(config, seed), tmp_path)
    return tmp_path


def _batch(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 41), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("arch", "overrides"), SHAPES, ids=IDS)
def test_logits_match_transformers_fp32(tmp_path: Path, arch: str, overrides: dict) -> None:
    path = _write(tmp_path, arch, overrides)
    ids = _batch(512)
    with torch.no_grad():
        ours = load_model(path)(ids)
        ref = _hf(path, torch.float32)(ids).logits
    assert ours.shape == (3, 41, 512)
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("arch", "overrides"), SHAPES[1:4], ids=IDS[1:4])
def test_logits_bf16_as_close_to_fp32_as_transformers_is(tmp_path: Path, arch: str,
                                                          overrides: dict) -> None:
    """bf16 keeps 8 mantissa bits, so both implementations drift from the fp32 truth by about
    2^-8 relative per op; the fair tolerance is "no further from fp32 than HF's own bf16 run"
    (with 25% slack for a different order of the same roundings)."""
    path = _write(tmp_path, arch, overrides, seed=3)
    ids = _batch(512, seed=1)
    with torch.no_grad():
        truth = _hf(path, torch.float32)(ids).logits
        ours = load_model(path, dtype=torch.bfloat16)(ids).float()
        ref = _hf(path, torch.bfloat16)(ids).logits.float()
    ours_err = (ours - truth).abs().max().item()
    ref_err = (ref - truth).abs().max().item()
    assert ours_err <= 1.25 * ref_err + 1e-3, (ours_err, ref_err)
    assert (ours - ref).abs().max().item() <= 2 * ref_err + 1e-3


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_transformers_saved_checkpoint_loads(tmp_path: Path, arch: str) -> None:
    """Files written by transformers itself (its initialiser, its writer) load in ROSE."""
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "llama": transformers.LlamaConfig}[arch]
    config = cls(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                 max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path)
    ids = _batch(300)
    with torch.no_grad():
        diff = (load_model(tmp_path)(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4


def test_round_trip_rose_saved_loads_in_transformers(tmp_path: Path, tiny_qwen3: Path) -> None:
    model = load_model(tiny_qwen3)
    save_model(model, tmp_path / "again")
    ids = _batch(512, seed=2)
    with torch.no_grad():
        ours = model(ids)
        ref = _hf(tmp_path / "again", torch.float32)(ids).logits
        reloaded = load_model(tmp_path / "again")(ids)
    assert torch.equal(ours, reloaded)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_sharded_checkpoint_with_index(tmp_path: Path) -> None:
    config = preset_config("qwen2", "tiny", tie_word_embeddings=False)
    model = random_model(config, seed=5)
    save_model(model, tmp_path, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = _batch(512)
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path)(ids), model(ids))
        ref = _hf(tmp_path, torch.float32)(ids).logits
    assert (model(ids) - ref).abs().max().item() <= 1e-4
