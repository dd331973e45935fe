"""The SLO-safe co-serving executor: a serving model and a rollout model on one device.

Two engines draw KV pages from one pool, each with its own block tables; or, where vLLM serves
(`rose.coserve.vllm_serving`), its KV cache is its own and the rollout pool is the rest, both
counted as the device's KV by the burst state machine. In adapter mode the rollout policy is a
LoRA adapter of the serving model: its turns are guest requests of the serving engine
(`rose.engine.scheduler`), one forward and one pool for both, their pages under the rollout
budget. Every iteration:
1. memory: the burst state machine (`admission.BurstController`) sets the rollout page budget
   from serving's usage, and on a burst aborts the rollout turns that no longer fit (they are
   handed back with their partial tokens; the scheduler reroutes them);
2. compute: dual-SLO admission (`admission.admission_step`) decides how many rollout tokens may
   join, predicted with the fitted iteration-time model read at a quantile of its error, under
   each serving request's SLOs and inflation budgets, scaled by the feedback guard;
3. serving's batch runs first, then the rollout model's with the admitted tokens (in adapter
   mode both in one forward, the rollout rows with the adapter);
4. the measured times refit the latency model, feed the guard, and are charged to the serving
   requests that waited for the rollout part.

Policies other than `rose` exist for the benchmark: `naive` (rollouts take whatever pages and
tokens they like, no priority), `static` (a fixed page split and a fixed rollout token budget),
`priority` (vLLM's priority scheduling across the two models: serving first, rollouts fill what
it leaves of the iteration's token budget and of the pool, preempted when serving needs pages).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from rose.contracts import Capacity, GenerationEngine, TokenLoad, Turn
from rose.contracts.adapter import LoRAConfig
from rose.coserve.admission import (
    Admission,
    BurstController,
    BurstState,
    LatencyModel,
    RolloutDemand,
    RolloutWait,
    ServingState,
    SlackGuard,
    SLOBudgets,
    admission_step,
    iteration_limit,
    memory_room,
    priority_pages,
    priority_tokens,
    rollout_capacity,
    serving_state,
)
from rose.coserve.device_memory import (
    GpuBudget,
    check_memory_settings,
    iteration_activations,
    rollout_pool_bytes,
)
from rose.coserve.latency import FittedLatencyModel, OneForward, TailLatency, profile
from rose.coserve.metrics import ExecutorMetrics
from rose.coserve.serving_engine import NativeServing, ServingEngine
from rose.coserve.settings import MB, Engine, ExecutorConfig, Policy
from rose.engine import EngineConfig, InFlight, KVPool, KVSpec, LLMEngine, RequestOutput, SamplingParams
from rose.engine.block_manager import BlockManager
from rose.engine.llm_engine import EngineStep, eos_ids
from rose.engine.sequence import Sequence
from rose.model import ModelConfig, load_model
from rose.model.decoder import CausalLM
from rose.model.device import resolve

SERVING, ROLLOUT = "serving", "rollout"


def _engine_config(cfg: ExecutorConfig) -> EngineConfig:
    """The executor's native engines' settings."""
    return EngineConfig(max_num_seqs=cfg.max_num_seqs, chunk_size=cfg.chunk_tokens,
                        max_num_batched_tokens=max(2048, cfg.chunk_tokens))


def _vllm_limits(cfg: ExecutorConfig) -> dict[str, int]:
    """vLLM's batch limits as a serving engine: the native engine's sequences, a chunk of prompt
    beside a decode of each."""
    return {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.chunk_tokens + cfg.max_num_seqs}


class TurnSlotsFull(RuntimeError):
    """Every lease slot (`ExecutorConfig.max_rollout_turns`) holds a turn: retry later."""


class StaleVersion(ValueError):
    """New rollout weights whose version is below the rollout model's: versions only move forward."""


def newest_version(engine: GenerationEngine) -> int:
    """The newest weights a turn can run on here, the model's or an adapter's: what a worker
    reports, and routes by (in a LoRA run the model stays at version 0, its adapter moves)."""
    return max([engine.policy_version, *engine.adapter_versions().values()])


def check_version(turn: Turn, base_version: int, adapters: Mapping[str, int], host: str) -> None:
    """ValueError unless `turn` may run here: its adapter loaded (`adapters`: name -> version),
    and the version it runs on (its adapter's, else the model's `base_version`) no older than it
    asks. A later version is fine: an asynchronous run's trajectory goes on with newer weights."""
    version = base_version
    if turn.adapter is not None:
        if turn.adapter not in adapters:
            raise ValueError(f"turn {turn.turn_id!r}: adapter {turn.adapter!r} is not loaded on this {host}; "
                             f"expected one of: {', '.join(sorted(adapters)) or 'none loaded'}")
        version = adapters[turn.adapter]
    if turn.policy_version is not None and turn.policy_version > version:
        raise ValueError(f"turn {turn.turn_id!r}: expects policy version {turn.policy_version} or later, "
                         f"this {host} has {version}")


