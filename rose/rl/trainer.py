"""The policy trainer: fp32 master weights, AdamW, gradient accumulation, data parallelism.

`Trainer.step(trajectories)` is one RL step: the objective turns rewards into advantages, each
trajectory is flattened to its sequences (one, unless its chat template rewrote earlier turns:
`Trajectory.flatten`; each counts as a sequence in the sequence-level aggregations), the current
policy's per-token logprobs are recomputed for the ratio against the old policy's (the behaviour
logprobs recorded at rollout, or with `recompute_old_logprobs` the trainer's own before the step,
the behaviour ones then giving truncated importance weights), tokens older than
`max_version_lag` versions are left out, and the batch is split into `mini_batches` optimizer
updates of `micro_batch_size`-sequence forward/backward passes. The policy version then goes up
by one and `export_weights()` yields the new weights as bf16 for the rollout engines
(`LLMEngine.load_weights(trainer.export_weights(), trainer.version)`).

Precision: the master weights and AdamW's state stay in fp32, the precision AdamW's small updates
need. The forward and backward run in `TrainerConfig.dtype` under autocast: bf16 by default on
CUDA, fp32 on the CPU (no fast bf16 arithmetic there). Token log-probabilities and entropies
are computed a chunk of tokens at a time (`rose.rl.logprobs`): the `[B, T, vocab]` fp32
log-softmax is never built. The KL penalty's reference policy exists only with kl_coef > 0.

LoRA (`TrainerConfig.lora`): the base model is frozen in the compute dtype and an adapter
(`rose.model.lora`) trains in fp32 beside it, the optimizer's state its alone. The KL penalty's
reference is the base with the adapter switched off (no second model), `export_weights` yields
the adapter's tensors alone, and a checkpoint holds the adapter in PEFT's format plus the
optimizer state, naming its base (`adapter_config.json`'s `base_model_name_or_path`).

Data parallelism: construct one Trainer per rank after `torch.distributed.init_process_group`
(`process_group_backend`: NCCL on CUDA, one device per rank; gloo on the CPU) and give each rank
whole GRPO groups (`shard_by_group`). The policy's forward runs under PyTorch's
DistributedDataParallel, whose bucketed all-reduce overlaps the backward; micro-batches
accumulate without it (`no_sync`) and the last one of each optimizer update synchronises. Losses
are divided by the token or sequence count of the whole batch (all ranks) and gradients summed
across ranks, so N ranks with 1/N of the batch each take the same step as one rank with all of it.

`sharding="fsdp"` shards instead of replicating: PyTorch's FSDP2 (`fully_shard`, each decoder
layer a unit, then the rest) keeps 1/N of the weights, gradients and AdamW state on each rank and
gathers a layer's weights for its forward and backward, for models one device cannot hold with
their optimizer. Every forward is a collective then, so the ranks run as many micro-batches as
the busiest one (the others forward and backward nothing: zero gradients). The full weights are
gathered for `export_weights` and `save`, which every rank calls.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from rose.contracts.adapter import LoRAConfig
from rose.contracts.sampling import MIN_TEMPERATURE
from rose.model import CausalLM, load_model, save_model
from rose.model.checkpoint import fsync_dir, fsync_file
from rose.model.device import resolve
from rose.model.lora import attach, is_adapter, load_adapter, save_adapter
from rose.rl.logprobs import token_logprobs
from rose.rl.objective import Objective
from rose.rl.trajectory import TokenSequence, Trajectory

Logprobs = tuple[torch.Tensor, torch.Tensor]  # a forward's token logprobs and entropies
STATE_FILE = "trainer_state.pt"
REFERENCE_DIR = "reference"  # the KL penalty's reference policy, beside the weights
COMPLETE_FILE = "checkpoint_complete.json"  # written last: its presence vouches for the rest
SHARDINGS = ("ddp", "fsdp")  # how data-parallel ranks hold the policy: whole on each, or 1/N


def process_group_backend(device: torch.device) -> str:
    """The collectives' backend for ranks training on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


