"""Checkpoint loading errors, the training forward, the tokenizer and `rose init-model`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from rose.model import (
    CheckpointError,
    init_model,
    load_model,
    load_tokenizer,
    preset_config,
    random_model,
)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(model_type="gemma"), "model_type 'gemma' is not supported"),
        (dict(use_sliding_window=True, sliding_window=128), "sliding-window"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling of type 'yarn'"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling of type 'llama3'"),
        (dict(mlp_bias=True), "mlp_bias true is not supported"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    ],
)
def test_unsupported_config_is_refused_by_name(tmp_path: Path, tiny_qwen3: Path,
                                               changes: dict, message: str) -> None:
    path = _copy(tiny_qwen3, tmp_path / "ckpt")
    _edit_config(path, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_model(path)


def test_missing_and_misshapen_tensors_are_named(tmp_path: Path, tiny_qwen3: Path) -> None:
    path = _copy(tiny_qwen3, tmp_path / "ckpt")
    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != name}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.up_proj"):
        load_model(path)
    state[name] = state[name][:, :-1].contiguous()
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' has shape"):
        load_model(path)
    state.pop(name)
    state["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        load_model(path)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_model(tmp_path)


def test_bf16_checkpoint_upcasts(tmp_path: Path) -> None:
    model = random_model(preset_config("qwen3", "tiny"), seed=2).to(torch.bfloat16)
    from rose.model import save_model

    save_model(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_model(tmp_path, dtype=torch.float32)
    assert loaded.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.float())


def test_training_forward_with_activation_checkpointing(tiny_qwen2: Path) -> None:
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    grads = []
    for ckpt in (False, True):
        model = load_model(tiny_qwen2).train()
        model.set_gradient_checkpointing(ckpt)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), ids[:, 1:].reshape(-1))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7, msg=name)
    assert grads[0]["model.layers.0.self_attn.k_proj.bias"].abs().sum() > 0


def test_tokenizer_matches_transformers(tiny_qwen3: Path) -> None:
    ours = load_tokenizer(tiny_qwen3)
    ref = transformers.AutoTokenizer.from_pretrained(tiny_qwen3)
    text = "You are playing FrozenLake.\nAnswer <action>Right</action> ünïcödé 🚀 42"
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert ref.eos_token_id == ours.eos_token_id
    assert ours.vocab_size <= json.loads((tiny_qwen3 / "config.json").read_text())["vocab_size"]


def test_presets_sizes(tmp_path: Path) -> None:
    tiny = random_model(preset_config("qwen3", "tiny"))
    assert sum(p.numel() for p in tiny.parameters()) < 1_000_000
    small = random_model(preset_config("qwen3", "small"))
    assert 20e6 < sum(p.numel() for p in small.parameters()) < 60e6
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        init_model("qwen3", "huge", tmp_path)


def test_cli_init_model_then_transformers_loads(tmp_path: Path) -> None:
    out = tmp_path / "x"
    subprocess.run([sys.executable, "-m", "rose.cli", "init-model", "--arch", "qwen3",
                    "--preset", "tiny", "--out", str(out), "--seed", "7"], check=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert (hf(ids).logits - load_model(out)(ids)).abs().max() <= 1e-4
    bad = subprocess.run([sys.executable, "-m", "rose.cli", "generate", "--model",
                          str(tmp_path / "nope"), "--prompt", "hi"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "no config.json" in bad.stderr
