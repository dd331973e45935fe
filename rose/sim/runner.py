"""From runs to figures: serving latency percentiles and SLO windows, per-system results, the
summary a scenario prints, and running a scenario or a sweep end to end."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from rose.sim.aggregate import LatencyHistogram
from rose.sim.batched import BatchedSimulation
from rose.sim.coserving import pool_bytes
from rose.sim.costs import device_by_name, efficiency_for, model_by_name
from rose.sim.engine import (
    SimRun,
    Simulation,
    serving_alone,
    sync_payload,
    weight_sync_times,
    with_serving_engine,
)
from rose.sim.scenarios import SWEEPS, Scenario, Sweep, apply_overrides, load_scenario, scale_overrides
from rose.sim.serving import ServingLog
from rose.sim.systems import SYSTEMS, Extra, System

WINDOW_S = 60.0     # SLOs are judged per minute: P99 of the requests that arrived in it


@dataclasses.dataclass
class ServingStats:
    p99_ttft_ms: float
    p99_tpot_ms: float
    attainment: float           # requests meeting both SLOs
    violations: int             # minutes whose P99 TTFT or P99 TPOT broke its SLO
    minutes: int
    minute_t: np.ndarray        # window starts (s)
    minute_ttft_ms: np.ndarray  # per-minute P99s
    minute_tpot_ms: np.ndarray


def serving_stats(log: ServingLog | LatencyHistogram | tuple[np.ndarray, np.ndarray, np.ndarray],
                  sc: Scenario, until_s: float) -> ServingStats:
    """Serving's P99s, SLO attainment and per-minute P99s of the requests that arrived before
    `until_s`: from every request (`ServingLog`, or its arrays), or from the aggregate model's
    histograms (the minutes that began before `until_s`)."""
    if isinstance(log, LatencyHistogram):
        return _histogram_stats(log, sc, until_s)
    arrival, ttft, tpot = log.arrays() if isinstance(log, ServingLog) else log
    keep = arrival < until_s
    arrival, ttft, tpot = arrival[keep], ttft[keep] * 1e3, tpot[keep] * 1e3
    slo_t, slo_o = sc.serving.executor.slo_ttft_ms, sc.serving.executor.slo_tpot_ms
    ok = (ttft <= slo_t) & (np.nan_to_num(tpot) <= slo_o)
    minute = (arrival // WINDOW_S).astype(np.int64)
    starts, p_t, p_o = [], [], []
    for m in np.unique(minute):
        sel = minute == m
        starts.append(m * WINDOW_S)
        p_t.append(np.percentile(ttft[sel], 99))
        tp = tpot[sel]
        tp = tp[np.isfinite(tp)]
        p_o.append(np.percentile(tp, 99) if len(tp) else 0.0)
    p_t, p_o = np.array(p_t), np.array(p_o)
    return ServingStats(
        p99_ttft_ms=float(np.percentile(ttft, 99)) if len(ttft) else 0.0,
        p99_tpot_ms=float(np.nanpercentile(tpot, 99)) if np.isfinite(tpot).any() else 0.0,
        attainment=float(ok.mean()) if len(ok) else 1.0,
        violations=int(np.count_nonzero((p_t > slo_t) | (p_o > slo_o))),
        minutes=len(starts), minute_t=np.array(starts), minute_ttft_ms=p_t, minute_tpot_ms=p_o)


def _histogram_stats(log: LatencyHistogram, sc: Scenario, until_s: float) -> ServingStats:
    slo_t, slo_o = sc.serving.executor.slo_ttft_ms, sc.serving.executor.slo_tpot_ms
    minutes = [m for m in log.minutes() if m * WINDOW_S < until_s]
    per_minute = np.array([log.p99([m]) for m in minutes]).reshape(-1, 2) * 1e3
    p99_t, p99_o = log.p99(minutes)
    return ServingStats(
        p99_ttft_ms=p99_t * 1e3, p99_tpot_ms=p99_o * 1e3,
        attainment=log.within(slo_t / 1e3, slo_o / 1e3, minutes),
        violations=int(np.count_nonzero((per_minute[:, 0] > slo_t) | (per_minute[:, 1] > slo_o))),
        minutes=len(minutes), minute_t=np.array(minutes, float) * WINDOW_S,
        minute_ttft_ms=per_minute[:, 0], minute_tpot_ms=per_minute[:, 1])


def spike_parts(log: ServingLog, sc: Scenario) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The requests of `log` that arrive inside the scenario's spike (`serving.spike_at_s`) and
    the rest."""
    s = sc.serving
    arrays = log.arrays()
    arrival = arrays[0]
    inside = (arrival >= s.spike_at_s) & (arrival < s.spike_at_s + s.spike_s)
    return {"inside": tuple(x[inside] for x in arrays), "outside": tuple(x[~inside] for x in arrays)}


