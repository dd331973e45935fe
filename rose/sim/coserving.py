"""Co-serving planning: the serving replicas that lend their idle capacity to rollouts, tick by
tick. Per replica with rollout work, the executor's admission step
(`rose.coserve.admission.admission_step`) for iterations that carry a serving prefill chunk and
for decode-only ones, the share of the tick each takes, and the rollout rates that follow; the
free slots each reports to the rollout scheduler; serving alone where no rollout work shares a
replica. Its memory is `burst.BurstMemory`."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from rose.contracts import TokenLoad
from rose.coserve.admission import (
    Admission,
    RolloutDemand,
    ServingState,
    SLOBudgets,
    admission_step,
    memory_room,
    rollout_capacity,
    rollout_duty,
)
from rose.coserve.loadgen import fit_lengths
from rose.sim.burst import BurstMemory
from rose.sim.costs import Device, Efficiency, ModelShape, RooflineLatency, forward_cost
from rose.sim.rollout import ActiveView, Round, TickRates
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
        self.policy, self.serving_model = policy, serving_model
        self.slo = SLOBudgets.of(e)
        trace = load_trace(s.trace).scaled(prompt_tokens=s.prompt_scale, output_tokens=s.output_scale)
        if s.max_context:
            # Lengths clipped as the runtime's trace replay clips them to the serving model's context.
            prompts, outputs = fit_lengths(trace, s.max_context, s.max_output)
            trace = Trace(trace.name, trace.arrival_s, prompts, outputs)
        diurnal = diurnal_for_peak(s.trace, s.minute_peak_to_mean)
        self.fleet = ServingFleet(n, trace, trace.mean_rate * s.load, diurnal, s.start_hour * 3600.0,
                                  e.chunk_tokens, sc.sim.seed + 1,
                                  replay_start(trace, s))
        roofline = forward_cost(serving_model, device, c.serving_tp, eff)
        self.serve_cost = dataclasses.replace(roofline, fixed=roofline.fixed + s.engine_overhead_ms / 1e3)
        self.cs_cost = forward_cost(policy, device, c.serving_tp, eff)
        self.latency = RooflineLatency(self.serve_cost, self.cs_cost)
        rollout_weights = 0.0 if alone else policy.weight_bytes
        # One page pool in bytes holds both models' KV (two KV shapes): the executor's pool_mb
        # where the scenario sets it, else what the GPUs' memory leaves beside the weights.
        self.pool = (e.pool_bytes if "pool_mb" in e.changed() else
                     int(device.memory * c.serving_tp * eff.memory_utilization
                         - serving_model.weight_bytes - rollout_weights))
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
        """Each replica's time per decode iteration of one typical rollout sequence: the serving
        model's decodes run in every iteration too."""
        _, t_d = self.alone_times()
        return t_d + float(self.cs_cost.time(0, 1, self.typical_ctx))

    # -- the rollout scheduler's view --------------------------------------------------------------
    def free_slots(self, t: float, workers: Workers, view: ActiveView) -> list[tuple[int, int]]:
        """Each registered executor's capacity report: free rollout slots, from its memory budget
        (`memory_room`) and its compute slack (`rollout_capacity`), as the executor counts them."""
        reps = np.flatnonzero(workers.registered[self.first_wid:])
        held = view.held(self.first_wid)
        out = []
        for r, st in zip(reps.tolist(), self.fleet.admission_states(t, reps), strict=True):
            wid = self.first_wid + r
            ctxs = [int(k) for _, k in held.get(wid, [])]
            room = memory_room(self.memory.state(r), workers.kv_cap[wid] - sum(ctxs), self.typical_ctx)
            out.append((wid, rollout_capacity(
                t, st, RolloutDemand(ctxs), self.latency, self.slo, self.typical_ctx, self.chunk, room)
                if self.sharing is Sharing.ROSE else room))
        return out

    # -- the tick's plan ---------------------------------------------------------------------------
    def plan(self, plan: TickRates, view: ActiveView, rnd: Round, t: float,
             pending: np.ndarray) -> ServingTimes:
        """Per serving replica with rollout work: admission for prefill-chunk iterations and for
        decode-only ones, the share of the tick each takes, and the rollout rates that follow
        (written into `plan`). Returns the serving fleet's times for the tick; replicas without
        rollout work run serving alone."""
        f, chunk = self.fleet, self.chunk
        t_p, t_d = self.alone_times()
        serve_pf = self.prefill_chunk()   # as admission sees serving's share (`ServingState.load`)
        wids_all = self.first_wid + np.arange(self.n)
        contexts = view.decode_contexts(rnd, wids_all)
        busy = np.flatnonzero([bool(c) for c in contexts] | (pending[wids_all] > 0))
        if not len(busy):
            return t_p, t_d, serve_pf
        states = f.admission_states(t, busy)
        backlog = f.prefill_backlog()[busy].tolist()
        serving_dec = f.decode_seqs()[busy].tolist()
        # Without burst control a serving prompt waits for pages: under naive sharing what the
        # rollouts leave of the pool, under a static split serving's own share of it.
        rollout_bytes = np.array([sum(contexts[r]) for r in busy]) * self.policy.kv_bytes_per_token
        static = self.sharing is Sharing.STATIC
        serving_room = self.pool - (self.memory.static_bytes if static else rollout_bytes)
        blocked = (serving_room - f.kv_tokens()[busy] * self.serving_model.kv_bytes_per_token
                   < f.first_waiting_prompt()[busy] * self.serving_model.kv_bytes_per_token).tolist()
        for i, (r, st) in enumerate(zip(busy.tolist(), states, strict=True)):
            wid = self.first_wid + r
            # Fluid prefill leaves fractions of a token: a fraction still needs an iteration.
            demand = RolloutDemand(contexts[r], math.ceil(pending[wid]))
            if self.sharing is Sharing.ROSE:
                a_p, a_d, duty_p, duty_d = self._admit(t, st, demand)
            else:
                a_p, a_d, serve_pf[r] = (
                    self._naive(serving_dec[i], st.decode_context_tokens, demand, backlog[i], chunk)
                    if self.sharing is Sharing.NAIVE else
                    self._static(serving_dec[i], st.decode_context_tokens, demand, serve_pf[r]))
                if blocked[i]:
                    serve_pf[r] = 0.0           # no free pages for the next serving prompt
                duty_d = duty_p = 1.0
            tp, td = max(a_p.iteration_s, 1e-4), max(a_d.iteration_s, 1e-4)
            t_p[r], t_d[r] = tp, td
            frac = min(1.0, backlog[i] / serve_pf[r] * tp / self.dt) if backlog[i] and serve_pf[r] else 0.0
            plan.cap1[wid], plan.rate1[wid] = a_d.decode_seqs, (1.0 - frac) * duty_d / td
            plan.cap2[wid], plan.rate2[wid] = a_p.decode_seqs, frac * duty_p / tp
            plan.prefill_rate[wid] = ((1.0 - frac) * duty_d * a_d.prefill_tokens / td
                                      + frac * duty_p * a_p.prefill_tokens / tp)
        return t_p, t_d, serve_pf

    def _admit(self, t: float, st: ServingState,
               demand: RolloutDemand) -> tuple[Admission, Admission, float, float]:
        """The executor's admission for a replica's prefill-chunk and decode-only iterations,
        with the share of each kind that carries rollout work. One rollout iteration is bounded
        by the SLOs alone (`banked=False`); the inflation budgets bound how many serving
        iterations carry one (`rollout_duty`), as banked budgets do on a device. Each kind's
        admission comes back with its mean iteration time, with rollout work and without."""
        decoding = ServingState((), st.decoding_last_token_s, st.decode_context_tokens)
        e = self.settings

        def step(state: ServingState) -> Admission:
            return admission_step(t, state, demand, self.latency, self.slo, self.chunk, banked=False,
                                  arrival_reserve_tokens=e.arrival_reserve_tokens,
                                  idle_min_tokens=e.idle_min_rollout_tokens)

        a_d = step(decoding)
        a_p = step(st) if st.waiting else a_d
        alone_d = self.latency.iteration_time(decoding.load(self.chunk), TokenLoad())
        alone_p = self.latency.iteration_time(st.load(self.chunk), TokenLoad()) if st.waiting else alone_d
        duty_d = rollout_duty(alone_d, a_d.iteration_s, self.slo.tpot_inflation)
        duty_p = rollout_duty(alone_p, a_p.iteration_s, self.slo.ttft_inflation)
        a_d = dataclasses.replace(a_d, iteration_s=duty_d * a_d.iteration_s + (1 - duty_d) * alone_d)
        a_p = dataclasses.replace(a_p, iteration_s=duty_p * a_p.iteration_s + (1 - duty_p) * alone_p)
        return a_p, a_d, duty_p, duty_d

    def _naive(self, serving_decodes: int, serving_ctx: int, demand: RolloutDemand, backlog: float,
               chunk: int) -> tuple[Admission, Admission, float]:
        """No admission control: every rollout sequence that has pages decodes in every
        iteration, and serving and rollout prompts share the prefill chunk in proportion to what
        each has queued (first come, first served, on average). Returns the two iteration kinds
        and serving's prefill tokens per prefill iteration."""
        r_pending = demand.prefill_tokens
        d, ctx = len(demand.decode_context), sum(demand.decode_context)
        share = chunk * backlog / (backlog + r_pending) if backlog else float(chunk)
        r_p = min(r_pending, chunk - int(share)) if backlog else 0
        r_d = min(r_pending, chunk)
        t_p = self.latency.iteration_time(TokenLoad(max(1, int(share)), serving_decodes, serving_ctx),
                                          TokenLoad(r_p, d, ctx))
        t_d = self.latency.iteration_time(TokenLoad(0, serving_decodes, serving_ctx), TokenLoad(r_d, d, ctx))
        inf = math.inf
        return Admission(d, r_p, t_p, inf, inf, inf), Admission(d, r_d, t_d, inf, inf, inf), max(share, 1.0)

    def _static(self, serving_decodes: int, serving_ctx: int, demand: RolloutDemand,
                serving_prefill: float) -> tuple[Admission, Admission, float]:
        """A static split (the executor's `static` policy): every iteration carries up to
        `static_rollout_tokens` rollout tokens, decodes first, whatever serving's slack; serving
        prefills its whole chunk. Returns the two iteration kinds and serving's prefill tokens per
        prefill iteration."""
        budget = self.settings.static_rollout_tokens
        d = min(len(demand.decode_context), budget)
        rollout = TokenLoad(min(demand.prefill_tokens, budget - d), d, sum(demand.decode_context[:d]))
        prefill = TokenLoad(max(1, int(serving_prefill)), serving_decodes, serving_ctx)
        t_p = self.latency.iteration_time(prefill, rollout)
        t_d = self.latency.iteration_time(TokenLoad(0, serving_decodes, serving_ctx), rollout)
        inf = math.inf
        return (Admission(d, rollout.prefill_tokens, t_p, inf, inf, inf),
                Admission(d, rollout.prefill_tokens, t_d, inf, inf, inf), serving_prefill)
