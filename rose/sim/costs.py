"""Cost models: devices, model shapes, iteration latency (roofline), training step, weight sync,
the rollout control plane's CPU.

Every constant has its source beside it. Datasheet figures are dense bf16 (no sparsity).
Efficiency factors are what engines achieve of a roofline bound; they are assumptions taken
from published measurements, not fitted to this simulator's results.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types

import numba
import numpy as np

from rose.contracts import TURN_CHUNK_S, TokenLoad
from rose.contracts.adapter import LoRAConfig

GB = 1e9
# Token counts and times: plain numbers, or numpy arrays of them (one entry per replica or turn).
Amount = float | np.ndarray


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    flops: float          # peak dense bf16 FLOP/s per device
    hbm_bw: float         # bytes/s per device
    memory: float         # bytes per device
    nvlink_bw: float      # bytes/s per device, intra-node
    nic_bw: float         # bytes/s per device, inter-node (one NIC per GPU)
    source: str


DEVICES: dict[str, Device] = {
    # NVIDIA H100 datasheet (SXM5): 989 TFLOPS bf16 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s;
    # the H800 is the export variant with the same compute and memory and NVLink cut to 400 GB/s.
    # NIC: one 400 Gb/s InfiniBand NDR port per GPU (the ROSE paper's clusters: 400 Gb/s IB inside).
    "H800": Device("H800", 989e12, 3.35e12, 80 * GB, 400 * GB, 50 * GB,
                   "NVIDIA H100/H800 SXM5 datasheets; 400 Gb/s IB per GPU"),
    "H100": Device("H100", 989e12, 3.35e12, 80 * GB, 900 * GB, 50 * GB,
                   "NVIDIA H100 SXM5 datasheet; 400 Gb/s IB per GPU"),
    # NVIDIA H200 datasheet (SXM): same compute as H100, 141 GB HBM3e at 4.8 TB/s.
    "H200": Device("H200", 989e12, 4.8e12, 141 * GB, 900 * GB, 50 * GB,
                   "NVIDIA H200 SXM datasheet; 400 Gb/s IB per GPU"),
    # NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS bf16, 2,039 GB/s, NVLink 600 GB/s; HDR 200 Gb/s.
    "A100": Device("A100", 312e12, 2.039e12, 80 * GB, 600 * GB, 25 * GB,
                   "NVIDIA A100 80GB SXM4 datasheet; 200 Gb/s HDR IB per GPU"),
    # One core of this machine (Intel Xeon, AVX-512 at 2.1 GHz, /proc/cpuinfo), float32, as
    # `rose train` pins a device to its cores: peak 2 FMA units x 16 lanes x 2 FLOPs x 2.1 GHz =
    # 134 GFLOP/s. Memory bandwidth (used only by roofline models, such as SmolLM2's, not by the
    # measured engines below): batch-1 decode of the 34 M `small` model streams its 136 MB of fp32
    # weights at 32-37 tokens/s (the design's reference figures), about 5 GB/s. Memory: the 64 MB
    # KV budgets `rose train` gives its engines are far from binding for the tiny models (a
    # scenario's serving.executor.pool_mb sets a serving device's pool).
    "cpu": Device("cpu", 134e9, 5 * GB, 1 * GB, 5 * GB, 2 * GB,
                  "one core of this machine: AVX-512 peak; engines measured (rose.bench.calibrate)"),
}


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of the roofline that real engines reach, and fixed per-forward costs."""

    # Assumption: large-GEMM prefill chunks reach about half of peak in serving engines.
    prefill_mfu: float = 0.5
    # Assumption: decode (weight and KV streaming) reaches 70-80% of HBM bandwidth in tuned kernels.
    decode_bw: float = 0.75
    # Assumption: dense LLM training at 40-55% MFU (Megatron-LM; MegaScale, NSDI 2024); RL
    # trainers (FSDP, variable-length micro-batches) at the low end.
    train_mfu: float = 0.40
    # Assumption: scheduling + kernel launch per forward with CUDA graphs (vLLM V1: ~1-3 ms).
    forward_overhead_s: float = 2e-3
    # One small all-reduce over NVLink, ~10 us (nccl-tests); tensor parallelism needs 2 a layer.
    allreduce_latency_s: float = 10e-6
    # vLLM's default gpu_memory_utilization.
    memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, int | float) and v > 0):
                raise ValueError(f"efficiency.{f.name} must be positive, got {v!r}")
        for name in ("prefill_mfu", "decode_bw", "train_mfu", "memory_utilization"):
            if getattr(self, name) > 1:
                raise ValueError(f"efficiency.{name} is a fraction of peak, got {getattr(self, name)}")


