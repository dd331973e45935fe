"""Hugging Face-format checkpoints: `config.json` plus one or several `*.safetensors` files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rose.model.config import CheckpointError, ModelConfig
from rose.model.qwen import QwenForCausalLM, RotaryEmbedding

INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters write that carry no learned state.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _tensor_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: expected JSON with a 'weight_map' ({exc})") from exc
        files = [path / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} names missing file(s): {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files; expected HF-format weights")
    return files


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> QwenForCausalLM:
    """Load a Qwen2/Qwen3 checkpoint directory; any mismatch raises `CheckpointError`."""
    path = Path(path)
    config = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = QwenForCausalLM(config)
    expected = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    loaded: dict[str, torch.Tensor] = {}
    for file in _tensor_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                if name not in expected:
                    raise CheckpointError(f"{file.name}: unexpected tensor {name!r} for "
                                          f"{config.model_type} (not in the model definition)")
                tensor = f.get_tensor(name)
                want = tuple(expected[name].shape)
                if tuple(tensor.shape) != want:
                    raise CheckpointError(f"{file.name}: tensor {name!r} has shape "
                                          f"{tuple(tensor.shape)}, expected {want}")
                loaded[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])}{more}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers (rotary frequencies) were built on meta: rebuild them for real.
    model.model.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta).to(device)
    return model.eval()


def save_model(model: QwenForCausalLM, path: str | Path,
               max_shard_bytes: int = 2 * 1024**3) -> None:
    """Write `config.json` and safetensors (sharded with an index past `max_shard_bytes`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.checkpoint_state_dict().items()}
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(model.config.to_hf(dtype), indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for stale in [*path.glob("*.safetensors"), path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