@dataclasses.dataclass
class ScenarioResult:
    scenario: Scenario
    runs: dict[str, SimRun]
    serving: dict[str, ServingStats]     # "serving-alone" and every co-serving system
    wall_s: float
    cpu_s: float                         # this process's CPU time (the machine may be shared)
    # With serving.spike_at_s: the same per system, inside the spike and outside it.
    spike: dict[str, dict[str, ServingStats]] = dataclasses.field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        runs, sv = self.runs, self.serving
        rose = runs.get("rose")

        def ratio(a: str, b: str, attr: str, inverse: bool = False) -> float | None:
            if a not in runs or b not in runs:
                return None
            x, y = getattr(runs[a], attr), getattr(runs[b], attr)
            return round((y / x) if inverse else (x / y), 3)

        out: dict[str, Any] = {
            "throughput_vs_fixed_sync": ratio("rose", "fixed-sync", "throughput"),
            "throughput_vs_fixed_async": ratio("rose", "fixed-async", "throughput"),
            "rollout_speedup_vs_elastic_spot": ratio("rose", "elastic-spot", "mean_rollout_s", True),
            "rollout_speedup_vs_elastic_serverless": ratio("rose", "elastic-serverless", "mean_rollout_s",
                                                           True),
            "allocation_overhead": {k: round(r.allocation_overhead, 4) for k, r in runs.items()},
            "throughput_vs_fixed_sync_by_system": (
                {k: round(r.throughput / runs["fixed-sync"].throughput, 3) for k, r in runs.items()}
                if "fixed-sync" in runs else None),
            "serving_p99_ttft_ms": round(sv["rose"].p99_ttft_ms, 1) if "rose" in sv else None,
            "serving_p99_tpot_ms": round(sv["rose"].p99_tpot_ms, 1) if "rose" in sv else None,
            "serving_engine_overhead_ms": round(self.scenario.serving.engine_overhead_ms, 1),
            "serving_alone_p99_ttft_ms": round(sv["serving-alone"].p99_ttft_ms, 1) if sv else None,
            "serving_alone_p99_tpot_ms": round(sv["serving-alone"].p99_tpot_ms, 1) if sv else None,
            "slo_violations": sv["rose"].violations if "rose" in sv else None,
            "serving_alone_slo_violations": sv["serving-alone"].violations if sv else None,
            "naive_share_slo_violations": sv["naive-share"].violations if "naive-share" in sv else None,
            "sim_wall_s": round(self.wall_s, 1),
            "sim_cpu_s": round(self.cpu_s, 1),
            **self.control_plane_summary(),
        }
        if runs:  # prompts (whole contexts) among a rollout's tokens; the same turns in every system
            steps = next(iter(runs.values())).steps
            prompts, generated = sum(s.prompt_tokens for s in steps), sum(s.generated_tokens for s in steps)
            out["rollout_prefill_share"] = round(prompts / (prompts + generated), 3)
        if self.scenario.cluster.serving_gpus:
            sync = self.weight_sync()
            out["weight_sync_s"], out["weight_sync_mb"] = sync["s"], sync["mb"]
            device = device_by_name(self.scenario.cluster.device)
            pool = pool_bytes(self.scenario, device, efficiency_for(device))
            out["serving_kv_pool_gb"] = round(pool / 1e9, 2)     # a replica's, as co-serving has it
        if self.spike:
            out["spike"] = self.spike_summary()
        if rose is not None:
            out["rollout_share_fixed_sync"] = (round(runs["fixed-sync"].mean_rollout_s
                                                     / runs["fixed-sync"].mean_step_s, 3)
                                               if "fixed-sync" in runs else None)
        return out

    def control_plane_summary(self) -> dict[str, Any]:
        """The driver's transport and cores (0: unlimited), and per system the cores its rollout
        ticks needed (the peak and the mean over them) and the share of them it fell behind in."""
        cp, runs = self.scenario.control_plane, self.runs
        return {"control_plane_transport": cp.transport, "driver_cores": cp.driver_cores,
                "driver_cores_needed": {k: _driver_cores_needed(r) for k, r in runs.items()},
                "driver_saturated_share": {k: round(r.driver_saturated_share, 3) for k, r in runs.items()}}

    def weight_sync(self) -> dict[str, dict[str, float]]:
        """One update of the policy to the whole serving fleet, its seconds and its MB: ROSE's
        sparse delta (in adapter mode, `serving.rollout`, the adapter) and full weights over the
        relay, and the naive baseline's full copies."""
        sc = self.scenario
        update, full = sync_payload(sc, 1, sparse=True), model_by_name(sc.models.policy).weight_bytes
        key = "adapter" if sc.serving.rollout == "adapter" else "delta"
        times = weight_sync_times(sc, full)
        return {"s": {key: round(weight_sync_times(sc, update)["relay"], 2), "full": round(times["relay"], 2),
                      "naive": round(times["naive"], 1)},
                "mb": {key: round(update / 1e6, 1), "full": round(full / 1e6, 1)}}

    def spike_summary(self) -> dict[str, Any]:
        """Per co-serving system: serving's P99s inside the spike and outside it against serving
        alone's over the same requests, and the burst state machine's cuts."""
        alone = self.spike["serving-alone"]
        out: dict[str, Any] = {}
        for name, parts in self.spike.items():
            fig: dict[str, Any] = {}
            for part, st in parts.items():
                fig[part] = {"p99_ttft_ms": round(st.p99_ttft_ms, 1), "p99_tpot_ms": round(st.p99_tpot_ms, 1),
                             "ttft_vs_alone": round(st.p99_ttft_ms / alone[part].p99_ttft_ms, 3),
                             "tpot_vs_alone": round(st.p99_tpot_ms / alone[part].p99_tpot_ms, 3),
                             "slo_attainment": round(st.attainment, 4)}
            if name in self.runs:
                fig.update(self._cut_figures(self.runs[name]))
            out[name] = fig
        return out

    def _cut_figures(self, run: SimRun) -> dict[str, Any]:
        """A co-serving run's bursts and cuts, and its rollout tokens per second before the first
        trigger, from it to the next RL step (`rl.step_after_burst_s` later) and after."""
        cuts = run.cuts
        triggers = [c.t for c in cuts if c.trigger]
        out: dict[str, Any] = {
            "bursts": len(triggers), "burst_cuts": len(cuts),
            "first_trigger_s": round(triggers[0], 2) if triggers else None,
            "rollout_turns_cut": sum(c.turns for c in cuts),
            "rollout_mb_cut": round(sum(c.rollout_bytes for c in cuts) / 2**20, 1)}
        step_after = self.scenario.rl.step_after_burst_s
        if triggers and step_after:
            bounds = [0.0, triggers[0], triggers[0] + step_after, run.total_s]
            tokens = run.tick_tokens.sum(axis=1)
            out["harvest_tokens_per_s"] = {
                part: round(float(tokens[(run.tick_t >= lo) & (run.tick_t < hi)].sum()) / (hi - lo), 2)
                if hi > lo else None
                for part, lo, hi in zip(("before_trigger", "until_next_step", "after_next_step"),
                                        bounds, bounds[1:], strict=False)}
        return out

    def to_json(self) -> dict[str, Any]:
        systems = {}
        for name, r in self.runs.items():
            systems[name] = {
                "label": r.label, "mean_step_s": round(r.mean_step_s, 1),
                "mean_rollout_s": round(r.mean_rollout_s, 1),
                "mean_train_s": round(float(np.mean([s.train_s for s in r.steps])), 1),
                "trajectories_per_hour": round(r.throughput * 3600 * self.scenario.sim.slice, 1),
                "allocation_overhead": round(r.allocation_overhead, 4),
                "rollout_tokens_per_s": round(float(r.tick_tokens.sum()) / r.total_s, 2),
                "routes": r.routes, "aborted_turns": r.aborted_turns, "bursts": r.bursts,
                "driver_cores_needed": _driver_cores_needed(r),
                "driver_saturated_share": round(r.driver_saturated_share, 3),
                "wall_s": round(r.wall_s, 2),
                "steps": [dataclasses.asdict(s) for s in r.steps],
            }
        serving = {k: {"p99_ttft_ms": round(v.p99_ttft_ms, 1), "p99_tpot_ms": round(v.p99_tpot_ms, 1),
                       "slo_attainment": round(v.attainment, 5), "violating_minutes": v.violations,
                       "minutes": v.minutes} for k, v in self.serving.items()}
        return {"scenario": self.scenario.name, "description": self.scenario.description,
                "config": OmegaConf.to_container(OmegaConf.structured(self.scenario)),
                "systems": systems, "serving": serving, "summary": self.summary()}


