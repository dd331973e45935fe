"""Who holds which slice of every parameter, on the trainer and on each rollout replica.

A slice is a `Box`: a half-open `(start, stop)` range per dimension, in the parameter's global
coordinates. A `Layout` gives, for every rank of one process group, the box of each parameter
it holds (or None). Trainer layouts are FSDP-style dim-0 shards inside tensor-parallel shards
inside pipeline stages, and say which rank *owns* each element (exactly one does: that rank
sends it). Receiver layouts are tensor-parallel column/row/vocabulary splits of decoder layers
(Llama, Qwen2 and Qwen3 name theirs alike) inside pipeline stages, as vLLM shards them;
replicated pieces (norms, KV heads when TP exceeds their number) appear in several ranks' boxes.

The split of each parameter is inferred from its module type and name and can be overridden.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import hashlib
import math
import re
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from rose.contracts.adapter import LoRAConfig
from rose.model import CausalLM, ModelConfig

Box = tuple[tuple[int, int], ...]


class Split(str, enum.Enum):
    """How tensor parallelism cuts a parameter."""

    REPLICATED = "replicated"  # every TP rank holds all of it (norms, row-parallel biases)
    COLUMN = "column"  # output features, dim 0 (q/k/v/gate/up weights and biases)
    ROW = "row"  # input features, dim 1 (o_proj, down_proj weights)
    VOCAB = "vocab"  # vocabulary rows, dim 0 (embed_tokens, lm_head)

    @property
    def dim(self) -> int | None:
        return {Split.COLUMN: 0, Split.VOCAB: 0, Split.ROW: 1}.get(self)


ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One transferred parameter.

    `units` is the number of attention heads along the split dimension, so that tensor
    parallelism never cuts a head (None: any row or column boundary will do). `layer` places it
    in a pipeline: a decoder layer index, -1 before the layers (embeddings) or `num_layers`
    after them (final norm, lm_head); `tied` embeddings are needed by the last stage as well.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    split: Split
    layer: int
    units: int | None = None
    tied: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The transferred parameters of one model, in a fixed order both sides agree on."""

    params: tuple[ParamSpec, ...]
    num_layers: int

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def fingerprint(self) -> str:
        """Names, shapes, dtypes and splits: senders and receivers must hold the same."""
        text = repr([(p.name, p.shape, str(p.dtype), p.split.value, p.layer, p.units, p.tied)
                     for p in self.params])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def infer_split(name: str, module: nn.Module | None = None) -> Split:
    """The TP split of parameter `name` of `module`: by the module's type, and by the name alone
    when no module is given; the name then tells vocabulary and row-parallel linears apart."""
    owner, _, kind = name.rpartition(".")
    leaf = owner.rpartition(".")[2]
    if module is None:
        embedding, linear = leaf == "embed_tokens", leaf.endswith("_proj") or leaf == "lm_head"
    else:
        embedding, linear = isinstance(module, nn.Embedding), isinstance(module, nn.Linear)
    if embedding or (linear and leaf == "lm_head"):
        return Split.VOCAB
    if linear and leaf in ROW_PARALLEL:
        return Split.ROW if kind == "weight" else Split.REPLICATED
    return Split.COLUMN if linear else Split.REPLICATED


def model_spec(model: nn.Module, dtype: torch.dtype = torch.bfloat16,
               overrides: Mapping[str, Split] | None = None) -> ModelSpec:
    """The spec of `model`'s parameters (tied ones once), transferred as `dtype`.

    `overrides` maps fnmatch patterns of parameter names to a split. Head counts come from
    `model.config` (a `ModelConfig`) when there is one.
    """
    config = getattr(model, "config", None)
    heads = _heads(config)
    modules = dict(model.named_modules())
    layers = [int(m.group(1)) for n, _ in model.named_parameters() if (m := _LAYER.search(n))]
    num_layers = getattr(config, "num_hidden_layers", None) or (max(layers) + 1 if layers else 0)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    params = []
    for name, p in model.named_parameters():
        owner = name.rpartition(".")[0]
        split = infer_split(name, modules.get(owner))
        for pattern, forced in (overrides or {}).items():
            if fnmatch.fnmatchcase(name, pattern):
                split = Split(forced)
        if split.dim is not None and split.dim >= p.dim():
            raise ValueError(f"{name}: a {split.value} split needs dim {split.dim}, "
                             f"but the parameter has shape {tuple(p.shape)}")
        m = _LAYER.search(name)
        layer = int(m.group(1)) if m else (-1 if "embed_tokens" in name else num_layers)
        units = heads.get(owner.rpartition(".")[2]) if split in (Split.COLUMN, Split.ROW) else None
        params.append(ParamSpec(name, tuple(p.shape), dtype, split, layer, units,
                                tied=tied and "embed_tokens" in name))
    return ModelSpec(tuple(params), num_layers)


