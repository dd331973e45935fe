"""LoRA adapters: their settings, their tensors under PEFT's names, PEFT's files, and training.

An adapter adds `scaling * B @ A` to each target linear's weight (`A`: `[rank, in]`, `B`:
`[out, rank]`, `scaling = alpha / rank`), as PEFT's LoRA does. Its tensors are named as in a
PEFT checkpoint less PEFT's `base_model.model.` prefix: `model.layers.0.self_attn.q_proj.lora_A.weight`.
Every layer uses these names: the trainer's `LoRA`, the engines' adapter slots, the weight
transfer engine (`adapter_shapes`), and the files (`save_adapter`, `load_adapter`), which hold
what `peft.PeftModel.from_pretrained` and vLLM's `LoRARequest` load as they are.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from rose.contracts.adapter import LoRAConfig
from rose.model.config import CheckpointError, ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's keys: the wrapped model's module paths behind this
def check_tensors(config: LoRAConfig, model: ModelConfig, tensors: Mapping[str, torch.Tensor],
                  where: str) -> None:
    """ValueError unless `tensors` are exactly the adapter's for a model of `model`: an adapter of
    another base (other shapes, other layers) is refused, naming the first difference."""
    want = config.shapes(model)
    for name, tensor in tensors.items():
        if name not in want:
            raise ValueError(f"{where}: tensor {name!r} is not one of this adapter's on this model "
                             f"({model.num_hidden_layers} layers, targets {', '.join(config.targets)}); "
                             "is it an adapter of another base?")
        if tuple(tensor.shape) != want[name]:
            raise ValueError(f"{where}: {name!r} has shape {tuple(tensor.shape)}, expected {want[name]} "
                             "(an adapter of another base, or of another rank?)")
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise ValueError(f"{where}: {len(missing)} adapter tensor(s) missing, first {missing[0]!r}")


def save_adapter(path: str | Path, config: LoRAConfig, tensors: Mapping[str, torch.Tensor],
                 base: str) -> Path:
    """Write `tensors` as a PEFT adapter directory (`adapter_config.json`,
    `adapter_model.safetensors`) for the base model at `base`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config.to_peft(base), indent=2, sort_keys=True) + "\n")
    save_file({PEFT_PREFIX + name: t.detach().contiguous().cpu() for name, t in tensors.items()},
              str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def load_adapter(path: str | Path) -> tuple[LoRAConfig, dict[str, torch.Tensor], str]:
    """A PEFT adapter directory's settings, tensors (ROSE's names) and base model path."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise CheckpointError(f"{path}: expected a PEFT adapter ({CONFIG_FILE} and {WEIGHTS_FILE})")
    raw = json.loads(config_file.read_text())
    config = LoRAConfig.from_peft(raw, str(config_file))
    tensors = {key.removeprefix(PEFT_PREFIX): t for key, t in load_file(str(weights_file)).items()}
    return config, tensors, str(raw.get("base_model_name_or_path") or "")


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def adapter_base(path: str | Path) -> str:
    """The base model directory a PEFT adapter at `path` names (`base_model_name_or_path`)."""
    base = json.loads((Path(path) / CONFIG_FILE).read_text()).get("base_model_name_or_path") or ""
    if not (Path(base) / "config.json").is_file():
        raise CheckpointError(f"{path}: its base model {base!r} (base_model_name_or_path) is not a "
                              "checkpoint directory here; expected the model the adapter was trained on")
    return base


def check_base(path: str | Path, model: str | Path, where: str) -> None:
    """ValueError unless the adapter at `path` was trained on `model`: its base
    (`base_model_name_or_path`) is that directory, or, for a base that is no directory here (a
    hub id, a path on the training machine), has that directory's name."""
    base = str(json.loads((Path(path) / CONFIG_FILE).read_text()).get("base_model_name_or_path") or "")
    model = Path(model).resolve()
    same = Path(base).resolve() == model if Path(base).is_dir() else Path(base).name == model.name
    if not same:
        raise ValueError(f"{where}: the adapter's base is {base or 'not named'!r} "
                         f"(base_model_name_or_path), the model it would run on {str(model)!r}; expected "
                         "an adapter of that model")


def merged(model: nn.Module, config: LoRAConfig, tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """`model` with the adapter folded into its weights (W + scaling * B @ A, in float32), in place."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in config.modules(model.config):  # type: ignore[arg-type]
            linear = modules[name]
            a, b = tensors[f"{name}.lora_A.weight"].float(), tensors[f"{name}.lora_B.weight"].float()
            linear.weight.copy_((linear.weight.float() + config.scaling * (b @ a)).to(linear.weight.dtype))
    return model


class LoRA(nn.Module):
    """A trainable adapter on a model's target linears: each one's output gains
    `scaling * dropout(x) @ A.T @ B.T` through a forward hook, so the model's modules, names and
    forward stay as they are. Initialised as PEFT does (A Kaiming-uniform, B zero: the adapted
    model starts as the base). `disabled()` switches it off (the KL penalty's reference)."""

    def __init__(self, model: nn.Module, config: LoRAConfig) -> None:
        super().__init__()
        self.config, self.model_config = config, model.config
        paths = config.modules(model.config)  # type: ignore[arg-type]
        modules = dict(model.named_modules())
        self.names = list(paths)
        device = next(model.parameters()).device
        self.lora_A = nn.ParameterList(nn.Parameter(torch.empty(config.rank, fan_in, device=device))
                                       for fan_in, _ in paths.values())
        self.lora_B = nn.ParameterList(nn.Parameter(torch.zeros(fan_out, config.rank, device=device))
                                       for _, fan_out in paths.values())
        for a in self.lora_A:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.dropout = nn.Dropout(config.dropout)
        self.enabled = True
        for i, name in enumerate(self.names):
            modules[name].register_forward_hook(self._hook(i))

    def _hook(self, i: int) -> Any:
        def add(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
            if not self.enabled:
                return None
            a, b = self.lora_A[i], self.lora_B[i]
            # Dropout in the passes that train; a no-grad pass (the old policy's logprobs) is the policy.
            x = self.dropout(args[0]) if torch.is_grad_enabled() else args[0]
            return out + (x @ a.to(x.dtype).t() @ b.to(x.dtype).t()) * self.config.scaling

        return add

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model alone while inside."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, tensor)` of every adapter tensor under ROSE's (PEFT's) names."""
        for name, a, b in zip(self.names, self.lora_A, self.lora_B, strict=True):
            yield f"{name}.lora_A.weight", a
            yield f"{name}.lora_B.weight", b

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy an adapter's tensors (e.g. `load_adapter`'s) into this one."""
        check_tensors(self.config, self.model_config, tensors, "lora")
        with torch.no_grad():
            for name, param in self.named_tensors():
                param.copy_(tensors[name])


def attach(model: nn.Module, config: LoRAConfig) -> LoRA:
    """Freeze `model` and attach a new trainable adapter to it as `model.lora`."""
    model.requires_grad_(False)
    lora = LoRA(model, config)
    model.lora = lora  # a submodule: the policy's forward (DDP) and `.to()` see its parameters
    return lora

