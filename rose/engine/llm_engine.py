"""The engine: requests in, one iteration per `step()`, tokens with logprobs and versions out."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from rose.contracts import InFlight, RequestOutput, SamplingParams, TokenLoad
from rose.contracts.adapter import LoRAConfig
from rose.engine.block_manager import BlockManager
from rose.engine.kv_pool import KVPool, KVSpec
from rose.engine.model_runner import IterationInterrupted, ModelRunner
from rose.engine.sampling import Sampled, sample, unsampleable_rows
from rose.engine.scheduler import Batch, Scheduler, SchedulerConfig
from rose.engine.sequence import Sequence, Status
from rose.engine.structured_output import Constraint, Grammars
from rose.model import CheckpointError, ModelConfig, Tokenizer, load_model, load_tokenizer
from rose.model.decoder import CausalLM

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineStep:
    """What one iteration computed, and how long it took (the latency model learns from it)."""

    load: TokenLoad = dataclasses.field(default_factory=TokenLoad)
    seconds: float = 0.0
    interrupted: bool = False  # given up part way: the seconds were spent, no token came of them
    guests: TokenLoad = dataclasses.field(default_factory=TokenLoad)  # the guest sequences' part of `load`


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    kv_cache_bytes: int = 256 * 1024**2
    block_size: int = 16
    # The scheduler's settings, passed on to it (`scheduler`).
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    chunk_size: int = SchedulerConfig.chunk_size
    # `triton`, `cpu` or `sdpa` (rose/engine/attention.py); None: the device's own
    # (`attention.default_backend`).
    attention_backend: str | None = None
    # Decode-only iterations replayed as CUDA graphs, one per padded batch size (with the triton
    # backend; rose/engine/cuda_graphs.py).
    cuda_graphs: bool = True

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.chunk_size)


def _load(batch: Batch, guests: bool) -> TokenLoad:
    """The iteration's load of the guest sequences in `batch`, or of the others."""
    prefill = decodes = context = 0
    for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
        if seq.guest is not guests:
            continue
        if n == 1:
            decodes += 1
            context += seq.num_computed_tokens + 1
        else:
            prefill += n
    return TokenLoad(prefill, decodes, context)


def eos_ids(path: str | Path, config: ModelConfig) -> list[int]:
    """A checkpoint's end-of-sequence ids: generation_config.json's, else config.json's."""
    eos: int | list[int] | None = config.eos_token_id
    gen_file = Path(path) / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