def config_spec(config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                overrides: Mapping[str, Split] | None = None) -> ModelSpec:
    """The spec of a `CausalLM` with `config`, built on the meta device (no memory)."""
    with torch.device("meta"):
        return model_spec(CausalLM(config), dtype, overrides)


def adapter_spec(config: ModelConfig, lora: LoRAConfig, dtype: torch.dtype = torch.bfloat16) -> ModelSpec:
    """The spec of a LoRA adapter's tensors (`lora.shapes(config)`: A is [rank, in], B is [out,
    rank]) on a model of `config`, split as vLLM splits them: the factor on the side the base
    linear's TP cuts takes its split (B of a column-parallel linear on its output rows, A of a
    row-parallel one on its input columns, whole heads either way); the other is replicated."""
    heads = _heads(config)
    params = []
    for name, shape in lora.shapes(config).items():
        module, _, factor = name.removesuffix(".weight").rpartition(".")
        base = infer_split(f"{module}.weight")
        split = base if (base is Split.COLUMN) == (factor == "lora_B") else Split.REPLICATED
        units = heads.get(module.rpartition(".")[2]) if split is not Split.REPLICATED else None
        layer = int(name.split(".")[2])  # model.layers.N.<module>: LoRAConfig targets decoder layers only
        params.append(ParamSpec(name, shape, dtype, split, layer, units))
    return ModelSpec(tuple(params), config.num_hidden_layers)


def _heads(config: ModelConfig | None) -> dict[str, int | None]:
    """Heads along each attention projection's split dimension (None without a config)."""
    return {"q_proj": getattr(config, "num_attention_heads", None),
            "k_proj": getattr(config, "num_key_value_heads", None),
            "v_proj": getattr(config, "num_key_value_heads", None),
            "o_proj": getattr(config, "num_attention_heads", None)}


# ------------------------------------------------------------------------------------ layouts


@dataclasses.dataclass(frozen=True)
class Layout:
    """For every rank of a group, the box of each parameter it holds (None: not held)."""

    world: int
    boxes: Mapping[str, tuple[Box | None, ...]]

    def rank_boxes(self, rank: int) -> dict[str, Box]:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} out of range for a group of {self.world}")
        return {name: per_rank[rank] for name, per_rank in self.boxes.items()
                if per_rank[rank] is not None}


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """The trainer's parallelism; ranks are ordered (pipeline stage, TP rank, FSDP rank)."""

    fsdp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.fsdp * self.tp * self.pp


@dataclasses.dataclass(frozen=True)
class ReceiverSpec:
    """One receiving process: rank `rank` of rollout replica `replica` (ranks ordered (stage, TP rank))."""

    replica: str
    tp: int = 1
    pp: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.tp * self.pp:
            raise ValueError(f"receiver rank {self.rank} out of range for tp={self.tp} pp={self.pp}")
        if "/" in self.replica:
            raise ValueError(f"replica name {self.replica!r} must not contain '/'")

    @property
    def id(self) -> str:
        return f"{self.replica}/{self.rank}"