def _driver_cores_needed(run: SimRun) -> dict[str, float]:
    return {"peak": round(run.driver_cores_peak, 3), "mean": round(run.driver_cores_mean, 3)}


def simulation(sc: Scenario, system: System) -> Simulation:
    """The system on the scenario, its rollouts per turn or in batches (`sim.rollout_model`)."""
    return (BatchedSimulation if sc.sim.rollout_model == "batched" else Simulation)(sc, system)


def run_scenario(sc: Scenario, progress: Callable[[str, SimRun], None] | None = None) -> ScenarioResult:
    """Every system of `sc.sim.systems` on the same workload and traffic, then serving alone
    over the same span for the SLO baseline."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    sc = with_serving_engine(sc)
    runs: dict[str, SimRun] = {}
    for name in sc.sim.systems:
        runs[name] = simulation(sc, SYSTEMS[name]).run()
        if progress:
            progress(name, runs[name])
    serving: dict[str, ServingStats] = {}
    spike: dict[str, dict[str, ServingStats]] = {}
    coserving = [n for n, r in runs.items() if SYSTEMS[n].extra is Extra.COSERVE]
    if coserving and sc.cluster.serving_gpus:
        # Each measured over the requests that arrived before the shortest run ended, serving
        # alone run as long as the longest so that those requests finish there too.
        span = min(runs[n].total_s for n in coserving)
        alone = serving_alone(sc, max(runs[n].total_s for n in coserving))
        logs = {"serving-alone": alone, **{n: runs[n].serving for n in coserving}}
        for n, log in logs.items():
            serving[n] = serving_stats(log, sc, span)
            if sc.serving.spike_at_s is not None:
                spike[n] = {part: serving_stats(p, sc, span) for part, p in spike_parts(log, sc).items()}
    return ScenarioResult(sc, runs, serving, time.perf_counter() - wall0, time.process_time() - cpu0, spike)


@dataclasses.dataclass
class SweepResult:
    sweep: Sweep
    points: list[tuple[Any, dict[str, Any]]]    # (value, summary)
    wall_s: float

    def summary(self) -> dict[str, Any]:
        keys = ("throughput_vs_fixed_sync", "throughput_vs_fixed_sync_by_system", "slo_violations",
                "serving_alone_slo_violations", "allocation_overhead", "driver_cores_needed",
                "driver_saturated_share")
        return {"sweep": self.sweep.name, "key": self.sweep.key,
                "values": [v for v, _ in self.points],
                **{k: [s.get(k) for _, s in self.points] for k in keys},
                "sim_wall_s": round(self.wall_s, 1)}

    def to_json(self) -> dict[str, Any]:
        return {"sweep": self.sweep.name, "description": self.sweep.description,
                "points": [{"value": v, "summary": s} for v, s in self.points],
                "summary": self.summary()}


def run_sweep(sweep: Sweep, overrides: list[str],
              progress: Callable[[Any, ScenarioResult], None] | None = None) -> SweepResult:
    wall0 = time.perf_counter()
    points = []
    base = load_scenario(sweep.base, [*sweep.overrides, f"sim.systems=[{','.join(sweep.systems)}]"])
    # The serving engine is solved once, on the base: a point that varies the load or the fleet
    # keeps the engine (not the P99 TPOT the base states).
    engine = with_serving_engine(base).serving
    base = dataclasses.replace(base, serving=dataclasses.replace(engine, target_p99_tpot_ms=0.0))
    for value in sweep.values:
        sc = apply_overrides(base, [f"{sweep.key}={value}", *scale_overrides(sweep.key, value), *overrides])
        result = run_scenario(sc)
        points.append((value, result.summary()))
        if progress:
            progress(value, result)
    return SweepResult(sweep, points, time.perf_counter() - wall0)


def is_sweep(name: str) -> bool:
    return name in SWEEPS