# The CPU device. Its engines' iteration times are measured (MEASURED_COSTS); what is left here
# is the trainer: `python -m rose.bench.calibrate` measured the tiny Qwen3's GRPO step over
# `rose bench train`'s trajectories at TRAIN_FLOPS_CPU achieved (6 + 2 x 2 FLOPs per parameter
# and token), a fraction TRAIN_FLOPS_CPU / 134e9 of one core's peak. The other factors only
# matter for roofline models on the CPU (SmolLM2's): the design's reference figures.
TRAIN_FLOPS_CPU = 1.8e10
CPU_EFFICIENCY = Efficiency(prefill_mfu=0.1, decode_bw=1.0, train_mfu=TRAIN_FLOPS_CPU / 134e9,
                            forward_overhead_s=1e-3, allreduce_latency_s=1e-4, memory_utilization=0.9)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    bytes_per_param: int = 2      # bf16 weights and KV

    @property
    def layer_params(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        return self.layers * (2 * q + kv + 3 * self.hidden * self.intermediate)

    @property
    def params(self) -> int:
        return self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    def adapter_params(self, rank: int) -> int:
        """A rank-`rank` LoRA adapter's parameters on this model's attention and MLP projections,
        as `LoRAConfig.shapes` lays its tensors out (it reads a model config's Hugging Face names)."""
        config = types.SimpleNamespace(num_hidden_layers=self.layers, hidden_size=self.hidden,
                                       num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                                       head_dim=self.head_dim, intermediate_size=self.intermediate)
        return sum(math.prod(shape) for shape in LoRAConfig(rank=rank).shapes(config).values())

    def adapter_bytes(self, rank: int) -> float:
        """The adapter's tensors, in the model's own precision."""
        return self.adapter_params(rank) * self.bytes_per_param


# Shapes from each model's Hugging Face config.json (Qwen/Qwen3-8B, Qwen/Qwen3-32B,
# Qwen/Qwen2.5-7B-Instruct, Qwen/Qwen2.5-32B-Instruct).
MODELS: dict[str, ModelShape] = {
    "qwen3-8b": ModelShape("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936),
    "qwen3-32b": ModelShape("Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936),
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064),
    "qwen2.5-32b": ModelShape("Qwen2.5-32B", 64, 5120, 40, 8, 128, 27648, 152064),
    # `rose bench coserve`'s serving and rollout models (rose.model.presets "small", float32).
    "small-qwen3": ModelShape("small Qwen3", 8, 512, 8, 4, 64, 1536, 8192, bytes_per_param=4),
    "small-qwen2": ModelShape("small Qwen2", 8, 512, 8, 4, 64, 1536, 8192, bytes_per_param=4),
    # `rose train`'s default policy and serving model (rose.model.presets "tiny", float32).
    "tiny-qwen3": ModelShape("tiny Qwen3", 2, 64, 4, 2, 16, 128, 512, tied=True, bytes_per_param=4),
    "tiny-qwen2": ModelShape("tiny Qwen2", 2, 64, 4, 2, 16, 128, 512, tied=True, bytes_per_param=4),
    # SmolLM2-135M(-Instruct), a Llama: `rose init-model --preset smollm2-135m-instruct` imports it
    # in float32.
    "smollm2-135m": ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tied=True, bytes_per_param=4),
}


@dataclasses.dataclass(frozen=True)
class ForwardCost:
    """One model on one replica (tp devices): the roofline of a forward as linear terms.

    time = max(compute, memory) + fixed, compute = s_token * tokens + s_attn * ctx + s_head * seqs,
    memory = s_weights + s_kv * (ctx + tokens). Works on floats and numpy arrays alike."""

    s_token: float       # matmul FLOPs of one token (2 x non-embedding params) / achieved FLOP/s
    s_attn: float        # attention FLOPs per (query, cached key) pair / achieved FLOP/s
    s_head: float        # LM head per sampled sequence
    s_weights: float     # streaming the weights once
    s_kv: float          # streaming one token's KV
    fixed: float         # launch/scheduling + TP all-reduce latency
    prefill_attn: float  # attention of a prefill chunk on itself, per token squared

    @classmethod
    def of(cls, model: ModelShape, device: Device, tp: int, eff: Efficiency) -> ForwardCost:
        flops = device.flops * tp
        bw = device.hbm_bw * tp * eff.decode_bw
        attn = 4 * model.layers * model.heads * model.head_dim     # QK^T and PV, 2 FLOPs a MAC
        fixed = eff.forward_overhead_s + (2 * model.layers * eff.allreduce_latency_s if tp > 1 else 0)
        return cls(s_token=2 * model.layer_params / (flops * eff.prefill_mfu),
                   s_attn=attn / (flops * eff.prefill_mfu),
                   s_head=2 * model.hidden * model.vocab / (flops * eff.prefill_mfu),
                   s_weights=model.weight_bytes / bw,
                   s_kv=model.kv_bytes_per_token / bw,
                   fixed=fixed,
                   prefill_attn=attn / 2 / (flops * eff.prefill_mfu))

    def time(self, prefill: Amount, decode: Amount, ctx: Amount, chunk_seqs: Amount = 1) -> Amount:
        """Forward time for `prefill` prompt tokens (in chunks over `chunk_seqs` sequences),
        `decode` sequences and `ctx` cached KV tokens read; 0 where there is no work. Elementwise
        over numpy arrays (`_roofline` compiled, each load in one loop: a simulator of thousands of
        replicas asks it tens of times a tick)."""
        # One entry: a number the kernel compiles in (an array of the rest's length loops faster).
        # Integer counts go in as they are, not copied as floats: the kernel's arithmetic with
        # them is the same (exact below 2**53).
        shape: tuple[int, ...] = ()
        loads: list[np.ndarray | float] = []
        for x in (prefill, decode, ctx, chunk_seqs):
            if isinstance(x, np.ndarray):
                shape = x.shape if x.ndim > len(shape) else shape
                loads.append(float(x.flat[0]) if x.size == 1 else
                             x.ravel() if x.dtype in _KERNEL_TYPES else x.ravel().astype(np.float64))
            else:
                loads.append(float(x))
        out = _roofline_each(math.prod(shape), *loads, *self.terms)
        return out.reshape(shape) if shape else float(out[0])

    @classmethod
    def of_adapter(cls, model: ModelShape, rank: int, device: Device, tp: int,
                   eff: Efficiency) -> ForwardCost:
        """A LoRA adapter's own kernels in a forward of `model`'s rows that carry it (a LoRA
        engine runs them after the base's matmuls): two thin matmuls a targeted projection per
        token, and its weights streamed once."""
        flops = device.flops * tp * eff.prefill_mfu
        return cls(s_token=2 * model.adapter_params(rank) / flops, s_attn=0.0, s_head=0.0,
                   s_weights=model.adapter_bytes(rank) / (device.hbm_bw * tp * eff.decode_bw),
                   s_kv=0.0, fixed=0.0, prefill_attn=0.0)

    def scalar(self, load: TokenLoad, chunk_seqs: Amount = 1.0) -> Amount:
        """`time` of one iteration's load, as the admission policy asks it (about 600k times a
        paper-8b run): on plain numbers the formula itself, as numpy's ufuncs cost microseconds a
        call on scalars; on arrays (one entry per replica: the policy deciding for many replicas
        at once) `time`."""
        p, d, c = load.prefill_tokens, load.decode_seqs, load.context_tokens
        if any(isinstance(x, np.ndarray) for x in (p, d, c, chunk_seqs)):
            return self.time(p, d, c, chunk_seqs)
        return _roofline(p, d, c, chunk_seqs, *self.terms)

    @functools.cached_property
    def terms(self) -> tuple[float, ...]:
        return dataclasses.astuple(self)


def _roofline(prefill: float, decode: float, ctx: float, chunk_seqs: float, s_token: float, s_attn: float,
              s_head: float, s_weights: float, s_kv: float, fixed: float, prefill_attn: float) -> float:
    """`ForwardCost.time` of one load, the cost's terms given."""
    tokens = prefill + decode
    if tokens <= 0:
        return 0.0
    seqs = decode + min(prefill, chunk_seqs)
    compute = (s_token * tokens + s_attn * ctx + s_head * seqs
               + prefill_attn * prefill * prefill / max(chunk_seqs, 1.0))
    return max(compute, s_weights + s_kv * (ctx + tokens)) + fixed


_roofline_compiled = numba.njit(cache=True)(_roofline)


_KERNEL_TYPES = (np.dtype(np.float64), np.dtype(np.int64))


@numba.njit(cache=True)
def _at(x: np.ndarray | float, i: int) -> float:
    """Entry i of an array, or the number itself (resolved as the kernel compiles)."""
    if isinstance(x, float):
        return x
    return x[i]


@numba.njit(cache=True)
def _roofline_each(n: int, prefill: np.ndarray | float, decode: np.ndarray | float, ctx: np.ndarray | float,
                   chunk_seqs: np.ndarray | float, *terms: float) -> np.ndarray:
    """`_roofline` of each of `n` loads: arrays of length n, or numbers (the same for all)."""
    out = np.empty(n)
    for i in range(n):
        out[i] = _roofline_compiled(_at(prefill, i), _at(decode, i), _at(ctx, i), _at(chunk_seqs, i), *terms)
    return out


# Measured iteration times of this project's engine on one core of this machine (torch threads
# 1), `python -m rose.bench.calibrate`: a linear model of each engine's per-iteration minima
# (fixed + per token + per cached token read); the small models' on 2026-12-05. Every sampled
# sequence also streams its token to the rollout manager: CHUNK_S, one Ray streaming-generator
# chunk, measured by the same script (16 turns in flight); serving streams over HTTP, assumed to
# cost the same.
CHUNK_S = 0.29e-3
MEASURED_COSTS: dict[tuple[str, str], ForwardCost] = {
    ("cpu", "tiny Qwen3"): ForwardCost(s_token=31.9e-6, s_attn=244e-9, s_head=CHUNK_S, s_weights=0.0,
                                       s_kv=0.0, fixed=1.16e-3, prefill_attn=0.0),
    ("cpu", "tiny Qwen2"): ForwardCost(s_token=30.6e-6, s_attn=235e-9, s_head=CHUNK_S, s_weights=0.0,
                                       s_kv=0.0, fixed=1.23e-3, prefill_attn=0.0),
    ("cpu", "small Qwen3"): ForwardCost(s_token=572.6e-6, s_attn=934e-9, s_head=CHUNK_S, s_weights=0.0,
                                        s_kv=0.0, fixed=10.57e-3, prefill_attn=0.0),
    ("cpu", "small Qwen2"): ForwardCost(s_token=568.1e-6, s_attn=868e-9, s_head=CHUNK_S, s_weights=0.0,
                                        s_kv=0.0, fixed=10.95e-3, prefill_attn=0.0),
}


@dataclasses.dataclass(frozen=True)
class ControlPlaneCost:
    """The rollout control plane: the driver's CPU (its rollout manager) for what every turn and
    every streamed token costs it, and how often a device delivers tokens (`rose.sim.control`)."""

    turn_s: float        # a turn attempt: routing it, its request, its bookkeeping
    chunk_s: float       # one turn's tokens within one delivered message
    frame_s: float       # one message from one device, carrying all its turns' chunks of an interval
    interval_s: float    # how often a device delivers a turn's tokens

    def demand_s(self, attempts: Amount, chunks: Amount, frames: Amount) -> Amount:
        """The driver's CPU seconds for `attempts` turn attempts, `chunks` chunks and `frames` frames."""
        return attempts * self.turn_s + chunks * self.chunk_s + frames * self.frame_s


# Today's transport: a stream per turn (a Ray streaming generator from a dedicated worker, an HTTP
# stream from a serving executor), each turn's tokens of `TURN_CHUNK_S` its own message. chunk_s:
# the manager's side of one chunk, measured by `python -m rose.bench.calibrate` (16 turns in
# flight); where the manager runs on the dedicated devices' cores (cluster.manager_on_dedicated) it
# comes out of their time. turn_s: routing and bookkeeping of one attempt, an estimate.
HTTP_PER_TURN = ControlPlaneCost(turn_s=0.40e-3, chunk_s=0.30e-3, frame_s=0.0, interval_s=TURN_CHUNK_S)
# One multiplexed stream per device: every interval one frame carries the chunks of all its turns.
# The driver's CPU for it, measured (docs/benchmarks.md, "Control plane"): a frame's 47 us and a
# chunk's 1.7 us from a client reading 32 fake devices' frames of 4 and of 16 turns' chunks; a
# turn's, what `rose bench control-plane`'s paper-8b point (1.72 s for 2,048 turns, 81,900
# tokens, 11,200 frames) leaves once those are paid, rounded up.
STREAM_TURN_S = 0.50e-3
STREAM_CHUNK_S = 2e-6
STREAM_FRAME_S = 50e-6
STREAM_INTERVAL_S = 0.05
STREAM = ControlPlaneCost(turn_s=STREAM_TURN_S, chunk_s=STREAM_CHUNK_S, frame_s=STREAM_FRAME_S,
                          interval_s=STREAM_INTERVAL_S)
TRANSPORTS: dict[str, ControlPlaneCost] = {"stream": STREAM, "http": HTTP_PER_TURN}


def forward_cost(model: ModelShape, device: Device, tp: int, eff: Efficiency) -> ForwardCost:
    """The measured cost of `model`'s engine on `device` where there is one, else its roofline."""
    measured = MEASURED_COSTS.get((device.name, model.name))
    return measured if measured is not None and tp == 1 else ForwardCost.of(model, device, tp, eff)


@dataclasses.dataclass(frozen=True)
class RooflineLatency:
    """The admission controller's latency model in the simulator: the two models' forwards run
    one after the other in each iteration (`rose.coserve.admission.LatencyModel`)."""

    serving: ForwardCost
    rollout: ForwardCost

    def iteration_time(self, serving: TokenLoad, rollout: TokenLoad) -> float:
        return self.serving.scalar(serving) + self.rollout.scalar(rollout)


@dataclasses.dataclass(frozen=True)
class OneForwardLatency:
    """The latency model of adapter mode (`serving.rollout=adapter`): the policy is a LoRA adapter
    of the serving model, so rollout rows ride in serving's forward. One roofline forward over both
    loads (the weights read and the fixed cost paid once; rollout decodes add their KV reads and
    their compute), plus the adapter's kernels on the rollout rows."""

    model: ForwardCost      # the serving model's forward, its engine's time per iteration in `fixed`
    adapter: ForwardCost    # `ForwardCost.of_adapter`

    def iteration_time(self, serving: TokenLoad, rollout: TokenLoad) -> Amount:
        ps, pr = serving.prefill_tokens, rollout.prefill_tokens
        both = serving + rollout
        # Two prompts' chunks in one forward attend each to itself only: as far as the roofline's
        # attention of a chunk on itself goes, the chunk is split over P^2 / (ps^2 + pr^2) equal
        # parts (1 with either alone; 0 with neither, which has no prefill: the divisor made 1).
        squares = ps * ps + pr * pr
        parts = both.prefill_tokens * both.prefill_tokens / (squares + (squares == 0))
        return self.model.scalar(both, parts) + self.adapter.scalar(TokenLoad(pr, rollout.decode_seqs))


def kv_capacity_tokens(model: ModelShape, device: Device, tp: int, eff: Efficiency,
                       other_weights: float = 0.0) -> int:
    """KV tokens that fit beside the weights (and `other_weights`, a co-located model's)."""
    free = device.memory * tp * eff.memory_utilization - model.weight_bytes - other_weights
    return max(0, int(free / model.kv_bytes_per_token))


def train_step_time(model: ModelShape, device: Device, gpus: int, tokens: float,
                    logprob_passes: int, eff: Efficiency) -> float:
    """Forward + backward (6 N FLOPs a token, Kaplan et al. 2020) plus `logprob_passes` forward
    passes (2 N) that recompute old-policy / reference log-probabilities, at `train_mfu`."""
    flops = (6 + 2 * logprob_passes) * model.params * tokens
    return flops / (gpus * device.flops * eff.train_mfu)


@dataclasses.dataclass(frozen=True)
class WeightSync:
    """Bytes a weight update moves. A sparse delta sends (int32 index, bf16 value) per changed
    element (6 bytes), overwrite semantics; a full update sends every bf16 weight."""

    changed_fraction: float = 0.05   # ROSE paper: over 95% of bf16 weights unchanged at step 10
    full_every: int = 10             # periodic full sync (design: "with a periodic full sync")

    def payload_bytes(self, model: ModelShape, step: int, sparse: bool) -> float:
        if not sparse or step % self.full_every == 0:
            return model.weight_bytes
        return min(model.weight_bytes, model.params * self.changed_fraction * 6)


def cross_cluster_sync_time(payload: float, cross_bw: float, receivers: int, tp: int,
                            nic_bw: float, senders: int) -> float:
    """Shard-aware relay: every trainer rank sends only its own slice (`senders` in parallel,
    each limited by its NIC), one copy crosses the inter-cluster link into the relay, and every
    receiving replica pulls its TP shards over its own NICs; the stages pipeline bucket by
    bucket (64 MB), so the slowest stage sets the time."""
    if receivers == 0:
        return 0.0
    send = payload / min(cross_bw, senders * nic_bw)
    fan_out = payload / (tp * nic_bw)            # each replica's tp NICs pull its shards
    bucket = min(payload, 64e6) / cross_bw       # pipeline fill: first bucket end to end
    return max(send, fan_out) + bucket


def naive_sync_time(payload: float, cross_bw: float, receivers: int, nic_bw: float) -> float:
    """The naive baseline (`rose bench transfer`'s `naive`): one trainer rank holds the gathered
    weights and sends a full copy to every receiving GPU, which keeps its slice, across the link
    at what one NIC sends."""
    return receivers * payload / min(cross_bw, nic_bw)


def model_by_name(name: str) -> ModelShape:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    return MODELS[name]


def device_by_name(name: str) -> Device:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; expected one of {', '.join(DEVICES)}")
    return DEVICES[name]


def efficiency_for(device: Device) -> Efficiency:
    return CPU_EFFICIENCY if device.name == "cpu" else Efficiency()
