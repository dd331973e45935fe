"""Hugging Face-format checkpoints: `config.json` plus one or several `*.safetensors` files."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rose.model.config import CheckpointError, ModelConfig
from rose.model.decoder import CausalLM, RotaryEmbedding
from rose.model.device import resolve

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


def load_model(path: str | Path, dtype: torch.dtype | str | None = None,
               device: str | torch.device | None = None) -> CausalLM:
    """Load a checkpoint directory (Llama, Qwen2 or Qwen3) onto `device` in `dtype` (None: the
    defaults of `rose.model.device`); any mismatch raises `CheckpointError`."""
    path = Path(path)
    device, dtype = resolve(device, dtype)

    def tensors() -> Iterator[tuple[str, str, torch.Tensor]]:
        for file in _tensor_files(path):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    if not name.endswith(_IGNORED_SUFFIXES):
                        yield file.name, name, f.get_tensor(name)

    return assemble_model(ModelConfig.from_dir(path), tensors(), str(path), dtype, device)


def assemble_model(config: ModelConfig, tensors: Iterable[tuple[str, str, torch.Tensor]], source: str,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """A model of `config` holding `tensors`, `(where, name, tensor)` triples under HF names
    (`where` says in errors which file held it). Every parameter must be given once, in its
    shape; a tied `lm_head.weight` may be given and is dropped."""
    with torch.device("meta"):
        model = CausalLM(config)
    expected = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    loaded: dict[str, torch.Tensor] = {}
    for where, name, tensor in tensors:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding is the head
        if name not in expected:
            raise CheckpointError(f"{where}: unexpected tensor {name!r} for "
                                  f"{config.model_type} (not in the model definition)")
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{where}: tensor {name!r} has shape "
                                  f"{tuple(tensor.shape)}, expected {want}")
        loaded[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{source}: missing tensor(s) {', '.join(missing[:5])}{more}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers (rotary frequencies) were built on meta: rebuild them for real.
    model.model.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta).to(device)
    return model.eval()


def fsync_file(path: Path) -> None:
    """Flush a written file to the disk (a crash after this keeps its bytes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames into it survive a crash)."""
    fsync_file(path)


def _write(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a sibling temporary name, flush, then rename over `path`: readers see the
    old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    fsync_file(tmp)
    os.replace(tmp, path)


def save_model(model: CausalLM, path: str | Path, max_shard_bytes: int = 2 * 1024**3,
               state: dict[str, torch.Tensor] | None = None) -> None:
    """Write `config.json` and safetensors (sharded with an index past `max_shard_bytes`).

    Each file replaces its old version whole, and stale shards go only once the new ones are
    in place, so an interrupted save never leaves `path` without weights. A checkpoint that must
    change as one (weights, optimizer state) is written to a fresh directory and renamed
    (`Trainer.save`). `state`: the model's state dict gathered elsewhere (from FSDP shards)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.checkpoint_state_dict(state).items()}
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    metadata = {"format": "pt"}
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    for fname, shard in zip(names, shards, strict=True):
        _write(path / fname, lambda tmp, shard=shard: save_file(shard, str(tmp), metadata=metadata))
    if len(shards) > 1:
        weight_map = {name: fname for fname, shard in zip(names, shards, strict=True) for name in shard}
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        _write(path / INDEX_FILE, lambda tmp: tmp.write_text(index))
    config = json.dumps(model.config.to_hf(dtype), indent=2) + "\n"
    _write(path / "config.json", lambda tmp: tmp.write_text(config))
    stale = [f for f in path.glob("*.safetensors") if f.name not in names]
    if len(shards) == 1:
        stale.append(path / INDEX_FILE)
    for f in stale:
        f.unlink(missing_ok=True)
    fsync_dir(path)