def is_complete(path: str | Path) -> bool:
    """Whether `path` is a whole checkpoint written by `Trainer.save`."""
    return (Path(path) / COMPLETE_FILE).is_file()


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0  # None: no clipping
    micro_batch_size: int = 8  # sequences per forward/backward pass
    mini_batches: int = 1  # optimizer updates per step, each on its share of the batch
    # Cosine decay of lr to lr * min_lr_ratio over this many steps (0: constant lr). Near
    # convergence most groups tie and what gradient is left is sampling noise; full-size Adam
    # steps on it random-walk a small policy off the solution.
    lr_decay_steps: int = 0
    min_lr_ratio: float = 0.1
    # Linear warmup from lr / warmup_steps to lr over the first steps (0: none): Adam's first
    # moments are noise, and a real checkpoint's first full-size steps can wreck it.
    warmup_steps: int = 0
    # The rollouts' sampling temperature: logprobs are taken of logits / temperature, the policy
    # the engine drew from (0: greedy, taken at 1).
    temperature: float = 1.0
    gradient_checkpointing: bool = False
    # Where the policy trains and in which compute dtype (None: `rose.model.device`'s defaults:
    # cuda if there is one, in bfloat16; else the cpu, in float32); the master weights stay fp32.
    device: str | None = None
    dtype: str | None = None
    logprob_chunk_tokens: int = 1024  # tokens whose fp32 logits exist at once (rose.rl.logprobs)
    sharding: str = "ddp"  # with several ranks: DDP replicas, or FSDP2 shards (SHARDINGS)
    lora: LoRAConfig | None = None  # train a LoRA adapter on the frozen model, not the model

    def __post_init__(self) -> None:
        def number(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"trainer: {name} must be a finite number, got {value!r}")
            return float(value)

        if number("lr", self.lr) <= 0:
            raise ValueError(f"trainer: lr must be > 0, got {self.lr}")
        if number("weight_decay", self.weight_decay) < 0:
            raise ValueError(f"trainer: weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= number("betas", b) < 1 for b in self.betas):
            raise ValueError(f"trainer: betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.max_grad_norm is not None and number("max_grad_norm", self.max_grad_norm) <= 0:
            raise ValueError(f"trainer: max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        for name, low in (("micro_batch_size", 1), ("mini_batches", 1), ("lr_decay_steps", 0),
                          ("warmup_steps", 0), ("logprob_chunk_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"trainer: {name} must be an integer >= {low}, got {value!r}")
        if number("temperature", self.temperature) < 0:
            raise ValueError(f"trainer: temperature must be >= 0, got {self.temperature}")
        if not 0 <= number("min_lr_ratio", self.min_lr_ratio) <= 1:
            raise ValueError(f"trainer: min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"trainer: sharding must be one of {', '.join(SHARDINGS)}, "
                             f"got {self.sharding!r}")
        resolve(self.device, self.dtype, label="trainer: ")
        if self.lora is not None and self.sharding == "fsdp":
            raise ValueError("trainer: sharding fsdp with a LoRA adapter is not supported; use ddp (the "
                             "frozen base is not sharded, and the adapter is small)")


def _chunks(items: list[Any], n: int) -> list[list[Any]]:
    """`n` contiguous, nearly equal chunks (some empty when there are fewer items than n)."""
    size, extra = divmod(len(items), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [items[bounds[i]:bounds[i + 1]] for i in range(n)]


def _pad(sequences: list[TokenSequence], device: torch.device
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Right-pad to `[B, L]` on `device`; padding is masked out (causal attention never looks
    ahead). The behaviour logprobs are None unless the old ones were recomputed."""
    length = max(len(s.token_ids) for s in sequences)

    def stack(field: str, fill: float | int | bool) -> torch.Tensor:
        rows = [getattr(s, field) for s in sequences]
        return torch.stack([torch.nn.functional.pad(r, (0, length - len(r)), value=fill)
                            for r in rows]).to(device)

    behaviour = stack("behaviour_logprobs", 0.0) if sequences[0].behaviour_logprobs is not None else None
    return (stack("token_ids", 0), stack("loss_mask", False), stack("old_logprobs", 0.0),
            stack("versions", -1), behaviour)


def _join(forward: torch.nn.Module, device: torch.device) -> None:
    """A forward and backward of nothing (zero gradients) that synchronises: a rank with no
    sequence left in an update still takes part in the collectives the other ranks wait in."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    (forward(ids[:, :1], ids[:, 1:])[0].sum() * 0.0).backward()


def _full(t: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP) tensor gathered whole; any other as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class TokenLogprobs(torch.nn.Module):
    """A policy's forward as the trainer uses it: each target token's log-probability and each
    position's entropy at the rollouts' temperature (`rose.rl.logprobs`), in the compute dtype.
    It is the module DistributedDataParallel wraps, so that DDP sees the forward the loss uses."""

    def __init__(self, model: CausalLM, temperature: float, dtype: torch.dtype, chunk_tokens: int) -> None:
        super().__init__()
        self.model, self.dtype, self.chunk_tokens = model, dtype, chunk_tokens
        self.temperature = temperature if temperature >= MIN_TEMPERATURE else 1.0  # greedy: taken at 1

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = inputs.device.type
        with torch.autocast(device, self.dtype, enabled=self.dtype != torch.float32):
            return token_logprobs(self.model.model(inputs), self.model.lm_head, targets, self.temperature,
                                  self.chunk_tokens)


class Trainer:
    def __init__(self, model: CausalLM | str | Path, objective: Objective | None = None,
                 config: TrainerConfig | None = None, group: dist.ProcessGroup | None = None) -> None:
        """`model`: a policy (moved to the config's device) or a checkpoint directory (loaded there
        in fp32). With a process group initialised, this is one data-parallel rank of `group`
        (default: the whole world); rank 0's weights are broadcast to the others."""
        self.config = config or TrainerConfig()
        self.device, self.compute_dtype = resolve(self.config.device, self.config.dtype)
        lora = self.config.lora
        # A frozen base under an adapter needs no fp32 master copy: it stays in the compute dtype.
        dtype = torch.float32 if lora is None else self.compute_dtype
        self.base_path = str(Path(model).resolve()) if isinstance(model, (str, Path)) else ""
        self.model = (load_model(model, dtype, self.device) if isinstance(model, (str, Path))
                      else model.to(self.device) if lora is None else model.to(self.device, dtype))
        self.lora = attach(self.model, lora) if lora is not None else None
        trained = [p for p in self.model.parameters() if p.requires_grad]
        wrong = {str(p.dtype) for p in trained if p.dtype != torch.float32}
        if wrong:
            raise ValueError(f"trainer: master weights must be float32, got {', '.join(sorted(wrong))}; "
                             "load the model with dtype=torch.float32")
        self.objective = objective or Objective.grpo()
        self.model.train().set_gradient_checkpointing(self.config.gradient_checkpointing)
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        c = self.config
        self.policy = TokenLogprobs(self.model, c.temperature, self.compute_dtype, c.logprob_chunk_tokens)
        self.sharded = self.world_size > 1 and c.sharding == "fsdp"
        if self.world_size > 1:  # rank 0's weights, before the reference copies them
            source = dist.get_global_rank(group, 0) if group is not None else 0
            for t in self.model.state_dict().values():
                dist.broadcast(t, source, group=group)
        # The reference policy of the KL penalty is the policy as it starts (whole on each rank);
        # under an adapter, the base: the same model with the adapter off.
        self.ref_model = (copy.deepcopy(self.model).eval().requires_grad_(False)
                          if self.objective.kl_coef > 0 and self.lora is None else None)
        self.ddp = None
        if self.sharded:
            mesh = DeviceMesh.from_group(group or dist.group.WORLD, self.device.type)
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.policy, mesh=mesh)
        elif self.world_size > 1:
            # Buffers (RoPE tables) are never broadcast: they are constants, and a broadcast per
            # forward would need every rank to run as many micro-batches as the others.
            self.ddp = DistributedDataParallel(self.policy, process_group=group, broadcast_buffers=False)
        self.forward: torch.nn.Module = self.ddp if self.ddp is not None else self.policy  # with gradients
        # What trains: FSDP's sharded parameters once sharded; the adapter's alone under LoRA.
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.reference: Callable[[torch.Tensor, torch.Tensor], Logprobs] | None = None
        if self.ref_model is not None:
            self.reference = TokenLogprobs(self.ref_model, c.temperature, self.compute_dtype,
                                           c.logprob_chunk_tokens)
        elif self.lora is not None and self.objective.kl_coef > 0:
            self.reference = self._base_logprobs
        self.optimizer = torch.optim.AdamW(self.params, lr=self.config.lr, betas=self.config.betas,
                                           weight_decay=self.config.weight_decay)
        # `steps`: optimizer steps taken, which the learning-rate schedule and a resumed run's
        # position follow; `version`: the name of the weights the rollout replicas sample from.
        # They are equal unless a restart rolled the weights back to a checkpoint, which then
        # took a version number of their own (`TrainerActor.renumber`).
        self.steps = self.version = 0

    # -- one step ------------------------------------------------------------------------------

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One RL step on this rank's share of the batch (whole groups); every rank calls it
        once per step. Returns metrics over the whole batch."""
        prepared = self.objective.prepare(trajectories)
        # A trajectory cut before its first turn counts in its group's statistics only.
        kept = [(t, a) for t, a in zip(prepared.trajectories, prepared.advantages, strict=True) if t.turns]
        # Each sequence's tokens carry their turn's advantage (on the CPU, beside the sequence's
        # own tensors: `_pad` takes the batch to the device).
        samples = [(seq, torch.tensor(a, dtype=torch.float32, device="cpu")[seq.turns]) for t, a in kept
                   for seq in self._flatten(t)]
        stale = sum(int(s.loss_mask.sum()) for s, _ in samples)
        samples = [(self._fresh(s), a) for s, a in samples]
        stale -= sum(int(s.loss_mask.sum()) for s, _ in samples)
        if self.objective.recompute_old_logprobs:
            samples = self._recompute_old(samples)
        sums = dict.fromkeys(("loss", "tokens", "sequences", "clipped", "kl", "is", "entropy",
                              "version_lag"), 0.0)
        sums["stale_tokens"] = float(stale)
        grad_norms, updates = [], 0
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr
        for mini in _chunks(samples, self.config.mini_batches):
            shifted = [s.loss_mask[1:] for s, _ in mini]
            local = sum(int(m.sum()) for m in shifted), sum(int(m.any()) for m in shifted)
            tokens, sequences = self._all_reduce(local)
            denominator = tokens if self.objective.aggregation == "token-mean" else sequences
            if denominator == 0:
                continue  # nothing to learn from anywhere (e.g. dynamic sampling dropped all)
            micros = [m for m in _chunks(mini, math.ceil(len(mini) / self.config.micro_batch_size) or 1) if m]
            idle = self._idle_passes(len(micros))  # agreed on before any pass: each is a collective
            for i, micro in enumerate(micros):
                with self._accumulating(last=i + 1 == len(micros)):
                    for key, value in self._forward_backward(micro, int(denominator)).items():
                        sums[key] += value
            for _ in range(idle):
                _join(self.forward, self.device)
            limit = self.config.max_grad_norm or math.inf
            grad_norms.append(float(_full(torch.nn.utils.clip_grad_norm_(self.params, limit))))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            updates += 1
        self.steps += 1
        self.version += 1
        keys = list(sums) + list(prepared.stats)
        totals = dict(zip(keys, self._all_reduce([*sums.values(), *prepared.stats.values()]), strict=True))
        tokens = max(totals["tokens"], 1.0)
        return {
            "loss": totals["loss"] / max(updates, 1),
            "clip_fraction": totals["clipped"] / tokens,
            "kl": totals["kl"] / tokens,
            "is_weight": totals["is"] / tokens if self.objective.recompute_old_logprobs else 1.0,
            "stale_tokens": totals["stale_tokens"],
            "entropy": totals["entropy"] / tokens,
            "grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "version_lag": totals["version_lag"] / tokens,
            "tokens": totals["tokens"],
            "sequences": totals["sequences"],
            "updates": float(updates),
            "reward_mean": totals["reward_sum"] / max(totals["trajectories"], 1.0),
            "success_rate": totals["successes"] / max(totals["trajectories"], 1.0),
            "groups": totals["groups"],
            "groups_kept": totals["groups_kept"],
            "version": float(self.version),
            "steps": float(self.steps),
            "lr": self.optimizer.param_groups[0]["lr"],
        }

    @property
    def lr(self) -> float:
        """This step's learning rate (the schedule is a function of the steps taken, so it resumes)."""
        c = self.config
        if self.steps < c.warmup_steps:
            return c.lr * (self.steps + 1) / c.warmup_steps
        if c.lr_decay_steps == 0:
            return c.lr
        progress = min(self.steps / c.lr_decay_steps, 1.0)
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def _flatten(self, t: Trajectory) -> list[TokenSequence]:
        sequences = t.flatten()
        limit, vocab = self.model.config.max_position_embeddings, self.model.config.vocab_size
        for seq in sequences:
            if len(seq.token_ids) > limit:
                raise ValueError(f"trajectory {t.group_id!r} has a sequence of {len(seq.token_ids)} tokens; "
                                 f"the model's context is {limit}")
            if int(seq.token_ids.min()) < 0 or int(seq.token_ids.max()) >= vocab:
                raise ValueError(f"trajectory {t.group_id!r} holds token ids outside the vocabulary "
                                 f"[0, {vocab})")
        return sequences

    def _fresh(self, seq: TokenSequence) -> TokenSequence:
        """Without the tokens sampled more than `max_version_lag` versions before this one."""
        lag = self.objective.max_version_lag
        if lag is None:
            return seq
        return dataclasses.replace(seq, loss_mask=seq.loss_mask & (seq.versions >= self.version - lag))

    @torch.no_grad()
    def _recompute_old(self, samples: list[tuple[TokenSequence, torch.Tensor]]
                       ) -> list[tuple[TokenSequence, torch.Tensor]]:
        """The old policy's logprobs as this trainer computes them (its weights before the step),
        the behaviour ones kept beside them for the importance weights."""
        out = []
        count = math.ceil(len(samples) / self.config.micro_batch_size) or 1
        micros = [m for m in _chunks(samples, count) if m]
        for _ in range(self._idle_passes(len(micros)) if self.sharded else 0):
            ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
            self.policy(ids[:, :1], ids[:, 1:])  # a forward of nothing: the shards' all-gathers
        for micro in micros:
            ids = _pad([s for s, _ in micro], self.device)[0]
            old = self.policy(ids[:, :-1], ids[:, 1:])[0].cpu()  # kept with the sequences
            for row, (seq, advantages) in zip(old, micro, strict=True):
                mine = torch.cat([row.new_zeros(1), row[:len(seq.token_ids) - 1]]) * seq.loss_mask
                out.append((dataclasses.replace(seq, old_logprobs=mine, behaviour_logprobs=seq.old_logprobs),
                            advantages))
        return out

    def _forward_backward(self, micro: list[tuple[TokenSequence, torch.Tensor]],
                          denominator: int) -> dict[str, float]:
        ids, mask, old, versions, behaviour = _pad([s for s, _ in micro], self.device)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        mask, old, versions = mask[:, 1:], old[:, 1:], versions[:, 1:]
        behaviour = behaviour[:, 1:] if behaviour is not None else None
        advantages = torch.nn.utils.rnn.pad_sequence([a for _, a in micro], batch_first=True)[:, 1:]
        advantages = advantages.to(self.device)
        logprobs, entropy = self.forward(inputs, targets)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self.reference(inputs, targets)[0]
        loss, sums = self.objective.loss(logprobs, old, advantages, mask, ref, denominator, behaviour)
        # DDP averages gradients over ranks; the loss is already divided by the whole batch's
        # count, so their sum is the step's gradient.
        (loss * self.world_size).backward()
        with torch.no_grad():
            out = {key: float(value) for key, value in sums.items()}
            out.update(loss=float(loss), tokens=float(mask.sum()), sequences=float(mask.any(-1).sum()),
                       entropy=float((entropy * mask).sum()),
                       version_lag=float(((self.version - versions) * mask).sum()))
        return out

    def _base_logprobs(self, inputs: torch.Tensor, targets: torch.Tensor) -> Logprobs:
        """The policy's forward with its adapter off: the KL reference under LoRA."""
        assert self.lora is not None
        with self.lora.disabled():
            return self.policy(inputs, targets)

    # -- data parallelism ----------------------------------------------------------------------

    def _all_reduce(self, values: Sequence[float]) -> list[float]:
        if self.world_size == 1:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def _idle_passes(self, passes: int) -> int:
        """How many passes of nothing this rank, with `passes` of its own, runs beside the others:
        under FSDP every pass is a collective, so as many as the busiest rank's; under DDP only
        the last one of an update synchronises, so one when it has none."""
        if self.sharded:
            most = torch.tensor([passes], device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
            return int(most) - passes
        return int(self.ddp is not None and passes == 0)

    def _accumulating(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Gradients of a micro-batch that is not its update's `last` stay on this rank."""
        return self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()

    # -- weights out, checkpoints --------------------------------------------------------------

    def export_weights(self, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, tensor)` for every parameter, cast from the fp32 masters (a copy, always):
        what `LLMEngine.load_weights` and the weight transfer engine consume. A tied output
        head is yielded once, under the embedding's name. Under LoRA: the adapter's tensors
        alone (`rose.model.lora`'s names), what `load_adapter` consumes."""
        named = self.lora.named_tensors() if self.lora is not None else self.model.named_parameters()
        for name, p in named:
            yield name, _full(p.detach()).to(dtype, copy=True)

    def save(self, path: str | Path, assets: Iterable[str | Path] = ()) -> Path:
        """An HF-format checkpoint of the fp32 weights plus the optimizer state and version, with
        copies of `assets` (e.g. the tokenizer's files).

        Written whole into a sibling temporary directory, flushed, marked complete and renamed
        into place: a crash at any point leaves the previous checkpoint at `path` (or none), never
        a torn one, and `is_complete` tells the two apart. Every rank calls it (FSDP's shards are
        gathered); rank 0 writes."""
        path = Path(path)
        weights, optimizer = None, self.optimizer.state_dict()
        if self.sharded:  # whole, by parameter name: a run of any number of ranks resumes from it
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = get_model_state_dict(self.model, options=options)
            optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        if self.rank != 0:
            return path
        tmp, old = path.with_name(f".{path.name}.partial"), path.with_name(f".{path.name}.old")
        shutil.rmtree(tmp, ignore_errors=True)  # left by a process that died saving
        try:
            if self.lora is not None:  # the adapter in PEFT's format, in fp32, naming its base
                save_adapter(tmp, self.lora.config, dict(self.lora.named_tensors()), self.base_path)
            else:
                save_model(self.model, tmp, state=weights)
            if self.ref_model is not None:
                save_model(self.ref_model, tmp / REFERENCE_DIR)
                fsync_dir(tmp / REFERENCE_DIR)
            torch.save({"optimizer": optimizer, "version": self.version, "steps": self.steps,
                        "sharding": self.config.sharding}, tmp / STATE_FILE)
            for asset in map(Path, assets):
                shutil.copyfile(asset, tmp / asset.name)
            (tmp / COMPLETE_FILE).write_text(json.dumps({"version": self.version}) + "\n")
            for file in tmp.rglob("*"):
                if file.is_file():
                    fsync_file(file)
            fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)  # a directory cannot be renamed over a non-empty one
        tmp.rename(path)
        fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
        return path

    def load_state(self, path: str | Path) -> None:
        """Resume the optimizer, the version, the steps and the KL reference saved by `save` (the
        weights come with the model; under LoRA the adapter comes from `path`). The reference is
        never silently replaced by the resumed policy: a checkpoint without one cannot resume a
        run with a KL penalty."""
        file = Path(path) / STATE_FILE
        if not file.is_file():
            raise ValueError(f"{path}: no {STATE_FILE}; expected a directory written by Trainer.save")
        if (self.lora is not None) != is_adapter(path):
            raise ValueError(f"{path}: saved {'with' if is_adapter(path) else 'without'} a LoRA adapter; "
                             f"resume with model.lora {'set as it was' if is_adapter(path) else 'unset'}")
        if self.lora is not None:
            config, tensors, _ = load_adapter(path)
            if config != self.lora.config:
                raise ValueError(f"{path}: its adapter is {config}; this run's model.lora is "
                                 f"{self.lora.config}")
            self.lora.load(tensors)
        if self.ref_model is not None:
            reference = Path(path) / REFERENCE_DIR
            if not (reference / "config.json").is_file():
                raise ValueError(f"{path}: no {REFERENCE_DIR}/ (the KL penalty's reference policy): it was "
                                 "saved without kl_coef > 0; resume with kl_coef 0, or start afresh")
            self.ref_model.load_state_dict(load_model(reference, torch.float32, self.device).state_dict())
        state = torch.load(file, weights_only=True, map_location=self.device)
        saved = state.get("sharding", "ddp")
        if (saved == "fsdp") != self.sharded:
            raise ValueError(f"{path}: its optimizer state was saved with sharding {saved}; resume with "
                             f"train.sharding={saved} (and more than one rank for fsdp)")
        if self.sharded:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.steps = int(state.get("steps", self.version))  # written before steps were kept apart