def chunk_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's split of `size` into `parts`: equal ceil-sized pieces, the last ones shorter or empty."""
    step = -(-size // parts)
    return [(min(i * step, size), min((i + 1) * step, size)) for i in range(parts)]


def tp_box(p: ParamSpec, tp: int, rank: int) -> Box:
    """The box of `p` that TP rank `rank` of `tp` holds (vLLM's column/row/vocabulary sharding)."""
    full = tuple((0, s) for s in p.shape)
    dim = p.split.dim
    if dim is None or tp == 1:
        return full
    size = p.shape[dim]
    if p.units is None:
        lo, hi = chunk_bounds(size, tp)[rank]
    elif p.units % tp == 0:
        per = size // tp
        lo, hi = rank * per, (rank + 1) * per
    elif tp % p.units == 0:  # fewer heads than ranks: each head is replicated tp / units times
        unit = size // p.units
        head = rank // (tp // p.units)
        lo, hi = head * unit, (head + 1) * unit
    else:
        raise ValueError(f"{p.name}: {p.units} heads cannot be split over tensor-parallel size {tp}")
    return (*full[:dim], (lo, hi), *full[dim + 1:])


def stages_of(p: ParamSpec, pp: int, num_layers: int) -> set[int]:
    """The pipeline stages holding `p`; layers are split into `pp` contiguous, balanced runs."""
    if pp == 1:
        return {0}
    if p.layer < 0:
        stages = {0}
    elif p.layer >= num_layers:
        stages = {pp - 1}
    else:
        base, extra = divmod(num_layers, pp)  # the first `extra` stages take one layer more
        stages = {max(s for s in range(pp) if s * base + min(s, extra) <= p.layer)}
    if p.tied:
        stages.add(pp - 1)
    return stages


def receiver_layout(spec: ModelSpec, tp: int = 1, pp: int = 1) -> Layout:
    """A rollout replica's layout: rank = stage * tp + TP rank."""
    boxes = {}
    for p in spec.params:
        stages = stages_of(p, pp, spec.num_layers)
        held = [tp_box(p, tp, r % tp) if r // tp in stages else None for r in range(tp * pp)]
        boxes[p.name] = tuple(b if b is not None and (not b or box_numel(b)) else None for b in held)
    return Layout(tp * pp, boxes)


def trainer_layout(spec: ModelSpec, trainer: TrainerSpec) -> Layout:
    """The boxes each trainer rank *owns*: every element of every parameter exactly once.

    Within each TP shard, FSDP ranks hold dim-0 chunks. Where TP replicates (norms, heads fewer
    than ranks) or a tied embedding sits on two stages, the lowest ranks holding a copy own it.
    """
    fsdp = trainer.fsdp
    positions = receiver_layout(spec, trainer.tp, trainer.pp)  # one position per FSDP group
    boxes = {}
    for p in spec.params:
        owned: list[Box | None] = []
        claimed: set[Box] = set()
        for held in positions.boxes[p.name]:
            if held is None or held in claimed:
                owned += [None] * fsdp
            elif not held:  # a scalar: the group's first rank owns it
                owned += [held] + [None] * (fsdp - 1)
            else:
                (lo, hi), rest = held[0], held[1:]
                owned += [((lo + a, lo + b), *rest) if b > a else None
                          for a, b in chunk_bounds(hi - lo, fsdp)]
            if held is not None:
                claimed.add(held)
        boxes[p.name] = tuple(owned)
    return Layout(trainer.world, boxes)


# --------------------------------------------------------------------------------- box helpers


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def box_numel(box: Box) -> int:
    return math.prod(box_shape(box))


def local_slices(box: Box, within: Box) -> tuple[slice, ...]:
    """Slices selecting `box` from a tensor that holds `within` (box must lie inside within)."""
    return tuple(slice(lo - wlo, hi - wlo) for (lo, hi), (wlo, _) in zip(box, within, strict=True))


def shard(tensors: Mapping[str, torch.Tensor], boxes: Mapping[str, Box]) -> dict[str, torch.Tensor]:
    """Views of the full tensors cut to `boxes` (how one process plays a rank in tests and benchmarks)."""
    return {name: tensors[name][local_slices(box, tuple((0, s) for s in tensors[name].shape))]
            for name, box in boxes.items()}


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, s) for s in shape)
