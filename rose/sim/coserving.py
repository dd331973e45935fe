"""Co-serving planning: the serving replicas that lend their idle capacity to rollouts, tick by
tick. Per replica with rollout work, the executor's admission step
(`rose.coserve.admission.admission_step`) for iterations that carry a serving prefill chunk and
for decode-only ones, the share of the tick each takes, and the rollout rates that follow; the
free slots each reports to the rollout scheduler; serving alone where no rollout work shares a
replica. Its memory is `burst.BurstMemory`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from rose.contracts import TokenLoad
from rose.coserve.admission import (
    Admission,
    Num,
    RolloutDemand,
    ServingState,
    SLOBudgets,
    admission_step,
    memory_room,
    rollout_capacity,
    rollout_duty,
)
from rose.coserve.loadgen import fit_lengths
from rose.sim.aggregate import AggregateServing
from rose.sim.burst import BurstMemory
from rose.sim.costs import (
    Device,
    Efficiency,
    ForwardCost,
    ModelShape,
    OneForwardLatency,
    RooflineLatency,
    forward_cost,
    model_by_name,
)
from rose.sim.rates import WorkerLoad, plan_rates
from rose.sim.rollout import TickRates
from rose.sim.scenarios import Scenario, ServingFleetConfig
from rose.sim.serving import ServingFleet
from rose.sim.systems import Sharing
from rose.sim.workers import Workers
from rose.traces import Trace, densest, diurnal_for_peak, load_trace

# Per serving replica: (prefill-iteration time, decode-iteration time, serving prefill tokens per
# prefill iteration), what `ServingFleet.advance` runs a tick with.
ServingTimes = tuple[np.ndarray, np.ndarray, np.ndarray]


def spike_start(trace: Trace, s: ServingFleetConfig) -> float:
    """The trace time (unscaled) a replay starts at so that its spike (`s.spike_s` seconds of the
    most KV tokens, as replayed at `s.load`) comes `s.spike_at_s` seconds into the run (sooner
    where the trace has less before it), on a flat day (the scenario's check)."""
    at, _ = densest(trace.arrival_s / s.load, trace.prompt_tokens + trace.output_tokens, s.spike_s)
    return max(0.0, at - s.spike_at_s) * s.load


def replay_start(trace: Trace, s: ServingFleetConfig) -> float | None:
    """The trace time (unscaled) every replica's replay starts at: where its spike comes
    `s.spike_at_s` in, or `s.replay_start_s` in as replayed; None: a random point per replica."""
    if s.spike_at_s is not None:
        return spike_start(trace, s)
    return None if s.replay_start_s is None else s.replay_start_s * s.load


def rollout_weight_bytes(sc: Scenario) -> float:
    """What a serving replica holds for its rollouts beside serving's weights: the policy's
    weights, or in adapter mode (`serving.rollout`) the adapter's tensors."""
    s = sc.serving
    if s.rollout == "adapter":
        return model_by_name(sc.models.serving).adapter_bytes(s.adapter_rank)
    return model_by_name(sc.models.policy).weight_bytes


def pool_bytes(sc: Scenario, device: Device, eff: Efficiency, alone: bool = False) -> int:
    """A serving replica's page pool, in bytes, for serving's KV and the rollouts' (`alone`: no
    rollout weights beside serving's): the executor's pool_mb where the scenario sets it, else
    what the GPUs' memory leaves beside the weights."""
    e = sc.serving.executor
    if "pool_mb" in e.changed():
        return e.pool_bytes
    rollout = 0.0 if alone else rollout_weight_bytes(sc)
    return int(device.memory * sc.cluster.serving_tp * eff.memory_utilization
               - model_by_name(sc.models.serving).weight_bytes - rollout)


class CoServing:
    """`n` serving replicas of `serving_model`, the co-serving workers `first_wid` on, lending
    capacity to rollouts of `policy` (`alone`: serving only, no rollout weights beside it);
    `typical_ctx`: the context a new turn is budgeted at; `sharing`: ROSE's admission and burst
    control, naive sharing (none) or a static split."""

    def __init__(self, sc: Scenario, device: Device, eff: Efficiency, policy: ModelShape,
                 serving_model: ModelShape, n: int, first_wid: int, typical_ctx: int, sharing: Sharing,
                 alone: bool) -> None:
        s, c = sc.serving, sc.cluster
        self.settings = e = s.executor
        self.n, self.first_wid, self.typical_ctx, self.sharing = n, first_wid, typical_ctx, sharing
        self.dt, self.chunk = sc.sim.tick_s, e.chunk_tokens
        self.batched_tokens = float(sc.rl.rollout_batched_tokens)
        # The time a serving iteration leaves the GPU idle for a rollout engine beside it; in adapter
        # mode there is none: one engine, whose host time idles the GPU for its rollout rows too.
        self.adapter = s.rollout == "adapter"
        self.host_s = 0.0 if self.adapter else s.engine_host_share * s.engine_overhead_ms / 1e3
        self.policy, self.serving_model = policy, serving_model
        self.slo = SLOBudgets.of(e)
        trace = load_trace(s.trace).scaled(prompt_tokens=s.prompt_scale, output_tokens=s.output_scale)
        if s.max_context:
            # Lengths clipped as the runtime's trace replay clips them to the serving model's context.
            prompts, outputs = fit_lengths(trace, s.max_context, s.max_output)
            trace = Trace(trace.name, trace.arrival_s, prompts, outputs)
        diurnal = diurnal_for_peak(s.trace, s.minute_peak_to_mean)
        roofline = forward_cost(serving_model, device, c.serving_tp, eff)
        self.serve_cost = dataclasses.replace(roofline, fixed=roofline.fixed + s.engine_overhead_ms / 1e3)
        replay = (n, trace, trace.mean_rate * s.load, diurnal, s.start_hour * 3600.0, e.chunk_tokens,
                  sc.sim.seed + 1, replay_start(trace, s))
        self.fleet = (AggregateServing(*replay, decode_floor_s=float(self.serve_cost.time(0, 1, 0)))
                      if sc.sim.serving_model == "aggregate" else ServingFleet(*replay))
        self.cs_cost = forward_cost(policy, device, c.serving_tp, eff)
        self.latency: RooflineLatency | OneForwardLatency = (
            OneForwardLatency(self.serve_cost, ForwardCost.of_adapter(serving_model, s.adapter_rank, device,
                                                                      c.serving_tp, eff))
            if self.adapter else RooflineLatency(self.serve_cost, self.cs_cost))
        self.pool = pool_bytes(sc, device, eff, alone)
        if self.pool <= 0:
            raise ValueError(f"scenario {sc.name}: {serving_model.name} and {policy.name} do "
                             f"not fit together on {c.serving_tp} x {device.name}; raise serving_tp")
        self.memory = BurstMemory(n, self.pool, e.headroom, e.high_watermark, sharing, e.static_rollout_pages,
                                  policy.kv_bytes_per_token, serving_model.kv_bytes_per_token,
                                  sc.rl.step_after_burst_s)

    # -- serving alone ---------------------------------------------------------------------------
    def prefill_chunk(self) -> np.ndarray:
        """Each replica's serving prefill chunk: what waits, up to `chunk_tokens` (at least 1)."""
        return np.clip(self.fleet.prefill_backlog(), 1.0, float(self.chunk))

    def alone_times(self) -> tuple[np.ndarray, np.ndarray]:
        """(prefill-iteration, decode-iteration) times of every serving replica, no rollout."""
        f = self.fleet
        dec, ctx = f.decode_seqs(), f.decode_context()
        t_p = self.serve_cost.time(self.prefill_chunk(), dec, ctx)
        t_d = self.serve_cost.time(0, dec, ctx)
        return t_p, np.maximum(t_d, 1e-4)

    def advance(self, t: float, times: ServingTimes | None = None) -> None:
        """Serving runs the tick from t: at `times` (a tick's plan), or alone."""
        if times is None:
            self.fleet.arrivals_until(t + self.dt)
            times = (*self.alone_times(), self.prefill_chunk())
        self.fleet.advance(t, self.dt, *times)

    def idle_until(self, t: float, t_end: float) -> float:
        """Serving runs alone (no rollout) until t_end; returns the tick time reached."""
        while t < t_end:
            self.advance(t)
            t += self.dt
        return t

    def seq_s(self) -> np.ndarray:
        """Each replica's time per token of one typical rollout sequence: the serving model's
        decodes run in every iteration too, and the rollout's own iterations in its host time (in
        adapter mode the sequence's row rides serving's decode iterations, and that is all)."""
        _, t_d = self.alone_times()
        if self.adapter:
            serving = TokenLoad(0, self.fleet.decode_seqs(), self.fleet.decode_context())
            return np.maximum(t_d, self.latency.iteration_time(serving, TokenLoad(0, 1, self.typical_ctx)))
        one = float(self.cs_cost.time(0, 1, self.typical_ctx))
        return (t_d + one) / (1.0 + math.floor(self.host_s / one))

    # -- the rollout scheduler's view --------------------------------------------------------------
    def free_slots(self, t: float, workers: Workers,
                   held: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Each registered executor's capacity report (workers, free rollout slots): from its
        memory budget (`memory_room`) and its compute slack (`rollout_capacity`), as the executor
        counts them; every executor's at once. `held(wids)`: the KV tokens of each sequence holding pages on
        those workers, [workers, sequences]."""
        reps = np.flatnonzero(workers.registered[self.first_wid:])
        wids = self.first_wid + reps
        if not len(reps):
            return wids, np.zeros(0, np.int64)
        running = RolloutDemand(held(wids))
        free = workers.kv_cap[wids] - running.context_tokens
        room = memory_room(self.memory.state(reps), free, self.typical_ctx)
        if self.sharing is Sharing.ROSE:
            room = rollout_capacity(t, self.fleet.admission_state(t, reps), running, self.latency, self.slo,
                                    self.typical_ctx, self.chunk, room)
        return wids, np.broadcast_to(room, wids.shape)

    # -- the tick's plan ---------------------------------------------------------------------------
    def plan(self, plan: TickRates, t: float, load: WorkerLoad,
             contexts_of: Callable[[np.ndarray], np.ndarray]) -> ServingTimes:
        """Per serving replica with rollout work: admission for prefill-chunk iterations and for
        decode-only ones, the share of the tick each takes, and the rollout rates that follow
        (written into `plan`), every replica's at once; `load` per worker (`rates.WorkerLoad`),
        `contexts_of(wids)` the contexts of the sequences `load` counts on those workers, in the
        order admission takes them, [workers, sequences]. Returns the serving fleet's times for
        the tick; replicas without rollout work run serving alone."""
        f, chunk = self.fleet, self.chunk
        decoding, _, pending, _ = load
        t_p, t_d = self.alone_times()
        serve_pf = self.prefill_chunk()   # as admission sees serving's share (`ServingState.load`)
        mine = slice(self.first_wid, self.first_wid + self.n)
        busy = np.flatnonzero((decoding[mine] > 0) | (pending[mine] > 0))
        if not len(busy):
            return t_p, t_d, serve_pf
        wids = self.first_wid + busy
        contexts = contexts_of(wids)
        # Fluid prefill leaves fractions of a token: a fraction still needs an iteration.
        demand = RolloutDemand(contexts, np.ceil(pending[wids]).astype(np.int64))
        backlog = f.prefill_backlog()[busy]
        if self.sharing is Sharing.ROSE:
            a_p, a_d, duty_p, duty_d = self._admit(t, f.admission_state(t, busy), demand)
        else:
            dec, ctx = f.decode_seqs()[busy], f.decode_context()[busy]
            a_p, a_d, serve_pf[busy] = (self._naive(dec, ctx, demand, backlog, chunk)
                                        if self.sharing is Sharing.NAIVE else
                                        self._static(dec, ctx, demand, serve_pf[busy]))
            # Without burst control a serving prompt waits for pages: under naive sharing what the
            # rollouts leave of the pool, under a static split serving's own share of it.
            static = self.sharing is Sharing.STATIC
            rollout_bytes = contexts.sum(axis=1) * self.policy.kv_bytes_per_token
            serving_room = self.pool - (self.memory.static_bytes if static else rollout_bytes)
            blocked = (serving_room - f.kv_tokens()[busy] * self.serving_model.kv_bytes_per_token
                       < f.first_waiting_prompt()[busy] * self.serving_model.kv_bytes_per_token)
            serve_pf[busy[blocked]] = 0.0           # no free pages for the next serving prompt
            duty_d = duty_p = 1.0
        tp, td = np.maximum(a_p.iteration_s, 1e-4), np.maximum(a_d.iteration_s, 1e-4)
        t_p[busy], t_d[busy] = tp, td
        pf = serve_pf[busy]
        queued = (backlog > 0) & (pf > 0)
        frac = np.where(queued, np.minimum(1.0, backlog / np.where(queued, pf, 1.0) * tp / self.dt), 0.0)
        plan.cap1[wids], plan.rate1[wids] = a_d.decode_seqs, (1.0 - frac) * duty_d / td
        plan.cap2[wids], plan.rate2[wids] = a_p.decode_seqs, frac * duty_p / tp
        plan.prefill_rate[wids] = ((1.0 - frac) * duty_d * a_d.prefill_tokens / td
                                   + frac * duty_p * a_p.prefill_tokens / tp)
        if self.host_s:
            self._in_host_time(plan, wids, (1.0 - frac) / td + frac / tp, load)
        return t_p, t_d, serve_pf

    def _in_host_time(self, plan: TickRates, wids: np.ndarray, serving_iters_per_s: np.ndarray,
                      load: WorkerLoad) -> None:
        """While each serving iteration's engine works on the host the GPU idles, and the rollout
        engine beside it runs as on a GPU of its own: as many whole decode iterations of all its
        sequences as fit in that time (`host_s`), its prompts prefilled in chunks that fit;
        added to what admission gives it inside serving's iterations."""
        dec, ctx, pending, prompts = (x[wids] for x in load)
        own, _ = plan_rates(dec, ctx, pending, prompts, self.cs_cost, self.dt, self.batched_tokens)
        t_d = self.cs_cost.time(0.0, np.maximum(dec, 1), ctx)
        share = serving_iters_per_s * np.floor(self.host_s / t_d) * t_d   # of the tick, the GPU's
        plan.rate0[wids] = share * own.rate1
        plan.prefill_rate[wids] += share * own.prefill_rate

    def _admit(self, t: float, st: ServingState,
               demand: RolloutDemand) -> tuple[Admission, Admission, Num, Num]:
        """The executor's admission for the replicas' prefill-chunk and decode-only iterations
        (arrays over them), with the share of each kind that carries rollout work. One rollout
        iteration is bounded by the SLOs alone (`banked=False`); the inflation budgets bound how
        many serving iterations carry one (`rollout_duty`), as banked budgets do on a device.
        Each kind's admission comes back with its mean iteration time, with rollout work and
        without. (A replica with no prompt waiting gets the same for both kinds.) Both kinds are
        decided in one call, the replicas twice over: decode-only first."""
        n = len(st.decode_context_tokens)
        none = np.full(n, np.inf), np.zeros(n)
        cat = np.concatenate
        both = ServingState([(cat((none[0], a)), cat((none[1], w))) for a, w in st.waiting],
                            [cat((d, d)) for d in st.decoding_last_token_s],
                            cat((st.decode_context_tokens, st.decode_context_tokens)),
                            [cat((k, k)) for k in st.decoding_counts])
        e = self.settings
        twice = RolloutDemand(cat((demand.decode_context, demand.decode_context)),
                              cat((demand.prefill_tokens, demand.prefill_tokens)))
        a = admission_step(t, both, twice, self.latency, self.slo, self.chunk, banked=False,
                           arrival_reserve_tokens=e.arrival_reserve_tokens,
                           idle_min_tokens=e.idle_min_rollout_tokens)
        alone = self.latency.iteration_time(both.load(self.chunk), TokenLoad())
        duty = np.r_[np.broadcast_to(rollout_duty(alone[:n], a.iteration_s[:n], self.slo.tpot_inflation), n),
                     np.broadcast_to(rollout_duty(alone[n:], a.iteration_s[n:], self.slo.ttft_inflation), n)]
        iteration = duty * a.iteration_s + (1 - duty) * alone

        def kind(part: slice) -> Admission:
            return Admission(*(np.broadcast_to(x, (2 * n,))[part]
                               for x in (a.decode_seqs, a.prefill_tokens, iteration, a.limit_s,
                                         a.prefill_slack_s, a.decode_slack_s)))

        return kind(slice(n, None)), kind(slice(None, n)), duty[n:], duty[:n]

    def _naive(self, serving_decodes: np.ndarray, serving_ctx: np.ndarray, demand: RolloutDemand,
               backlog: np.ndarray, chunk: int) -> tuple[Admission, Admission, np.ndarray]:
        """No admission control: every rollout sequence that has pages decodes in every
        iteration, and serving and rollout prompts share the prefill chunk in proportion to what
        each has queued (first come, first served, on average). Returns the two iteration kinds
        and serving's prefill tokens per prefill iteration (arrays over the replicas)."""
        r_pending = demand.prefill_tokens
        d, ctx = demand.decodes, demand.context_tokens
        queued = backlog > 0
        share = np.where(queued, chunk * backlog / np.where(queued, backlog + r_pending, 1.0), float(chunk))
        r_p = np.where(queued, np.minimum(r_pending, chunk - np.floor(share)), 0)
        r_d = np.minimum(r_pending, chunk)
        serving_pf = TokenLoad(np.maximum(1, np.floor(share)), serving_decodes, serving_ctx)
        t_p = self.latency.iteration_time(serving_pf, TokenLoad(r_p, d, ctx))
        t_d = self.latency.iteration_time(TokenLoad(0, serving_decodes, serving_ctx), TokenLoad(r_d, d, ctx))
        inf = np.full(len(d), math.inf)
        return (Admission(d, r_p, t_p, inf, inf, inf), Admission(d, r_d, t_d, inf, inf, inf),
                np.maximum(share, 1.0))

    def _static(self, serving_decodes: np.ndarray, serving_ctx: np.ndarray, demand: RolloutDemand,
                serving_prefill: np.ndarray) -> tuple[Admission, Admission, np.ndarray]:
        """A static split (the executor's `static` policy): every iteration carries up to
        `static_rollout_tokens` rollout tokens, decodes first, whatever serving's slack; serving
        prefills its whole chunk. Returns the two iteration kinds and serving's prefill tokens per
        prefill iteration (arrays over the replicas)."""
        budget = self.settings.static_rollout_tokens
        d = np.minimum(demand.decodes, budget)
        first = np.arange(demand.decode_context.shape[1])[None, :] < d[:, None]
        rollout = TokenLoad(np.minimum(demand.prefill_tokens, budget - d), d,
                            np.where(first, demand.decode_context, 0).sum(axis=1))
        prefill = TokenLoad(np.maximum(1, np.floor(serving_prefill)), serving_decodes, serving_ctx)
        t_p = self.latency.iteration_time(prefill, rollout)
        t_d = self.latency.iteration_time(TokenLoad(0, serving_decodes, serving_ctx), rollout)
        inf = np.full(len(d), math.inf)
        return (Admission(d, rollout.prefill_tokens, t_p, inf, inf, inf),
                Admission(d, rollout.prefill_tokens, t_d, inf, inf, inf), serving_prefill)