class CoServingExecutor:
    def __init__(self, serving: CausalLM | ServingEngine, rollout: CausalLM | None,
                 config: ExecutorConfig | None = None, serving_eos: Iterable[int] = (),
                 rollout_eos: Iterable[int] = (), adapter_mode: bool = False) -> None:
        """Both models on one device. `serving` is a model the native engine serves from the KV
        pool both share, made here; or an engine with a KV cache of its own (vLLM's,
        `rose.coserve.vllm_serving`), beside which the rollout model's pool is what is left of
        `config.pool_bytes`. The burst state machine counts both as the device's KV, in the
        pool's pages: serving's use of its own cache moves the rollout budget, triggers the cut
        and the freeze, as in one pool, though on the CPU the pages a cut frees cannot join
        the other engine's cache. `adapter_mode`: no rollout model; turns run on the serving
        model with the adapters `load_adapter` loads (the module's docstring)."""
        self.config = cfg = config or ExecutorConfig()
        self.serving_eos = frozenset(serving_eos)  # the serving checkpoint's end-of-sequence ids
        self.adapter_mode = adapter_mode
        engine = _engine_config(cfg)
        if adapter_mode and (rollout is not None or not isinstance(serving, CausalLM)):
            raise ValueError("adapter mode runs rollout turns on the native serving engine's model: give "
                             "no rollout model (and the native engine)")
        if isinstance(serving, CausalLM):
            models = [m for m in (serving, rollout) if m]
            own_bytes = 0
        elif rollout is None:
            raise ValueError("a serving engine with a KV cache of its own is co-served beside a rollout "
                             "model; give one")
        else:
            models = [rollout]
            kv = serving.kv_pages()
            own_bytes = kv.total * kv.page_bytes
            if own_bytes >= cfg.pool_bytes:
                raise ValueError(f"the serving engine's KV cache ({own_bytes / MB:g} MiB) leaves nothing "
                                 f"of pool_mb ({cfg.pool_mb:g}) to the rollout model")
        weights = [next(m.parameters()) for m in models]
        if len({w.device for w in weights}) > 1:
            raise ValueError(f"the serving model is on {weights[0].device}, the rollout model on "
                             f"{weights[1].device}; a co-serving executor runs both on one device")
        specs = [KVSpec.of(m.config, w.dtype) for m, w in zip(models, weights, strict=True)]
        self.pool = KVPool.for_specs(cfg.pool_bytes - own_bytes, *specs, device=weights[0].device)
        self.serving: ServingEngine = (
            NativeServing(serving, engine, serving_eos, self.pool, SERVING, ROLLOUT if adapter_mode else None)
            if isinstance(serving, CausalLM) else serving)
        self.rollout: LLMEngine | None = (LLMEngine(rollout, engine, rollout_eos, self.pool, ROLLOUT)
                                          if rollout else None)
        # The engine that runs the turns: the rollout model's, or serving's own in adapter mode.
        self.turns: LLMEngine | None = self.rollout
        if adapter_mode:
            assert isinstance(self.serving, NativeServing)
            self.turns = self.serving
        self.serving_page_bytes = self.serving.kv_pages().page_bytes
        # The serving engine's own cache in the pool's pages (0: it draws from the pool).
        self.own_pages = own_bytes // self.pool.page_bytes
        self.device_pages = self.pool.num_pages + self.own_pages
        self.burst = BurstController(self.device_pages, cfg.headroom, cfg.high_watermark)
        self.latency = FittedLatencyModel()
        self.tail = TailLatency(self.latency, cfg.admission_quantile)
        self.guard = SlackGuard()
        self.metrics = ExecutorMetrics((SERVING, ROLLOUT))
        self.slo = SLOBudgets.of(cfg)
        self._turns: dict[str, Turn] = {}
        # Per serving request: the rollout work it waited for.
        self._waited: dict[str, RolloutWait] = {}
        self._limit_s = math.inf  # the ceiling the current iteration was admitted under
        self._admitted: tuple[RolloutDemand, Admission] | None = None  # this iteration's, for the trace
        self._rolled: EngineStep | None = None  # this iteration's rollout part, if any ran
        # Called with one record per iteration when set (`rose serve --iteration-log`): what
        # admission and the burst state machine saw and decided, what each engine ran.
        self.trace: Callable[[dict[str, Any]], None] | None = None
        # Whether a serving request is on its way in (its server sets this): a rollout iteration
        # under `rose` is given up for it between two layers, so a request never waits out a
        # whole rollout iteration.
        self.serving_arrived: Callable[[], bool] = lambda: False
        self.served = self.served_within_slo = 0
        self._serving_ids = itertools.count()
        self._iterations = 0  # executor iterations so far (each runs serving's step once)
        # An emergency cut whose pages serving does not have yet: (its trigger's monotonic time,
        # the iterations run before it, the rollout budget it set).
        self._reclaim: tuple[float, int, int] | None = None
        self._preemptions = 0  # the serving engine's preemptions already counted in the metrics
        if cfg.policy is Policy.STATIC:
            rollout_pages = int(cfg.static_rollout_pages * self.device_pages)
            self.pool.set_budget(ROLLOUT, rollout_pages)
            self.pool.set_budget(SERVING, self.device_pages - rollout_pages)
        elif cfg.policy is Policy.ROSE:
            self.pool.set_budget(ROLLOUT, self.burst.budget)

    @classmethod
    def from_pretrained(cls, serving_path: str | Path, rollout_path: str | Path | None = None,
                        config: ExecutorConfig | None = None, device: str | None = None,
                        dtype: str | None = None, engine: Engine = Engine.NATIVE,
                        adapter_mode: bool = False) -> CoServingExecutor:
        """Both checkpoints loaded on `device`, in `dtype` (None: `rose.model.device`'s defaults:
        CUDA if there is one, in bfloat16; else the CPU, in float32). `engine`: what serves the
        serving model (vLLM needs a rollout model; its memory: on the CPU its KV cache is
        `config.serving_pool_share` of the pool, on a GPU `_vllm_on_gpu`). `adapter_mode`: no
        rollout checkpoint; turns ride the serving model with its adapters (`__init__`)."""
        config = config or ExecutorConfig()
        device, dtype = resolve(device, dtype)
        if adapter_mode:
            if rollout_path is not None or engine is not Engine.NATIVE:
                raise ValueError("adapter mode: rollouts ride the native engine's serving model; expected no "
                                 "rollout model and the native engine")
            serving = load_model(serving_path, dtype, device)
            executor = cls(serving, None, config, eos_ids(serving_path, serving.config), adapter_mode=True)
            return executor._with_tokenizers(serving_path, None)
        gpu_vllm = engine is Engine.VLLM and device.type == "cuda"
        check_memory_settings(config, gpu_vllm)
        if gpu_vllm:
            return cls._vllm_on_gpu(serving_path, rollout_path, config, device, dtype)._with_tokenizers(
                serving_path, rollout_path)
        rollout = load_model(rollout_path, dtype, device) if rollout_path else None
        rollout_eos = eos_ids(rollout_path, rollout.config) if rollout_path and rollout else ()
        if engine is Engine.VLLM:
            from rose.coserve.vllm_serving import VllmServing

            vllm = VllmServing.from_pretrained(
                serving_path, int(config.pool_bytes * config.serving_pool_share), str(device),
                str(dtype).removeprefix("torch."), **_vllm_limits(config))
            executor = cls(vllm, rollout, config, eos_ids(serving_path, ModelConfig.from_dir(serving_path)),
                           rollout_eos)
        else:
            serving = load_model(serving_path, dtype, device)
            executor = cls(serving, rollout, config, eos_ids(serving_path, serving.config), rollout_eos)
        return executor._with_tokenizers(serving_path, rollout_path)

    @classmethod
    def _vllm_on_gpu(cls, serving_path: str | Path, rollout_path: str | Path | None, config: ExecutorConfig,
                     device: torch.device, dtype: torch.dtype) -> CoServingExecutor:
        """vLLM serving on a GPU beside the rollout model, both within `config.gpu_memory_utilization`
        of it (`rose.coserve.device_memory`): vLLM first, in its share, which it sizes itself; then
        the rollout model, whose pool is what the budget has left (`pool_mb` is set to both caches)."""
        from rose.coserve.vllm_serving import VllmServing

        budget = GpuBudget.take(device, config.gpu_memory_utilization)
        share = config.gpu_memory_utilization * config.serving_pool_share
        vllm = VllmServing.from_pretrained(serving_path, None, str(device), str(dtype).removeprefix("torch."),
                                           memory_share=share, **_vllm_limits(config))
        held = budget.held()
        # vLLM's part: its share (its activations come and go), or what it holds if more.
        serving = max(math.ceil(budget.total * share), held)
        if rollout_path is None:
            return cls(vllm, None, config)  # refused there
        rollout = load_model(rollout_path, dtype, device)
        weights = budget.held() - held
        engine = _engine_config(config)
        activations = iteration_activations(rollout, engine.max_num_batched_tokens, engine.max_num_seqs)
        pool = rollout_pool_bytes(budget.bytes, serving, weights, activations)
        kv = vllm.kv_pages()
        sized = dataclasses.replace(config, pool_mb=(kv.total * kv.page_bytes + pool) / MB)
        return cls(vllm, rollout, sized, eos_ids(serving_path, ModelConfig.from_dir(serving_path)),
                   eos_ids(rollout_path, rollout.config))

    def _with_tokenizers(self, serving_path: str | Path, rollout_path: str | Path | None
                         ) -> CoServingExecutor:
        """Structured output on the native engines, over their checkpoints' tokenizers."""
        if isinstance(self.serving, LLMEngine):
            self.serving.use_checkpoint_tokenizer(serving_path)
        if self.rollout is not None and rollout_path is not None:
            self.rollout.use_checkpoint_tokenizer(rollout_path)
        return self

    @property
    def predict(self) -> LatencyModel:
        """What admission predicts an iteration with: two forwards, or one over both kinds of rows."""
        return OneForward(self.tail, SERVING) if self.adapter_mode else self.tail

    def profile(self) -> None:
        """Fit the latency model on both engines, or the one (a few seconds, at start-up)."""
        profile(self.serving, SERVING, self.latency)
        if self.rollout:
            profile(self.rollout, ROLLOUT, self.latency)
        self._preemptions = getattr(self.serving, "num_preemptions", 0)  # the profile's are no request's

    # -- serving requests ------------------------------------------------------------------------

    def add_serving(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queue a serving request (None: an id is made here; a serving engine needs one)."""
        request_id = f"serving-{next(self._serving_ids)}" if request_id is None else request_id
        self._check_free(request_id)
        return self.serving.add_request(prompt_token_ids, params, request_id)

    # -- the lease interface -----------------------------------------------------------------------

    def submit_turn(self, turn: Turn) -> str:
        """Queue a rollout turn; its outputs come from `step()` under `turn.turn_id`."""
        rollout = self._turn_engine()
        self._check_free(turn.turn_id)
        if len(self._turns) >= self.config.max_rollout_turns:
            raise TurnSlotsFull(f"turn {turn.turn_id!r}: all {self.config.max_rollout_turns} lease slots "
                                f"of this executor hold running turns")
        check_version(turn, rollout.policy_version, rollout.adapter_versions(), "executor")
        rollout.add_request(turn.token_ids, turn.params, turn.turn_id, priority=1, adapter=turn.adapter,
                            guest=self.adapter_mode)
        self._turns[turn.turn_id] = turn
        return turn.turn_id

    def abort(self, request_id: str) -> RequestOutput | None:
        if request_id in self._turns:
            self._turns.pop(request_id)
            self.metrics.turns_finished.labels("abort").inc()
            return self._turn_engine().abort(request_id)
        out = self.serving.abort(request_id)
        if out is not None:
            self.metrics.serving_finished(out)
        return out

    def abort_turn(self, turn_id: str) -> RequestOutput | None:
        """Abort a leased rollout turn (None if no such turn runs): the lease API's abort, which
        must not reach serving requests."""
        return self.abort(turn_id) if turn_id in self._turns else None

    def capacity(self) -> Capacity:
        """The report the rollout scheduler routes by. Free slots are counted as the simulator
        counts them: rollout turns of a typical context (the running ones' mean) that could
        decode beside the running ones within the serving SLOs (`rollout_capacity`), at most
        the free lease slots and what the free rollout pages hold (`memory_room`: none in a
        burst)."""
        rollout = self._turn_engine()
        running = len(self._turns)
        now = time.monotonic()
        state = self._serving_state()
        chunk = self.config.chunk_tokens
        contexts = [s.num_computed_tokens + 1 for s in self._turn_queues()[0]]
        typical = sum(contexts) // len(contexts) if contexts else self.config.typical_rollout_context
        turn_pages = rollout.blocks.pages_for(typical)
        room = min(self.config.max_rollout_turns - running,
                   memory_room(self.burst.state, self._rollout_room(), turn_pages))
        free = rollout_capacity(now, state, RolloutDemand(contexts), self.predict, self.slo, typical, chunk,
                                limit=room, share=self.guard.share)
        slack = iteration_limit(now, state, self.slo, self.predict, chunk, self.guard.share)
        slack -= self.tail.time(SERVING, state.load(chunk))
        # The newest policy version a turn runs on here: a LoRA run's policy is its adapter.
        version = newest_version(rollout)
        return Capacity(free, slack * 1e3, self.burst.state.name.lower(), version,
                        self.pool.budget(ROLLOUT), self.pool.used(ROLLOUT), running)

    def _rollout_room(self) -> int:
        """Pages the turns could map now, within the rollout budget less the pages they hold:
        free ones and those only a prefix cache holds (reclaimed as they are needed; counted as
        taken, a device whose turns' cache had filled its budget would report no room again)."""
        blocks = self._turn_blocks()
        cached = blocks.num_cached_pages + (0 if self.own_pages else self.serving.cached_pages())
        free = self.pool.num_free + cached
        return max(0, min(free, self.pool.budget(ROLLOUT) - blocks.num_active_pages))

    def new_rl_step(self) -> None:
        """A new RL step: the rollout budget may grow again after a burst."""
        before = self.burst.state
        self.burst.new_rl_step()
        self._transition(before, self.burst.state)
        self.metrics.state.set(int(self.burst.state))

    def _transition(self, before: BurstState, after: BurstState) -> None:
        if after is not before:
            labels = (before.name.lower(), after.name.lower())
            self.metrics.transitions.labels(*labels).inc()
            self.metrics.transition_time.labels(*labels).set(time.time())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                     in_flight: InFlight = InFlight.CONTINUE) -> None:
        """New rollout weights (between two iterations, like every call here: no other load passes
        the version check meanwhile). The same version again is a re-sync (a full copy after a
        failed delta, a restart); an older one raises StaleVersion."""
        if self.adapter_mode:
            raise ValueError("rollouts here ride the serving model, whose weights are serving's: their "
                             "policy is an adapter (push it as one: POST /v1/lease/weights?adapter=NAME)")
        rollout = self._turn_engine()
        if version < rollout.policy_version:
            raise StaleVersion(f"version {version}: the rollout model already has version "
                               f"{rollout.policy_version}; weight versions only move forward")
        rollout.load_weights(named_tensors, version, in_flight)

    def load_adapter(self, name: str, config: LoRAConfig, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None:
        """Load the rollout model's LoRA adapter `name`, or give it new tensors (all, or those that
        changed) as `version` (between two iterations); its turns running go on over their KV. Its
        versions move forward as the weights' do (StaleVersion); the serving model has none."""
        rollout = self._turn_engine()
        loaded = rollout.adapter_versions().get(name)
        if loaded is not None and version < loaded:
            raise StaleVersion(f"version {version}: adapter {name!r} already has version {loaded}; "
                               f"adapter versions only move forward")
        rollout.load_adapter(name, config, named_tensors, version)

    def has_unfinished(self) -> bool:
        return self.serving.has_unfinished() or bool(self.turns and self.turns.has_unfinished())

    # -- one iteration ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = (time.time(), time.monotonic())
        # What admission, the memory step and the trace read; a device that only serves needs none.
        state = self._serving_state() if self.turns or self.trace else ServingState()
        outputs = self._control_memory(state) if self.turns else []
        cut = len(outputs)
        self._limit_s, self._admitted, self._rolled = math.inf, None, None
        budget = self._rollout_token_budget(time.monotonic(), state) if self.turns else 0
        if self._turns:
            self.metrics.admissions.labels("held" if budget == 0 else "admitted").inc()
        if self.adapter_mode:
            outputs += self._one_forward(budget, started[1], state)
        else:
            ran, budget = self._two_forwards(budget)
            outputs += ran
        self._iterations += 1
        self._export_pool()
        if self.trace is not None:
            self.trace(self._iteration_record(started, state.waiting, cut, budget))
        return outputs

    def _two_forwards(self, budget: int | None) -> tuple[list[RequestOutput], int | None]:
        """Serving's batch, then the rollout model's with `budget` tokens (under `priority`, what
        serving's part left); the outputs, and the rollout budget it ran with."""
        outputs = self.serving.step()
        serving = self.serving.last_step
        self._measure(SERVING, serving)
        outputs = self._account(SERVING, outputs)
        if self.rollout and self.config.policy is Policy.PRIORITY:  # what serving's part left
            budget = priority_tokens(serving.load.prefill_tokens + serving.load.decode_seqs,
                                     self.rollout.config.max_num_batched_tokens)
        if self.rollout and self.rollout.has_unfinished() and budget != 0:
            interrupt = self.serving_arrived if self.config.policy is Policy.ROSE else None
            ran = self.rollout.step(budget, interrupt)
            step = self._rolled = self.rollout.last_step
            self._measure(ROLLOUT, step)
            if serving.load != TokenLoad() and not step.interrupted:
                self.metrics.rollout_beside_serving.inc(step.load.prefill_tokens + step.load.decode_seqs)
            outputs += self._account(ROLLOUT, ran)
            self._charge_rollout_time(step.seconds, time.monotonic())
            if self.config.policy is Policy.ROSE and not step.interrupted:
                self._observe_slack(serving.seconds + step.seconds)
        return outputs, budget

    def _one_forward(self, budget: int | None, started: float, state: ServingState) -> list[RequestOutput]:
        """Adapter mode: serving's batch and at most `budget` rollout tokens, in one forward. One
        with serving rows in it runs whole (admission's arrival reserve keeps room for a request
        that waits for it); one of rollout rows alone, on a device serving nothing, is given up
        for an arriving request under `rose`, as the rollout model's forward is."""
        engine = self._turn_engine()
        idle = not state.waiting and not len(state.decoding_last_token_s)
        interrupt = self.serving_arrived if self.config.policy is Policy.ROSE and idle else None
        ran = engine.step(guest_budget=budget, interrupt=interrupt)
        step = engine.last_step
        if step.interrupted:
            self._rolled = step
        # One forward: the latency model's one term; in the metrics, rollout's when it ran alone.
        self._measure(ROLLOUT if step.load == step.guests else SERVING, step, SERVING)
        turns = [out for out in ran if out.request_id in self._turns]
        outputs = self._account(SERVING, [out for out in ran if out.request_id not in self._turns])
        outputs += self._account(ROLLOUT, turns)
        if step.guests != TokenLoad():
            self._rolled = EngineStep(step.guests)  # its seconds are the forward's, serving's
            if step.load != step.guests:
                self.metrics.rollout_beside_serving.inc(step.guests.prefill_tokens + step.guests.decode_seqs)
            seconds = OneForward(self.tail, SERVING).rollout_seconds(step.load - step.guests, step.guests,
                                                                     step.seconds)
            self._charge_rollout_time(seconds, started)
            if self.config.policy is Policy.ROSE:
                self._observe_slack(step.seconds)
        return outputs

    def _iteration_record(self, started: tuple[float, float], waiting: Iterable[tuple[float, int]], cut: int,
                          budget: int | None) -> dict[str, Any]:
        """One iteration as the trace holds it: its start (Unix time), the serving requests waiting
        for their first token then (age in seconds, prompt tokens left), the burst state and pages
        after the memory step, admission's demand and decision, what each engine ran (in adapter
        mode each kind of row's part of the one forward, whose seconds are serving's)."""
        def ran(load: TokenLoad, seconds: float, interrupted: bool = False) -> dict[str, Any]:
            return {"prefill": load.prefill_tokens, "decodes": load.decode_seqs,
                    "context": load.context_tokens, "s": round(seconds, 5), "interrupted": interrupted}

        serving = self.serving.last_step
        record: dict[str, Any] = {
            "t": round(started[0], 4), "i": self._iterations, "state": self.burst.state.name.lower(),
            "waiting": [[round(started[1] - arrival, 4), tokens] for arrival, tokens in waiting],
            "pages": {"serving": self._pages(self.serving.kv_pages().active),
                      "rollout": self._turn_blocks().num_active_pages if self.turns else 0,
                      "budget": self.pool.budget(ROLLOUT), "free": self.pool.num_free},
            "cut": cut, "budget": budget, "share": round(self.guard.share, 3),
            "serving": ran(serving.load - serving.guests, serving.seconds)}
        if self._admitted is not None:
            demand, a = self._admitted
            record["admission"] = {
                "ready_decodes": len(demand.decode_context), "prefill_wanted": demand.prefill_tokens,
                "decodes": a.decode_seqs, "prefill": a.prefill_tokens,
                "predicted_s": round(a.iteration_s, 5), "limit_s": round(a.limit_s, 5)}
        if self._rolled is not None:
            record["rollout"] = ran(self._rolled.load, self._rolled.seconds, self._rolled.interrupted)
        return record

    def _charge_rollout_time(self, seconds: float, since: float) -> None:
        """Charge the rollout part of this iteration to each serving request in flight; a first
        token sampled by `since` (monotonic) came before it (two forwards: serving's part ran
        first; one forward: every token of it came after)."""
        now = time.monotonic()
        live = self.serving.in_flight(self._waited)
        for rid in self._waited.keys() - live.keys():
            del self._waited[rid]
        for rid, r in live.items():
            first = r.first_token_s is not None and r.first_token_s <= since
            self._waited.setdefault(rid, RolloutWait()).charge(seconds, now - r.arrival_s, first)

    def _observe_slack(self, measured_s: float) -> None:
        overruns = self.guard.overruns
        self.metrics.rollout_share.set(self.guard.observe(measured_s, self._limit_s))
        self.metrics.admission_overruns.inc(self.guard.overruns - overruns)

    def _measure(self, name: str, step: EngineStep, model: str | None = None) -> None:
        """`name`'s part of the iteration: its time, which refits the latency model's `model`
        term (None: `name`'s)."""
        if step.interrupted:
            self.metrics.rollout_interrupted.inc()
        self.latency.observe(model or name, step.load, step.seconds)
        if step.seconds:
            self.metrics.iterations.labels(name).inc()
            self.metrics.busy.labels(name).inc(step.seconds)

    def _account(self, name: str, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Each request's part of the iteration (`name`'s): its tokens, and what finished."""
        for out in outputs:
            if name == ROLLOUT:
                self.metrics.rollout_tokens.inc(len(out.token_ids))
                if out.finished:
                    self._turns.pop(out.request_id, None)
                    self.metrics.turns_finished.labels(out.finish_reason or "abort").inc()
            else:
                self.metrics.serving_output(out)
                if out.finished:
                    self._record_serving(out)
        return outputs

    def _record_serving(self, out: RequestOutput) -> None:
        latencies = self.metrics.serving_finished(out)
        if latencies is None:
            return  # aborted before its first token
        ttft, tpot = latencies
        self.metrics.serving_requests.inc()
        self.served += 1
        if ttft <= self.slo.ttft_s and tpot <= self.slo.tpot_s:
            self.metrics.slo_met.inc()
            self.served_within_slo += 1
        self.metrics.slo_attainment.set(self.served_within_slo / self.served)

    def _control_memory(self, state: ServingState) -> list[RequestOutput]:
        """The burst state machine (rose only): set the rollout budget, abort what no longer fits."""
        if self.config.policy is Policy.PRIORITY:
            self._priority_memory(state)
        if self.config.policy is not Policy.ROSE:
            return []
        triggered = time.monotonic()
        self._check_reclaim()
        before = self.burst.state
        held = [(s.request_id, len(s.block_table))
                for s in sorted(self._rollout_seqs(), key=lambda s: s.arrival)]
        # Pages only a prefix cache holds are reclaimable: they count as free here. A prompt that
        # waits for pages is serving's usage already: counted only once allocated, a spike's second
        # long prompt could wait behind rollout pages with free pages still above the trigger.
        # (vLLM's prompts wait for its own cache, which no cut can grow.)
        serving = self._pages(self.serving.kv_pages().active)
        if isinstance(self.serving, NativeServing):
            serving += self._next_chunk_pages(state)
        decision = self.burst.observe(serving, held)
        self.pool.set_budget(ROLLOUT, decision.rollout_budget)
        m = self.metrics
        self._transition(before, decision.state)
        m.state.set(int(decision.state))
        m.rollout_budget.set(decision.rollout_budget)
        if decision.cut:
            pages = dict(held)
            m.cuts.inc()
            m.cut_pages.inc(sum(pages[rid] for rid in decision.abort))
            # A cut while an earlier one's pages are still to come is timed from the earlier.
            start, iterations = self._reclaim[:2] if self._reclaim else (triggered, self._iterations)
            self._reclaim = (start, iterations, decision.rollout_budget)
        aborted = [out for rid in decision.abort if (out := self.abort(str(rid))) is not None]
        m.rollout_aborts.inc(len(aborted))
        self._check_reclaim()
        return aborted

    def _next_chunk_pages(self, state: ServingState) -> int:
        """The pages native serving's next prefill chunk takes: its waiting prompts' next
        `chunk_tokens`, and a partly filled page each."""
        assert isinstance(self.serving, NativeServing)
        pending = min(self.config.chunk_tokens, sum(tokens for _, tokens in state.waiting))
        return self.serving.blocks.pages_for(pending) + len(state.waiting)

    def _priority_memory(self, state: ServingState) -> None:
        """The `priority` policy's memory: rollouts may hold what serving leaves of the pool
        after its next iteration; the newest running rollout sequences beyond it are preempted
        (recomputed later, as vLLM preempts its lowest-priority requests). Where serving has a KV
        cache of its own (vLLM's), the rollout pool is the rollouts' whole."""
        used = next_pages = 0
        if isinstance(self.serving, NativeServing):
            # Its next chunk's pages, and one more page per decode it may extend.
            next_pages = self._next_chunk_pages(state) + len(state.decoding_last_token_s)
            used = self.pool.used(SERVING)
        budget = priority_pages(self.pool.num_pages, used, next_pages)
        self.pool.set_budget(ROLLOUT, budget)
        self.metrics.rollout_budget.set(budget)
        rollout = self._turn_engine()
        for seq in sorted(self._turn_queues()[0], key=lambda s: s.sort_key, reverse=True):
            if self.pool.used(ROLLOUT) <= budget:
                break
            rollout.scheduler.preempt(seq)
            rollout.num_preemptions += 1

    def _check_reclaim(self) -> None:
        """Whether the pages of the last emergency cut are serving's yet: rollouts hold no more
        than its budget (what they release only their prefix cache keeps, reclaimed on demand)."""
        if self._reclaim is None or self._turn_blocks().num_active_pages > self._reclaim[2]:
            return
        start, iterations, _ = self._reclaim
        self.metrics.reclaim_seconds.observe(time.monotonic() - start)
        self.metrics.reclaim_iterations.observe(self._iterations - iterations)
        self._reclaim = None

    def _rollout_token_budget(self, now: float, state: ServingState) -> int | None:
        """Rollout tokens that may join this iteration (None: no limit; under `priority` it is
        set after serving's part has run, from the tokens that part took)."""
        policy = self.config.policy
        if policy in (Policy.NAIVE, Policy.PRIORITY):
            return None
        if policy is Policy.STATIC:
            return self.config.static_rollout_tokens
        running, waiting = self._turn_queues()
        ready = sorted((s for s in running if s.num_uncomputed == 1), key=lambda s: s.sort_key)
        # Everything else still has prompt to prefill (a waiting one-token prompt too).
        demand = RolloutDemand(
            decode_context=[s.num_computed_tokens + 1 for s in ready],
            prefill_tokens=sum(s.num_uncomputed for s in waiting)
            + sum(s.num_uncomputed for s in running if s.num_uncomputed > 1))
        cfg = self.config
        decision = admission_step(now, state, demand, self.predict, self.slo, cfg.chunk_tokens,
                                  self.guard.share, cfg.arrival_reserve_tokens, cfg.idle_min_rollout_tokens)
        self._limit_s, self._admitted = decision.limit_s, (demand, decision)
        self.metrics.latency_error.set(self.latency.error)
        self.metrics.slack.set(min(decision.prefill_slack_s, decision.decode_slack_s))
        return decision.rollout_tokens

    def _serving_state(self) -> ServingState:
        return serving_state(self.serving.in_flight(self._waited).values())

    def _rollout_seqs(self) -> list[Sequence]:
        running, waiting = self._turn_queues()
        return running + waiting

    def _turn_queues(self) -> tuple[list[Sequence], list[Sequence]]:
        """The turns running and waiting (in adapter mode, the serving engine's guests)."""
        sched = self._turn_engine().scheduler
        if not self.adapter_mode:
            return sched.running, sched.waiting
        return [s for s in sched.running if s.guest], [s for s in sched.waiting if s.guest]

    def _turn_blocks(self) -> BlockManager:
        """The block tables of the turns' pages."""
        engine = self._turn_engine()
        return engine.guest_blocks if engine.guest_blocks is not None else engine.blocks

    def _export_pool(self) -> None:
        """The gauges of the batch and the pool, after each iteration."""
        m = self.metrics
        running, waiting = self.serving.queue_lengths()
        m.running.labels(m.model_name).set(running)
        m.waiting.labels(m.model_name).set(waiting)
        # The native engine counts its preemptions; an engine that does not exports none.
        preemptions = getattr(self.serving, "num_preemptions", 0)
        m.preemptions.labels(m.model_name).inc(preemptions - self._preemptions)
        self._preemptions = preemptions
        cached = self.serving.cached_pages()
        kv = self.serving.kv_pages()
        # Serving's pages, its prefix cache's included: the pool's count, or its own cache's.
        serving = self._pages(kv.active + cached) if self.own_pages else self.pool.used(SERVING)
        free = self.pool.num_free + max(0, self.own_pages - serving)
        m.set_kv_usage((kv.active, kv.total), (self._turn_blocks().num_active_pages, self.pool.num_pages)
                       if self.turns is not None else None)
        m.turns_running.set(len(self._turns))
        m.pool_pages.labels(SERVING).set(serving)
        m.pool_pages.labels(ROLLOUT).set(self.pool.used(ROLLOUT))
        m.cached_pages.labels(SERVING).set(self._pages(cached))
        if self.turns is not None:
            m.cached_pages.labels(ROLLOUT).set(self._turn_blocks().num_cached_pages)
        m.pool_pages.labels("free").set(free)

    def _pages(self, serving_pages: int) -> int:
        """The serving engine's pages in the pool's (the same where it draws from the pool)."""
        return -(-serving_pages * self.serving_page_bytes // self.pool.page_bytes)

    def _turn_engine(self) -> LLMEngine:
        if self.turns is None:
            raise ValueError("this executor has no rollout model (start it with --rollout-model, or "
                             "--rollout-adapter for rollouts on the serving model)")
        return self.turns

    def _check_free(self, request_id: str) -> None:
        engines = [self.serving, *([self.rollout] if self.rollout else [])]
        if any(e.has_request(request_id) for e in engines):
            raise ValueError(f"request {request_id!r}: the id is already in use on this executor")
