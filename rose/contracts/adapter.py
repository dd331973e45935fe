"""A LoRA adapter's settings (`LoRAConfig`): what every layer that trains, moves or runs one
agrees on. Its tensors, files and training are `rose.model.lora`'s."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

# The attention and MLP projections of every layer: PEFT's names for them on Llama and Qwen.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The linears of a decoder layer, by module path below `model.layers.N.`, and their shapes
# (in, out) from the config: what a target may name.
_LAYER_LINEARS = {
    "self_attn.q_proj": lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim),
    "self_attn.k_proj": lambda c: (c.hidden_size, c.num_key_value_heads * c.head_dim),
    "self_attn.v_proj": lambda c: (c.hidden_size, c.num_key_value_heads * c.head_dim),
    "self_attn.o_proj": lambda c: (c.num_attention_heads * c.head_dim, c.hidden_size),
    "mlp.gate_proj": lambda c: (c.hidden_size, c.intermediate_size),
    "mlp.up_proj": lambda c: (c.hidden_size, c.intermediate_size),
    "mlp.down_proj": lambda c: (c.intermediate_size, c.hidden_size),
}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """`model.lora` of `rose train`: the adapter's rank, its `alpha` (scaling alpha / rank), the
    dropout on its input while training, and the linears it targets by module name (the last
    part of the path, as PEFT's `target_modules`: `q_proj`, ...)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not (
                math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"alpha must be a number > 0, got {self.alpha!r}")
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"targets must be a non-empty list of module names, "
                             f"got {list(self.targets)!r}")
        object.__setattr__(self, "targets", tuple(sorted(set(self.targets))))  # a set, as PEFT's

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def modules(self, config: Any) -> dict[str, tuple[int, int]]:
        """The targeted linears' module paths and their (in, out) features, in layer order, on a
        model of `config` (a `rose.model.ModelConfig`).
        ValueError when a target names no linear of the model, or the rank exceeds a layer's
        smaller side (the product would be no low-rank update)."""
        known = {path.rsplit(".", 1)[-1] for path in _LAYER_LINEARS}
        unknown = [t for t in self.targets if t not in known]
        if unknown:
            raise ValueError(f"targets: {unknown[0]!r} names no module of the model; expected some of "
                             f"{', '.join(sorted(known))}")
        out = {}
        for layer in range(config.num_hidden_layers):
            for path, shape in _LAYER_LINEARS.items():
                if path.rsplit(".", 1)[-1] in self.targets:
                    out[f"model.layers.{layer}.{path}"] = shape(config)
        smallest = min(min(s) for s in out.values())
        if self.rank > smallest:
            raise ValueError(f"rank {self.rank} is larger than the smallest targeted layer's "
                             f"{smallest} features; expected at most {smallest}")
        return out

    def shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """Every adapter tensor's name and shape on a model of `config`."""
        out: dict[str, tuple[int, ...]] = {}
        for module, (fan_in, fan_out) in self.modules(config).items():
            out[f"{module}.lora_A.weight"] = (self.rank, fan_in)
            out[f"{module}.lora_B.weight"] = (fan_out, self.rank)
        return out

    def to_peft(self, base: str) -> dict[str, Any]:
        """`adapter_config.json`'s contents (PEFT's `LoraConfig`) for an adapter of the model at `base`."""
        from peft import LoraConfig

        config = LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                            target_modules=list(self.targets), bias="none", task_type="CAUSAL_LM",
                            base_model_name_or_path=base)
        # As PEFT's own save_pretrained writes it: its sets as lists.
        return {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}

    @classmethod
    def from_peft(cls, raw: Mapping[str, Any], where: str) -> LoRAConfig:
        """The settings of a PEFT `adapter_config.json` (`where` names it in errors); what ROSE
        cannot run (another PEFT method, biases, rsLoRA, per-layer ranks, DoRA) is refused."""
        if raw.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{where}: peft_type {raw.get('peft_type')!r}; expected LORA")
        unsupported = [key for key, ok in (("bias", raw.get("bias", "none") == "none"),
                                           ("use_rslora", not raw.get("use_rslora")),
                                           ("use_dora", not raw.get("use_dora")),
                                           ("rank_pattern", not raw.get("rank_pattern")),
                                           ("alpha_pattern", not raw.get("alpha_pattern")),
                                           ("modules_to_save", not raw.get("modules_to_save")))
                       if not ok]
        if unsupported:
            raise ValueError(f"{where}: {unsupported[0]}={raw.get(unsupported[0])!r} is not supported; "
                                  "expected a plain LoRA adapter (bias none, one rank and alpha)")
        targets = raw.get("target_modules")
        if isinstance(targets, str):  # PEFT's regex form
            raise ValueError(f"{where}: target_modules as a regex ({targets!r}) is not supported; "
                                  "expected a list of module names")
        try:
            return cls(rank=raw["r"], alpha=raw["lora_alpha"], dropout=raw.get("lora_dropout", 0.0),
                       targets=tuple(targets or ()))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
