"""Dual-SLO admission inside vLLM's scheduler: co-serving on one vLLM engine (a prototype;
docs/vllm.md, "Co-serving on vLLM").

vLLM holds one model per engine, so here serving requests (priority 0) and rollout turns
(priority 1) are requests of one model, in one forward pass. `DualSLOScheduler` is vLLM's
scheduler with ROSE's admission in front of it; at every `schedule()`:
1. it reads serving's state (each serving request's arrival, first and last token, prompt still
   to prefill) and the rollout demand (decodes ready, prompt tokens waiting);
2. `admission.admission_step`, the step the native executor and the simulator run, decides how
   many rollout decodes and prefill tokens may join, predicted with a latency model fitted on
   this engine's own iterations and read at a quantile of its error, scaled by the feedback guard;
3. the rollout requests not admitted are held out of vLLM's `running` list and `waiting` queue
   while vLLM's own `schedule()` runs, serving goes first in `running`, and vLLM's token budget
   (`max_num_scheduled_tokens`, read at every call) is serving's share plus what was admitted.

What it leaves to vLLM, said plainly: memory (with `scheduling_policy="priority"` a serving
request short of KV blocks preempts the lowest-priority running request, a rollout, which vLLM
recomputes later: nothing is handed back to the rollout scheduler); and the iteration itself (a
serving request that arrives mid-iteration waits for its end: no interruption between layers).

This module imports vLLM: vLLM loads the scheduler by name (`scheduler_cls`), and only the
vLLM venv (`make install-vllm`) imports it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from rose.contracts import TokenLoad
from rose.coserve.admission import (
    RolloutDemand,
    RolloutWait,
    ServingRequest,
    ServingState,
    SlackGuard,
    SLOBudgets,
    admission_step,
    serving_state,
)
from rose.coserve.latency import FittedLatencyModel, OneForward, TailLatency, profile_batches
from rose.coserve.settings import ExecutorConfig
from rose.engine.vllm_engine import VllmEngine

SERVING_PRIORITY, ROLLOUT_PRIORITY = 0, 1
MODEL = "engine"  # one model: the latency model has one term


@dataclasses.dataclass
class _Served:
    """A serving request's account: what admission's slacks and inflation budgets read."""

    arrival: float
    outputs: int = 0
    first: float | None = None
    last: float | None = None
    wait: RolloutWait = dataclasses.field(default_factory=RolloutWait)


@dataclasses.dataclass(frozen=True)
class _Iteration:
    serving: TokenLoad
    rollout: TokenLoad
    limit_s: float
    started: float


class DualSLOScheduler(Scheduler):
    """vLLM's scheduler with dual-SLO admission of priority-1 (rollout) requests. Until
    `configure` is called it schedules as vLLM's own, only measuring its iterations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slo: SLOBudgets | None = None
        self.settings = ExecutorConfig()
        self.latency = FittedLatencyModel()
        self.tail = TailLatency(self.latency)
        self.guard = SlackGuard()
        self.full_budget, self.full_active = self.max_num_scheduled_tokens, self.max_num_active_reqs
        self.held_iterations = 0  # iterations with rollout work waiting and none admitted
        self._served: dict[str, _Served] = {}
        self._iteration: _Iteration | None = None

    def configure(self, settings: ExecutorConfig) -> None:
        """Admission on, under the native executor's settings (its SLOs, inflation budgets,
        quantile, chunk, arrival reserve and idle minimum)."""
        self.settings, self.slo = settings, SLOBudgets.of(settings)
        self.tail = TailLatency(self.latency, settings.admission_quantile)

    def add_request(self, request: Any) -> None:
        super().add_request(request)
        if request.priority == SERVING_PRIORITY:
            self._served[request.request_id] = _Served(time.monotonic())

    # -- one iteration ---------------------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        held_running, held_waiting, limit = self._hold(time.monotonic()) if self.slo else ([], [], math.inf)
        # The held requests keep their slots: vLLM must not fill them from the waiting queue.
        self.max_num_active_reqs = self.full_active - len(held_running)
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self.running += held_running
            for request in held_waiting:
                self.waiting.add_request(request)
            self.max_num_scheduled_tokens, self.max_num_active_reqs = self.full_budget, self.full_active
        self._iteration = _Iteration(*self._loads(out.num_scheduled_tokens), limit, time.perf_counter())
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        it, self._iteration = self._iteration, None
        seconds = time.perf_counter() - it.started if it else 0.0
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        now = time.monotonic()
        if it and seconds > 0:
            self.latency.observe(MODEL, it.serving + it.rollout, seconds)
            if it.rollout != TokenLoad():
                self._charge(it, seconds, now)
                if math.isfinite(it.limit_s):
                    self.guard.observe(seconds, it.limit_s)
        for rid, acct in list(self._served.items()):
            request = self.requests.get(rid)
            if request is None:
                del self._served[rid]
            elif request.num_output_tokens > acct.outputs:
                acct.first = acct.first or now
                acct.last, acct.outputs = now, request.num_output_tokens
        return outputs

    # -- admission ---------------------------------------------------------------------------------

    def _hold(self, now: float) -> tuple[list[Any], list[Any], float]:
        """Admit rollout work for this iteration: the rollout requests held out of it, and the
        iteration-time ceiling they were admitted under."""
        assert self.slo is not None
        serving_running = [r for r in self.running if r.priority == SERVING_PRIORITY]
        rollout_running = sorted((r for r in self.running if r.priority != SERVING_PRIORITY),
                                 key=lambda r: r.arrival_time)
        decoding = [r for r in rollout_running if _remaining(r) == 1]
        prefilling = [r for r in rollout_running if _remaining(r) > 1]
        waiting = [r for r in self.waiting if r.priority != SERVING_PRIORITY]
        serving_waiting = [r for r in self.waiting if r.priority == SERVING_PRIORITY]
        state = self._serving_state(serving_running + serving_waiting)
        demand = RolloutDemand([r.num_computed_tokens + 1 for r in decoding],
                               sum(_remaining(r) for r in prefilling + waiting))
        if not demand.decode_context and not demand.prefill_tokens:
            return [], [], math.inf
        cfg = self.settings
        decision = admission_step(now, state, demand, OneForward(self.tail, MODEL), self.slo,
                                  cfg.chunk_tokens, self.guard.share, cfg.arrival_reserve_tokens,
                                  cfg.idle_min_rollout_tokens)
        d, p = decision.decode_seqs, decision.prefill_tokens
        if serving_waiting:
            # vLLM schedules its waiting queue after the running list: a running rollout prefill
            # would take the tokens meant for serving's prompt first.
            p = 0
        if d + p == 0:
            self.held_iterations += 1
        held_running = decoding[d:] + ([] if p else prefilling)
        held_waiting = [] if p else waiting
        held = {id(r) for r in held_running}
        self.running = serving_running + [r for r in rollout_running if id(r) not in held]
        self.waiting.remove_requests(held_waiting)
        serving = state.load(cfg.chunk_tokens)
        serving_tokens = serving.prefill_tokens + serving.decode_seqs
        self.max_num_scheduled_tokens = min(self.full_budget, serving_tokens + d + p)
        return held_running, held_waiting, decision.limit_s

    def _serving_state(self, requests: list[Any]) -> ServingState:
        accounts = sorted(((self._served[r.request_id], r) for r in requests), key=lambda ar: ar[0].arrival)
        return serving_state(ServingRequest(a.arrival, _remaining(r), r.num_tokens, a.first, a.last,
                                            a.outputs, a.wait) for a, r in accounts)

    def _loads(self, scheduled: dict[str, int]) -> tuple[TokenLoad, TokenLoad]:
        """Serving's and rollout's share of the iteration just scheduled."""
        loads = {SERVING_PRIORITY: [0, 0, 0], ROLLOUT_PRIORITY: [0, 0, 0]}
        for rid, n in scheduled.items():
            request = self.requests[rid]
            load = loads[SERVING_PRIORITY if request.priority == SERVING_PRIORITY else ROLLOUT_PRIORITY]
            if n == 1 and request.num_computed_tokens == request.num_tokens:  # computed just now
                load[1] += 1
                load[2] += request.num_computed_tokens
            else:
                load[0] += n
        return TokenLoad(*loads[SERVING_PRIORITY]), TokenLoad(*loads[ROLLOUT_PRIORITY])

    def _charge(self, it: _Iteration, seconds: float, now: float) -> None:
        """Charge the rollout part of a shared iteration (its predicted share of the measured
        time) to each serving request in flight. Tokens come at the end of the one forward, so a
        first token of this iteration waited for it (its account is updated after this)."""
        rollout_s = OneForward(self.tail, MODEL).rollout_seconds(it.serving, it.rollout, seconds)
        for acct in self._served.values():
            acct.wait.charge(rollout_s, now - acct.arrival, acct.first is not None)


