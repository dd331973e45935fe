"""`rose bench coserve-vllm`: co-serving on vLLM (a dual-SLO scheduler subclass) against ROSE's
native executor, on one core, in one run (docs/vllm.md).

vLLM holds one model per engine, so here one checkpoint serves both kinds of request: the
serving trace and the rollout turns go to the same model (on the native executor, two copies of
it over one page pool, as `rose serve --rollout-model` runs them). Each mode runs in a process of
its own pinned to one core with one thread (vLLM must start under `__main__`, and keeps
process-wide state), in process: no HTTP, so both engines are timed by the same driver loop,
which adds each trace request at its arrival time and keeps `--trajectories` multi-turn rollout
turns in flight (the co-serving benchmark's backlog, `rose.bench.coserve`). Modes:

- `native_alone`, `vllm_alone`: the trace alone; each one's P99s (x `--slo-factor`) set that
  engine's SLO budgets;
- `native_naive`: the native executor, rollouts unrestricted (`--policy naive`);
- `native_rose`: the native executor, dual-SLO admission and burst control (`--policy rose`);
- `vllm_fcfs`: vLLM's scheduler as it is, rollouts and serving first come first served;
- `vllm_priority`: vLLM's priority scheduling, serving before rollouts, nothing more;
- `vllm_dual_slo`: `rose.coserve.vllm_admission.DualSLOScheduler`, ROSE's admission deciding each
  iteration's rollout tokens.

Summary per mode: P99 TTFT and TPOT over its engine's serving-alone P99s, SLO attainment against
that engine's budgets, rollout tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rose.bench import checkpoint_arg
from rose.bench.coserve import PROMPT_IDS, first_prompt, next_prompt
from rose.contracts import SamplingParams, Turn
from rose.coserve.loadgen import RequestResult, build_trace, fit_lengths, summarize
from rose.coserve.settings import ExecutorConfig
from rose.engine import RequestOutput
from rose.model import init_model
from rose.progress import bar
from rose.reporting import write_report

MODES = ("native_alone", "native_naive", "native_rose", "vllm_alone", "vllm_fcfs", "vllm_priority",
         "vllm_dual_slo")
POOL_MB = 512  # the KV pool (the native executor's) or cache (vLLM's)
MAX_CONTEXT, MAX_OUTPUT = 1024, 64  # the serving requests', as `rose bench coserve` replays them



def settings(slo: dict[str, float]) -> ExecutorConfig:
    """Both engines' settings: the executor's defaults, this run's SLOs and pool."""
    return ExecutorConfig(pool_mb=POOL_MB, slo_ttft_ms=slo["ttft_ms"], slo_tpot_ms=slo["tpot_ms"])

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="45 s per mode instead of 300 s")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--model", help="the checkpoint serving and rollouts share (HF format; default: a fresh "
                   "qwen2 `small`)")
    p.add_argument("--duration", type=float, help="seconds of trace per mode (default 300)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument("--rate", type=float, default=0.35, help="serving requests per second (mean)")
    p.add_argument("--slo-factor", type=float, default=1.5,
                   help="SLO = this x the engine's serving-alone P99")
    p.add_argument("--trajectories", type=int, default=16, help="concurrent rollout trajectories")
    p.add_argument("--start", type=float, default=600.0, help="offset into the trace, seconds")


class Backend(Protocol):
    """One engine taking serving requests and rollout turns, stepped by the driver."""

    def add_serving(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None: ...
    def add_turn(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self) -> bool: ...
    def on_arrival(self, arrived: Callable[[], bool]) -> None:
        """`arrived()` says whether a serving request is due and not yet added."""


class NativeBackend:
    """ROSE's co-serving executor, both models from one checkpoint, profiled as `rose serve` does."""

    def __init__(self, model: Path, policy: str, slo: dict[str, float]) -> None:
        from rose.coserve.executor import CoServingExecutor
        from rose.coserve.settings import Policy

        config = dataclasses.replace(settings(slo), policy=Policy(policy))
        self.executor = CoServingExecutor.from_pretrained(model, model, config)
        self.executor.profile()

    def on_arrival(self, arrived: Callable[[], bool]) -> None:
        self.executor.serving_arrived = arrived  # a rollout iteration gives way between layers

    def add_serving(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        self.executor.add_serving(token_ids, params, request_id)

    def add_turn(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        self.executor.submit_turn(Turn(request_id, request_id.split("-")[0], token_ids, params))

    def step(self) -> list[RequestOutput]:
        return self.executor.step()

    def has_unfinished(self) -> bool:
        return self.executor.has_unfinished()


class VllmBackend:
    """vLLM's engine in this process: its own scheduler (`fcfs`, `priority`) or the dual-SLO one."""

    def __init__(self, model: Path, policy: str, slo: dict[str, float]) -> None:
        from rose.coserve.vllm_admission import ROLLOUT_PRIORITY, SERVING_PRIORITY, VllmCoServing

        self.coserving = VllmCoServing.from_pretrained(model, policy, settings(slo))
        self.engine = self.coserving.engine
        self.serving_priority = SERVING_PRIORITY
        self.rollout_priority = SERVING_PRIORITY if policy == "fcfs" else ROLLOUT_PRIORITY

    def add_serving(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        self.engine.add_request(token_ids, params, request_id, priority=self.serving_priority)

    def add_turn(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        self.engine.add_request(token_ids, params, request_id, priority=self.rollout_priority)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def on_arrival(self, arrived: Callable[[], bool]) -> None:
        """Nothing to do: a vLLM iteration runs to its end (docs/vllm.md)."""


@dataclasses.dataclass
class _Trajectory:
    history: list[int]
    turn: int = 0
    running: str | None = None  # the id of its turn in flight
    produced: list[int] = dataclasses.field(default_factory=list)


def drive(backend: Backend, start: float, arrivals: np.ndarray, prompts: np.ndarray, outputs: np.ndarray,
          duration: float, trajectories: int, seed: int = 0) -> tuple[list[RequestResult], int, float]:
    """Add each serving request at `start` + its arrival, keep `trajectories` rollout turns in
    flight until `start` + `duration`, step until every serving request is done. Returns the
    serving requests' results (times from their arrival), the rollout tokens made in the window,
    and the window's wall time."""
    rng, turn_rng = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    results = [RequestResult(float(at), int(p)) for at, p in zip(arrivals, prompts, strict=True)]
    serving = {f"s{i}": i for i in range(len(results))}
    trajs = {f"t{k}": _Trajectory(first_prompt(turn_rng)) for k in range(trajectories)}
    turn_params = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True)
    rollout_tokens, added, done = 0, 0, 0

    def arrived() -> bool:  # the in-process form of the server's `Arrivals`
        return added < len(results) and arrivals[added] <= time.monotonic() - start

    backend.on_arrival(arrived)
    while done < len(results):
        now = time.monotonic() - start
        while added < len(results) and arrivals[added] <= now:
            ids = rng.integers(*PROMPT_IDS, int(prompts[added])).tolist()
            backend.add_serving(ids, SamplingParams(max_tokens=int(outputs[added]), temperature=0.0,
                                                    ignore_eos=True), f"s{added}")
            added += 1
        for name, t in trajs.items():
            if t.running is None and now < duration:
                t.running = f"{name}-{t.turn}"
                backend.add_turn(t.history, turn_params, t.running)
        if not backend.has_unfinished():
            time.sleep(max(0.0, min(0.01, arrivals[added] - now)) if added < len(results) else 0.01)
            continue
        outs = backend.step()
        at = time.monotonic() - start
        for out in outs:
            if (i := serving.get(out.request_id)) is not None:
                r = results[i]
                if out.token_ids:
                    if r.ttft_s is None:
                        r.ttft_s = at - r.scheduled_s
                    r.output_tokens += len(out.token_ids)
                if out.finished:
                    r.latency_s, done = at - r.scheduled_s, done + 1
                continue
            t = trajs[out.request_id.split("-")[0]]
            rollout_tokens += len(out.token_ids) if at <= duration else 0
            t.produced += out.token_ids
            if out.finished:
                t.history = next_prompt(t.history, t.produced, out.finish_reason != "abort", turn_rng)
                t.turn, t.running, t.produced = t.turn + 1, None, []
    return results, rollout_tokens, max(duration, time.monotonic() - start)


def run_mode(job: dict[str, Any]) -> dict[str, Any]:
    """One mode, in this process: build its backend, drive the trace and the backlog."""
    engine, policy = job["mode"].split("_", 1)
    trace = build_trace("azure-conv", job["duration"], load=job["rate"] / 5.53, start_s=job["start"],
                        prompt_scale=0.125)
    prompts, outputs = fit_lengths(trace, MAX_CONTEXT, MAX_OUTPUT)
    alone = policy == "alone"
    slo = job["slo"]
    model = Path(job["model"])
    backend: Backend = (NativeBackend(model, "rose" if alone else policy, slo) if engine == "native"
                        else VllmBackend(model, "priority" if alone else policy, slo))
    results, tokens, wall = drive(backend, time.monotonic(), trace.arrival_s, prompts, outputs,
                                  job["duration"], 0 if alone else job["trajectories"])
    summary = summarize(results, wall, slo_ttft_ms=slo["ttft_ms"], slo_tpot_ms=slo["tpot_ms"])
    return {**summary, "rollout_tokens": tokens, "rollout_tokens_per_s": round(tokens / job["duration"], 2)}


def _in_process(job: dict[str, Any], core: int | None) -> dict[str, Any]:
    """`run_mode` in a fresh Python on one core, one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        cmd = [sys.executable, "-m", "rose.bench.coserve_vllm", str(path)]
        if core is not None:
            cmd = ["taskset", "-c", str(core), *cmd]
        subprocess.run(cmd, check=True, env=env)
        return json.loads(path.with_suffix(".out.json").read_text())


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"--modes: unknown {', '.join(unknown)}; expected some of {', '.join(MODES)}")
    # Each engine's serving-alone run comes first: its P99s set that engine's SLO budgets.
    alone = [f"{e}_alone" for e in dict.fromkeys(m.split("_")[0] for m in modes)]
    modes = [*alone, *(m for m in modes if m not in alone)]
    model = checkpoint_arg("--model", args.model, PROMPT_IDS[1]) if args.model else None
    duration = args.duration or (45.0 if args.quick else 300.0)
    cores = sorted(os.sched_getaffinity(0))
    core = cores[-1] if len(cores) > 1 else None
    loose = {"ttft_ms": 1e6, "tpot_ms": 1e6}
    results: dict[str, dict[str, Any]] = {}
    slos: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, bar("bench coserve-vllm", len(modes)) as progress:
        model = model or init_model("qwen2", "small", Path(tmp) / "model", seed=1)
        job = {"model": str(model), "duration": duration, "rate": args.rate, "start": args.start,
               "trajectories": args.trajectories}
        for mode in modes:
            engine = mode.split("_")[0]
            progress.describe(mode)
            results[mode] = _in_process({**job, "mode": mode, "slo": slos.get(engine, loose)}, core)
            if mode.endswith("_alone"):
                slos[engine] = {"ttft_ms": round(args.slo_factor * results[mode]["p99_ttft_ms"], 1),
                                "tpot_ms": round(args.slo_factor * results[mode]["p99_tpot_ms"], 1)}
            print(mode, results[mode], flush=True)
            progress.advance()
    summary: dict[str, Any] = {"slo": slos}
    for mode, r in results.items():
        engine = mode.split("_")[0]
        alone = results.get(f"{engine}_alone")
        row = {k: r.get(k) for k in ("p99_ttft_ms", "p99_tpot_ms", "rollout_tokens_per_s", "completed")}
        if alone and not mode.endswith("_alone"):
            row.update(ttft_vs_alone=round(r["p99_ttft_ms"] / alone["p99_ttft_ms"], 3),
                       tpot_vs_alone=round(r["p99_tpot_ms"] / alone["p99_tpot_ms"], 3),
                       slo_attainment=r["slo_attainment"])
        summary[mode] = row
    config = {k: getattr(args, k) for k in ("model", "duration", "quick", "modes", "rate", "slo_factor",
                                            "trajectories", "start")}
    write_report(args.json, summary, config=config, modes=results)
    return 0


if __name__ == "__main__":
    job_file = Path(sys.argv[1])
    job_file.with_suffix(".out.json").write_text(json.dumps(run_mode(json.loads(job_file.read_text()))))