class LLMEngine:
    """The native `GenerationEngine` (rose.contracts), whose `step` also takes a token budget
    and an interrupt (the co-serving executor's admission)."""

    def __init__(self, model: CausalLM, config: EngineConfig | None = None,
                 eos_token_ids: Iterable[int] = (), pool: KVPool | None = None,
                 name: str = "model", guest: str | None = None) -> None:
        """The engine runs where `model` is, its KV in the model's dtype. `pool`: a KV pool on
        that device shared with other engines (one is made from the config if None); `name` owns
        this engine's pages in it. `guest`: the owner of the guest requests' pages, if the engine
        takes guests (`add_request(guest=True)`, `rose.engine.scheduler`)."""
        self.model = model.eval()
        self.config = config or EngineConfig()
        self.name = name
        weight = next(model.parameters())
        self.device = weight.device
        spec = KVSpec.of(model.config, weight.dtype, self.config.block_size)
        self.pool = pool or KVPool.for_specs(self.config.kv_cache_bytes, spec, device=self.device)
        if self.pool.device != self.device:
            raise ValueError(f"engine {name!r}: its model is on {self.device}, the KV pool on "
                             f"{self.pool.device}")
        self.blocks = BlockManager(self.pool, spec, name)
        self.guest_blocks = None if guest is None else BlockManager(self.pool, spec, guest)
        self.scheduler = Scheduler(self.blocks, self.config.scheduler, self.guest_blocks)
        self.runner = ModelRunner(model, self.pool, spec, self.config.attention_backend,
                                  self.config.cuda_graphs, self.config.max_num_seqs)
        self.adapters = self.runner.adapters  # the loaded LoRA adapters
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = model.config.max_position_embeddings
        self.vocab_size = model.config.vocab_size
        self.grammars: Grammars | None = None  # structured output's (`use_tokenizer`)
        self.policy_version = 0
        self.num_preemptions = 0
        self.num_interrupted = 0  # iterations given up part way (`step(interrupt=...)`)
        self.last_step = EngineStep()
        self._staged_weights: tuple[list[tuple[torch.Tensor, torch.Tensor]], int] | None = None
        self._seqs: dict[str, Sequence] = {}
        # Seeds for unseeded requests, drawn on the CPU: the same sequence of seeds on any device.
        self._seeds = torch.Generator(device="cpu").manual_seed(0)
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str | None = None,
                        device: str | torch.device | None = None, **config: int) -> LLMEngine:
        """The checkpoint at `path` on `device` in `dtype` (None: `rose.model.device`'s defaults:
        CUDA if there is one, in bfloat16; else the CPU, in float32)."""
        model = load_model(path, dtype=dtype, device=device)
        engine = cls(model, EngineConfig(**config), eos_token_ids=eos_ids(path, model.config))
        engine.use_checkpoint_tokenizer(path)
        return engine

    def use_tokenizer(self, tokenizer: Tokenizer) -> None:
        """The model's tokenizer: structured output compiles its grammars over its vocabulary
        (on the first constrained request; an engine without one refuses those requests)."""
        self.grammars = Grammars(tokenizer, self.vocab_size, self.eos_token_ids)

    def use_checkpoint_tokenizer(self, path: str | Path) -> None:
        """`use_tokenizer` with the checkpoint's tokenizer, if it has one (tokenizer.json) that
        ROSE reads; else the engine serves all but structured output."""
        if not (Path(path) / "tokenizer.json").is_file():
            return
        try:
            self.use_tokenizer(load_tokenizer(path))
        except CheckpointError as exc:
            log.warning("engine %r: no structured output (%s)", self.name, exc)

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0, adapter: str | None = None,
                    guest: bool = False) -> str:
        """Queue a request, on the base model or with the loaded LoRA `adapter`, as a guest if
        `guest`; bad input raises ValueError naming the request, nothing else changes."""
        request_id = str(next(self._ids)) if request_id is None else request_id
        where = f"request {request_id!r}"
        if request_id in self._seqs:
            raise ValueError(f"{where}: a request with this id is already running")
        if guest and self.guest_blocks is None:
            raise ValueError(f"{where}: engine {self.name!r} takes no guest requests")
        lora = None if adapter is None else self.adapters.get(adapter)
        if adapter is not None and lora is None:
            raise ValueError(f"{where}: adapter {adapter!r} is not loaded; loaded: {self.adapters.names()}")
        if not prompt_token_ids:
            raise ValueError(f"{where}: the prompt is empty; expected at least one token id")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"{where}: the prompt has {len(prompt_token_ids)} tokens; the model's "
                             f"context is {self.max_model_len}, so at most {self.max_model_len - 1}")
        for field, ids in (("", prompt_token_ids), ("logit_bias ", [t for t, _ in params.logit_bias])):
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{where}: {field}token id {bad[0]!r} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        try:
            params.validate()
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        self._check_fits(where, len(prompt_token_ids), params.max_tokens)
        constraint = self._constraint(where, params)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seeds, device="cpu"))
        seq = Sequence(request_id, prompt_token_ids, params, priority,
                       torch.Generator(device=self.device).manual_seed(seed), constraint, lora, guest)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _constraint(self, where: str, params: SamplingParams) -> Constraint | None:
        """The matcher of the request's structured output, its grammar ending at the request's
        stop tokens (as vLLM's: its stop ids, and end of sequence unless ignore_eos)."""
        if params.structured is None:
            return None
        if self.grammars is None:
            raise ValueError(f"{where}: structured output needs the model's tokenizer, and engine "
                             f"{self.name!r} has none")
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        try:
            return self.grammars.constraint(params.structured, stops)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt and output) one request may reach: the model's context, or
        what the KV pool holds (the last token needs no KV). A budget that the co-serving
        executor lowers at run time may hold less: a request that outgrows it is aborted."""
        return min(self.max_model_len, self.pool.num_pages * self.blocks.block_size + 1)

    def _check_fits(self, where: str, prompt: int, max_tokens: int) -> None:
        """Refuse what could never finish: it would wait forever and block the queue behind it."""
        total = prompt + min(max_tokens, self.max_model_len - prompt)
        if total > self.max_request_tokens:
            pages = self.blocks.pages_for(total - 1)
            raise ValueError(
                f"{where}: the prompt ({prompt} tokens) and max_tokens ({max_tokens}) need KV for "
                f"{total - 1} tokens, {pages} pages of {self.blocks.block_size}; the KV pool holds "
                f"{self.pool.num_pages} pages, so a request may reach {self.max_request_tokens} "
                f"tokens (the model's context is {self.max_model_len})")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request; its final output (no new tokens; None if unknown or finished)."""
        seq = self._seqs.get(request_id)
        return None if seq is None else self._finish(seq, "abort")

    def _retire(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Take a finished request out; its pages go back."""
        del self._seqs[seq.request_id]
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason, seq.error = Status.FINISHED, reason, error
        seq.constraint = None  # its matcher's memory goes back too

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        """Retire a request that produced nothing more; its last output."""
        self._retire(seq, reason, error)
        return seq.output()

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._seqs

    # -- one iteration -------------------------------------------------------------------------

    def step(self, token_budget: int | None = None, interrupt: Callable[[], bool] | None = None,
             guest_budget: int | None = None) -> list[RequestOutput]:
        """Run one iteration (at most `token_budget` tokens if given, of them at most
        `guest_budget` guest tokens); return the requests that produced a token or finished. A
        request whose computation raises, or whose logits hold NaN, finishes with finish_reason
        'error'; the others go on. When `interrupt()` turns
        true between two layers the iteration is given up: no sequence advances, and the next
        step computes the same tokens again."""
        start = time.perf_counter()
        if not self.scheduler.running:
            self._apply_staged_weights()  # FINISH_OLD, when preemption emptied the running set
        # While new weights wait (FINISH_OLD), nothing new starts under the old ones.
        batch = self.scheduler.schedule(token_budget, self._staged_weights is None, guest_budget)
        self.num_preemptions += len(batch.preempted)
        outputs = [self._unfit(seq) for seq in batch.unfit]
        if not batch.seqs:
            self.last_step = EngineStep()
            return outputs
        load, guests = _load(batch, False), _load(batch, True) if self.guest_blocks else TokenLoad()
        try:
            outputs += self._execute(batch, interrupt)
        except IterationInterrupted:
            self.num_interrupted += 1
            self.last_step = EngineStep(seconds=time.perf_counter() - start, interrupted=True)
            return outputs
        except Exception:  # find the requests it concerns: fail only those
            log.exception("engine %r: an iteration of %d requests failed; retrying each alone",
                          self.name, len(batch.seqs))
            for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
                outputs += self._execute_or_fail(Batch([seq], [n], []))
        if not self.scheduler.running:
            self._apply_staged_weights()  # FINISH_OLD: the old weights' last sequence is done
        self.last_step = EngineStep(load + guests, time.perf_counter() - start, guests=guests)
        return outputs

    def _unfit(self, seq: Sequence) -> RequestOutput:
        blocks = self.scheduler.blocks_of(seq)
        return self._finish(seq, "abort", f"its {len(seq.token_ids)} tokens need "
                            f"{blocks.pages_for(len(seq.token_ids))} KV pages; {blocks.owner!r} may now "
                            f"hold {blocks.max_pages}")

    def _execute_or_fail(self, batch: Batch) -> list[RequestOutput]:
        try:
            return self._execute(batch)
        except Exception as exc:  # this request's own failure
            seq = batch.seqs[0]
            log.exception("engine %r: request %r failed", self.name, seq.request_id)
            return [self._finish(seq, "error", f"the engine failed on this request: {exc!r}")]

    def _execute(self, batch: Batch, interrupt: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """Compute and sample one batch. Whatever raises leaves every sequence as it was (the
        KV it wrote is written again by the retry)."""
        sampling, logits = self.runner.run(batch, interrupt)
        bad = set(unsampleable_rows(logits)) if sampling else set()
        good = [i for i in range(len(sampling)) if i not in bad]
        drawn = sample(logits[good] if bad else logits, [sampling[i] for i in good], self.eos_token_ids) \
            if good else Sampled([], [], [])
        outputs = [self._finish(sampling[i], "error", "the model's logits hold NaN or +inf; "
                                "refusing to sample from them") for i in sorted(bad)]
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            if seq.status is not Status.FINISHED:  # a failed one's KV is not worth sharing
                seq.num_computed_tokens += n
                self.scheduler.blocks_of(seq).commit(seq)
                if seq.kv_version is None:
                    seq.kv_version = self.policy_version if seq.adapter is None else seq.adapter.version
        now = time.monotonic()
        for i, token, logprob, top in zip(good, drawn.tokens, drawn.logprobs, drawn.top, strict=True):
            seq = sampling[i]
            seq.append(token, now)
            if seq.constraint is not None and not seq.constraint.accept(token):
                # Only where another setting masked every token the grammar allows (min_tokens
                # holding back the stop tokens that end it).
                self._retire(seq, "error", f"token {token} breaks the structured output's grammar: "
                             "no token it allows was left to draw (min_tokens?)")
            elif reason := self._finish_reason(seq, token):
                self._retire(seq, reason)
            outputs.append(seq.output([token], [logprob], [seq.kv_version],
                                      [top] if seq.params.top_logprobs else None))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.constraint is not None and seq.constraint.terminated:
            return "stop"  # the grammar's end (as vLLM's)
        if len(seq.output_token_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 adapter: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Offline generation: one finished output per prompt (all its tokens), in order; with
        `adapter` (one for all, or one per prompt) the LoRA adapter each runs with."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        adapters = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        ids = [self.add_request(p, sp, adapter=a)
               for p, sp, a in zip(prompts, params_list, adapters, strict=True)]
        merged: dict[str, RequestOutput] = {}
        while not all(i in merged and merged[i].finished for i in ids):
            for out in self.step():
                if out.request_id in merged:
                    merged[out.request_id].merge(out)
                else:
                    merged[out.request_id] = out
        return [merged[i] for i in ids]

    # -- weights and state ---------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                     in_flight: InFlight = InFlight.CONTINUE) -> None:
        """Take new weights (any dtype, on any device: cast to the model's and copied there, the
        caller keeps its own) as policy `version`. Call between iterations. The prefix cache is dropped
        when they apply: its KV is stale. A token carries the version its sequence's KV was
        computed under: with CONTINUE a running sequence's later tokens keep the old version."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        staged = []
        for name, tensor in named_tensors:
            if name not in params:
                raise ValueError(f"load_weights: unknown parameter {name!r}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
            staged.append((params[name], tensor.to(params[name].device, params[name].dtype, copy=True)))
        self._staged_weights = (staged, version)
        if in_flight is InFlight.ABORT_RESUME:
            for seq in list(self.scheduler.running):
                self.scheduler.preempt(seq)
        if in_flight is not InFlight.FINISH_OLD or not self.scheduler.running:
            self._apply_staged_weights()

    def _apply_staged_weights(self) -> None:
        """Swap in staged weights once nothing runs under the old ones (or at once)."""
        if self._staged_weights is None:
            return
        staged, version = self._staged_weights
        with torch.no_grad():
            for param, tensor in staged:
                param.copy_(tensor)
        self._staged_weights = None
        self.reset_prefix_cache()
        self.policy_version = version

    def load_adapter(self, name: str, config: LoRAConfig, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None:
        """Load LoRA adapter `name` (every tensor, under `rose.model.lora`'s names), or replace a
        loaded one's tensors (only those that changed, unless `config` changed) as `version`;
        any dtype and device (copied to the model's; the caller keeps its own). Call between
        iterations. Its running requests go on over their KV (as InFlight.CONTINUE: their tokens
        keep the version their KV was computed under); new ones run on `version`, and share no KV
        with the old. ValueError, with nothing changed, for an adapter of another base."""
        self.adapters.load(name, config, named_tensors, version)

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter; ValueError while a request (queued or running) uses it."""
        adapter = self.adapters.get(name)
        for seq in self._seqs.values():
            if adapter is not None and seq.adapter is adapter:
                raise ValueError(f"adapter {name!r}: request {seq.request_id!r} uses it; expected no "
                                 "request on it (remove it once they finish)")
        self.adapters.remove(name)

    def adapter_versions(self) -> dict[str, int]:
        return {name: adapter.version for name, adapter in self.adapters.adapters.items()}

    def reset_prefix_cache(self) -> None:
        """Drop the pages only the prefix cache holds."""
        self.blocks.reset_prefix_cache()
        if self.guest_blocks is not None:
            self.guest_blocks.reset_prefix_cache()

    def check_health(self) -> None:
        """Nothing to check: an iteration that fails fails only its own requests (`step`)."""

    def stats(self) -> dict[str, float]:
        return {
            "policy_version": self.policy_version,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_pages_active": self.blocks.num_active_pages,
            "kv_pages_cached": self.blocks.num_cached_pages,
            "kv_pages_total": self.pool.num_pages,
            "prefix_cache_hit_rate": self.blocks.hit_rate,
            "num_preemptions": self.num_preemptions,
            "num_interrupted": self.num_interrupted,
        }