def _remaining(request: Any) -> int:
    """Tokens the request has still to compute before its next token (1: ready to decode)."""
    return request.num_tokens - request.num_computed_tokens


class VllmCoServing:
    """A `VllmEngine` whose scheduler is `DualSLOScheduler` (`policy="dual_slo"`) or vLLM's own
    (`"priority"`: serving first, `"fcfs"`: first come first served), profiled at start-up."""

    POLICIES = ("dual_slo", "priority", "fcfs")

    def __init__(self, engine: VllmEngine, policy: str) -> None:
        self.engine, self.policy = engine, policy
        self.scheduler = engine.llm.engine_core.engine_core.scheduler  # in process: the same object

    @classmethod
    def from_pretrained(cls, path: str | Path, policy: str,
                        settings: ExecutorConfig | None = None) -> VllmCoServing:
        """`settings`: the native executor's (its pool is vLLM's KV cache here; its admission
        settings are the dual-SLO scheduler's)."""
        if policy not in cls.POLICIES:
            raise ValueError(f"policy {policy!r}: expected one of {', '.join(cls.POLICIES)}")
        settings = settings or ExecutorConfig()
        engine = VllmEngine.from_pretrained(
            path, settings.pool_bytes, scheduling_policy="fcfs" if policy == "fcfs" else "priority",
            scheduler_cls=f"{__name__}.{DualSLOScheduler.__name__}", max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.chunk_tokens + settings.max_num_seqs)
        coserving = cls(engine, policy)
        coserving.profile()
        if policy == "dual_slo":
            coserving.scheduler.configure(settings)
        return coserving

    def profile(self) -> None:
        """The native executor's start-up profile, on this engine: the scheduler measures each
        iteration (configured or not), then the fit starts its error count afresh. What it
        measured before (the engine's warm-up: 2.4 s for its first iteration on the tiny Qwen3,
        against 6 ms after) is dropped."""
        self.scheduler.latency = FittedLatencyModel()
        max_len = self.engine.llm.vllm_config.model_config.max_model_len
        for k, (prompts, params) in enumerate(profile_batches(self.engine.vocab_size, max_len)):
            for i, prompt in enumerate(prompts):
                self.engine.add_request(prompt, params, f"rose-profile-{k}-{i}")
            while self.engine.has_unfinished():
                self.engine.step()
        self.engine.llm.reset_prefix_cache()
        self.scheduler.latency.fit()
        self.scheduler.latency.reset_error()
        self.scheduler.tail = TailLatency(self.scheduler.latency, self.scheduler.tail.quantile)
