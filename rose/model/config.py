"""The decoder's configuration, read from and written to Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# model_type -> the transformers class that reads the same config.json.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


class CheckpointError(ValueError):
    """A checkpoint directory, its config or its tensors do not match what ROSE can load."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    # Qwen2 always has q/k/v biases (and never an o_proj one); Llama and Qwen3 bias all four
    # projections when this is set.
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"config.json: model_type {self.model_type!r} is not supported; "
                f"expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CheckpointError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"config.json: head_dim must be even for rotary embeddings, "
                                  f"got {self.head_dim}")

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.model_type != "qwen2" and self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Validate a Hugging Face config dict; refuse features the model does not implement."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"config.json: model_type {model_type!r} is not supported; "
                f"expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"config.json: hidden_act {act!r} is not supported; expected 'silu'")
        if raw.get("mlp_bias"):
            raise CheckpointError("config.json: mlp_bias true is not supported; "
                                  "expected an MLP without biases")
        sliding = [t for t in raw.get("layer_types") or [] if t != "full_attention"]
        if raw.get("use_sliding_window") or sliding:
            raise CheckpointError("config.json: sliding-window attention (use_sliding_window / "
                                  "layer_types) is not supported; expected full attention only")
        rope_theta = _rope_theta(raw)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in raw]
        if missing:
            raise CheckpointError(f"config.json: missing required key(s) {', '.join(missing)}")
        heads = raw["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
        )

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """The config.json that both ROSE and `transformers` (4.5x and 5.x) read."""
        raw = dataclasses.asdict(self)
        raw.update(
            architectures=[self.architecture],
            hidden_act="silu",
            rope_scaling=None,
            attention_dropout=0.0,
            initializer_range=0.02,
            use_cache=True,
            torch_dtype=dtype,
        )
        if self.model_type == "llama":
            raw.update(mlp_bias=False)
        else:  # Qwen's sliding-window switches, off
            raw.update(use_sliding_window=False, sliding_window=None,
                       max_window_layers=self.num_hidden_layers)
        return raw

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise CheckpointError(f"{path}: no config.json; expected a Hugging Face model directory")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc
        return cls.from_hf(raw)


def _rope_theta(raw: dict[str, Any]) -> float:
    """rope_theta from either the 4.x keys (rope_theta, rope_scaling) or 5.x's rope_parameters."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    for key, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise CheckpointError(f"config.json: {key} of type {kind!r} is not supported; "
                                  "expected plain rotary embeddings ('default')")
    return float(params.get("rope_theta", raw.get("rope_theta", 10_000.0)))
