"""`rose bench coserve`: serving P99 TTFT/TPOT with and without rollouts beside it (Table 1).

One serving device: a `rose serve` process pinned to one core with one torch thread, serving a
`small` Qwen2 with a `small` Qwen3 rollout model beside it (or the checkpoints of
`--serving-model` and `--rollout-model`, e.g. SmolLM2-135M-Instruct). The Azure conversation
trace is replayed over HTTP at a rate that leaves the device mostly idle on average but bursty; a
saturating backlog of multi-turn rollout turns goes through the lease API. Modes, each with a
fresh server, the same trace window and the same backlog:

- `serving_alone`: no rollouts; its P99s (x `--slo-factor`) fix the SLO budgets of the others;
- `rollout_alone`: no serving traffic: the device's rollout capacity;
- `naive_share`: rollouts take whatever pages and tokens they like, no priority;
- `static_partition`: a fixed page split and a fixed rollout token budget per iteration;
- `rose`: dual-SLO admission and burst control (`rose_q<Q>` with `--sweep-quantile`, `rose_i<E>`
  with `--sweep-inflation`: the same at other admission quantiles or TPOT inflation budgets).

`--rollout adapter` makes the policy a LoRA adapter of the serving model (`rose.bench.rollouts`)
and measures `serving_alone`, `rollout_alone`, `rose` (the adapter on a second copy of the
serving model beside it: two forwards an iteration) and `rose_adapter` (the executor's adapter
mode: the rollout rows in serving's forward), with the rollout tokens each computed in iterations
where serving computed too, and the KV pages the second copy's weights would give back.

`--engine vllm` serves the serving model on vLLM's engine (`rose serve --engine vllm`; the rollout
model stays on the native engine) in modes `serving_alone`, `rollout_alone`, `naive_share`,
`priority` (vLLM's priority scheduling across the two models: serving first, rollouts fill the
rest of each iteration's token budget and of memory, no SLO) and `rose`, then measures the
native modes above in the same run: a table per engine, each against its own serving alone.

`harvest_ratio` = rollout tokens/s / (idle fraction of serving alone x rollout_alone tokens/s):
the share of the idle capacity a mode turned into rollout tokens; `harvest_vs_naive` = rollout
tokens/s / naive_share's on the same engine. `--runs N` repeats the whole measurement (a fresh
serving-alone run and SLO each time) and summarises each figure as the median and the spread of
the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from rose.bench import checkpoint_arg, serve_device_args
from rose.bench.rollouts import ADAPTER_MODE, Rollouts, adapter_rollouts, second_model_pages
from rose.contracts import Turn, TurnOutput
from rose.coserve.cli import serve_process
from rose.coserve.lease_client import LeaseClient, LeaseError
from rose.coserve.loadgen import RequestResult, build_trace, replay, summarize
from rose.coserve.settings import ExecutorConfig
from rose.engine import SamplingParams
from rose.model import ModelConfig, init_model
from rose.model.device import add_device_arguments, resolve
from rose.progress import bar
from rose.reporting import write_report

MODES = {  # mode -> (server policy, serving traffic, rollout backlog)
    "serving_alone": ("rose", True, False),
    "rollout_alone": ("rose", False, True),
    "naive_share": ("naive", True, True),
    "static_partition": ("static", True, True),
    "priority": ("priority", True, True),
    "rose": ("rose", True, True),
    ADAPTER_MODE: ("rose", True, True),
}
# The modes measured on each serving engine (`--engine`), serving_alone first: it sets the SLO.
ENGINE_MODES = {"native": ("serving_alone", "rollout_alone", "naive_share", "static_partition", "rose"),
                "vllm": ("serving_alone", "rollout_alone", "naive_share", "priority", "rose")}
# The engines `--engine` measures in one run: vLLM's table comes with the native one beside it.
ENGINES = {"native": ("native",), "vllm": ("vllm", "native")}
# `--rollout adapter`'s modes (on the native engine).
ADAPTER_MODES = ("serving_alone", "rollout_alone", "rose", ADAPTER_MODE)


# Token ids of the serving prompts and rollout turns, drawn uniformly: valid in any vocabulary of
# 256 tokens or more (lengths matter here, not content).
PROMPT_IDS = (10, 256)

# Table 1 of the paper (8B, as public reviews give it; ../shared/paper-facts.md): P99 TTFT and
# TPOT over serving alone's, for the trade-off picture.
PAPER_8B = {"ROSE": (338.1 / 314.8, 136.1 / 117.8), "naive sharing": (1166.1 / 314.8, 135.6 / 117.8),
            "Prism": (973.2 / 314.8, 115.4 / 117.8)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    e = ExecutorConfig()
    p.add_argument("--quick", action="store_true", help="45 s per mode instead of 700 s / 200 s")
    p.add_argument("--engine", choices=list(ENGINE_MODES), default="native",
                   help="what serves the serving model (rose serve --engine); vllm (from a Python with vLLM) "
                   "also measures the native modes in the same run, beside it")
    p.add_argument("--serving-pool-share", type=float, default=0.25,
                   help="with --engine vllm: vLLM's KV cache as a share of the 512 MB (the rollout pool is "
                   "the rest; 0.25: 8 of the replay's longest requests, rollouts 384 MB)")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--serving-model", help="serving checkpoint (HF format; default: a fresh qwen2 `small`)")
    p.add_argument("--rollout-model", help="rollout checkpoint (HF format; default: a fresh qwen3 `small`)")
    p.add_argument("--rollout", choices=("model", "adapter"), default="model",
                   help="adapter: the policy is a LoRA adapter of the serving model, run as a second copy "
                   "of it (rose) and riding its forward (rose_adapter)")
    p.add_argument("--lora-rank", type=int, default=16, help="with --rollout adapter: the adapter's rank")
    p.add_argument("--duration", type=float,
                   help="seconds of trace for serving_alone and rose (default 700: 214 requests at the "
                   "default rate and start)")
    p.add_argument("--baseline-duration", type=float,
                   help="seconds for rollout_alone, naive_share and static_partition (default 200; "
                   "--duration with --quick)")
    p.add_argument("--runs", type=int, default=1, help="repeat the measurement; figures as median and spread")
    p.add_argument("--admission-quantile", type=float, default=e.admission_quantile)
    p.add_argument("--tpot-inflation", type=float, default=e.tpot_inflation)
    p.add_argument("--ttft-inflation", type=float, default=e.ttft_inflation)
    p.add_argument("--sweep-quantile", help="comma-separated admission quantiles, one more rose mode each")
    p.add_argument("--sweep-inflation", help="comma-separated TPOT inflation budgets (inf: the SLO alone), "
                   "one more rose mode each")
    p.add_argument("--plot", help="write the trade-off picture (P99 inflation against harvest ratio) here")
    p.add_argument("--rate", type=float, default=0.35, help="serving requests per second (mean)")
    p.add_argument("--slo-factor", type=float, default=1.5, help="SLO = this x serving-alone P99")
    p.add_argument("--trajectories", type=int, default=16, help="concurrent rollout trajectories")
    p.add_argument("--start", type=float, default=600.0, help="offset into the trace, seconds")
    p.add_argument("--burst", action="store_true", help="a serving spike that needs the rollouts' KV pages "
                   "instead: serving alone, naive, static and rose over one window of it (rose.bench.burst)")
    add_device_arguments(p)
    from rose.bench import burst  # it builds on this module's helpers

    burst.add_arguments(p)


@contextlib.contextmanager
def bench_server(serving: Path, rollouts: Rollouts, mode: str, policy: str, slo: dict[str, float],
                 core: str | None, extra: tuple[str, ...] = ()) -> Iterator[str]:
    """A `rose serve` process as every benchmark mode runs it (one thread, on `core`, a 512 MiB
    pool unless `extra` says otherwise, `mode`'s rollouts): its URL."""
    argv = ["--model", str(serving), *rollouts.server_args(mode), "--policy", policy, "--threads", "1",
            "--pool-mb", "512", "--slo-ttft-ms", str(slo["ttft_ms"]), "--slo-tpot-ms", str(slo["tpot_ms"])]
    if core is not None:
        argv += ["--cores", core]
    with serve_process([*argv, *extra]) as (url, _):
        yield url


def _metric(url: str, sample: str, **labels: str) -> float:
    """One sample of the server's Prometheus metrics (0 when absent)."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def _work(url: str) -> dict[str, float]:
    """Seconds of compute and iterations so far, per model."""
    return {f"{kind}_{model}": _metric(url, f"rose:{kind}_total", engine=model)
            for kind in ("busy_seconds", "iterations") for model in ("serving", "rollout")}


def _mean_ms(before: dict[str, float], after: dict[str, float], model: str) -> float | None:
    """Mean compute time of one of `model`'s iterations between two `_work` readings: whether
    serving's own iterations run slower beside rollouts."""
    n = after[f"iterations_{model}"] - before[f"iterations_{model}"]
    busy = after[f"busy_seconds_{model}"] - before[f"busy_seconds_{model}"]
    return round(1e3 * busy / n, 3) if n else None


def first_prompt(rng: np.random.Generator) -> list[int]:
    """A rollout trajectory's first turn: 128 tokens."""
    return rng.integers(*PROMPT_IDS, 128).tolist()


def next_prompt(history: list[int], produced: list[int], finished: bool,
                rng: np.random.Generator) -> list[int]:
    """The trajectory's next turn: what it had, what the turn produced, and a 32-token observation
    after a turn that finished (one handed back resumes with its tokens); a new trajectory once
    past 1,500 tokens."""
    history = history + produced
    if finished:
        history += rng.integers(*PROMPT_IDS, 32).tolist()
    return first_prompt(rng) if len(history) > 1500 else history


async def _backlog(url: str, stop_at: float, trajectories: int, rng: np.random.Generator,
                   adapter: str | None) -> dict[str, int]:
    """Multi-turn rollouts that keep the device saturated until `stop_at`: each turn is the
    trajectory so far plus a new observation, run with `adapter`; a turn handed back is resumed
    with its tokens."""
    client = LeaseClient(url)
    counts = {"tokens": 0, "turns": 0, "handed_back": 0}

    async def trajectory(k: int) -> None:
        history = first_prompt(rng)
        turn = 0
        while time.perf_counter() < stop_at:
            params = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True)
            got = TurnOutput()
            try:
                await client.run_turn(Turn(f"t{k}-{turn}", f"traj{k}", history, params, None, adapter), got)
            except LeaseError:
                await asyncio.sleep(0.05)
            finally:  # a turn cut off at the end of the window still counts what it produced
                counts["tokens"] += len(got.token_ids)
            counts["handed_back"] += got.finish_reason == "abort"
            counts["turns"] += got.finish_reason not in (None, "abort")
            history = next_prompt(history, got.token_ids, got.finish_reason not in (None, "abort"), rng)
            turn += 1

    tasks = [asyncio.create_task(trajectory(k)) for k in range(trajectories)]
    await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    return counts


async def _measure(url: str, mode: str, duration: float, args: argparse.Namespace, slo: dict[str, float],
                   adapter: str | None = None) -> tuple[dict[str, Any], list[RequestResult]]:
    """Run one mode for `duration` s: its figures, and the serving requests' own results."""
    _, traffic, rollouts = MODES.get(mode, MODES["rose"])  # rose_q<Q>, rose_i<E>: rose's
    work0, t0 = _work(url), time.perf_counter()
    jobs = []
    if rollouts:
        jobs.append(_backlog(url, t0 + duration, args.trajectories, np.random.default_rng(1), adapter))
    if traffic:
        trace = build_trace("azure-conv", duration, load=args.rate / 5.53, start_s=args.start,
                            prompt_scale=0.125)
        jobs.append(replay(url, trace, max_context=1024, max_output=64, vocab=PROMPT_IDS))
    done = await asyncio.gather(*jobs)
    wall = time.perf_counter() - t0
    work = _work(url)
    result: dict[str, Any] = {"wall_s": round(wall, 2),
                              "serving_busy_fraction": round(
                                  (work["busy_seconds_serving"] - work0["busy_seconds_serving"]) / wall, 4),
                              "serving_iteration_ms": _mean_ms(work0, work, "serving"),
                              "rollout_iteration_ms": _mean_ms(work0, work, "rollout"),
                              "latency_model_error": round(_metric(url, "rose:latency_model_error"), 4),
                              "admission_overruns": _metric(url, "rose:admission_overruns_total"),
                              "rollout_share_end": _metric(url, "rose:rollout_share"),
                              "rollout_interrupted": _metric(url, "rose:rollout_interrupted_total"),
                              "rollout_turns_cut": _metric(url, "rose:rollout_aborted_turns_total"),
                              "rollout_tokens_beside_serving": _metric(
                                  url, "rose:rollout_tokens_beside_serving_total"),
                              "bursts": _metric(url, "rose:burst_transitions_total",
                                                from_state="normal", to_state="burst")}
    if rollouts:
        result.update(rollout=done[0], rollout_tokens_per_s=round(done[0]["tokens"] / wall, 2))
    requests = done[-1] if traffic else []
    if traffic:
        result.update(summarize(requests, wall, **slo_kwargs(slo)))
    return result, requests


def rose_args(args: argparse.Namespace, quantile: float | None = None, tpot_inflation: float | None = None
              ) -> tuple[str, ...]:
    """The `rose` policy's admission flags, from the benchmark's options (or the sweep's values)."""
    q = args.admission_quantile if quantile is None else quantile
    tpot = args.tpot_inflation if tpot_inflation is None else tpot_inflation
    return ("--admission-quantile", str(q), "--tpot-inflation", str(tpot),
            "--ttft-inflation", str(args.ttft_inflation))


def _floats(spec: str | None) -> list[float]:
    return [float(x) for x in spec.split(",")] if spec else []


def _modes(args: argparse.Namespace, engine: str, duration: float, baseline: float
           ) -> list[tuple[str, str, float, tuple[str, ...]]]:
    """The modes after serving_alone on `engine`: (mode, server policy, seconds, server flags)."""
    # rollout_alone runs under the same admission settings as rose: its capacity is what rose
    # could harvest from an idle device (the idle cap bounds each step).
    each = {"rollout_alone": ("rose", baseline, rose_args(args)), "naive_share": ("naive", baseline, ()),
            "static_partition": ("static", baseline, ()), "priority": ("priority", baseline, ()),
            "rose": ("rose", duration, rose_args(args)), ADAPTER_MODE: ("rose", duration, rose_args(args))}
    names = ADAPTER_MODES if args.rollout == "adapter" else ENGINE_MODES[engine]
    return [*((mode, *each[mode]) for mode in names[1:]),
            *((f"rose_q{q:g}", "rose", duration, rose_args(args, quantile=q))
              for q in _floats(args.sweep_quantile)),
            *((f"rose_i{e:g}", "rose", duration, rose_args(args, tpot_inflation=e))
              for e in _floats(args.sweep_inflation))]


def _one_run(args: argparse.Namespace, serving: Path, rollouts: Rollouts, core: str | None,
             device: tuple[str, ...]) -> dict[str, Any]:
    """Each engine of `--engine` in turn (`ENGINES`): its summary and modes; with more than one
    engine, keyed by engine."""
    duration = args.duration or (45.0 if args.quick else 700.0)
    baseline = args.baseline_duration or (duration if args.quick else 200.0)
    engines = {engine: _modes(args, engine, duration, baseline) for engine in ENGINES[args.engine]}
    with bar("bench coserve", sum(1 + len(modes) for modes in engines.values())) as progress:
        runs = {engine: _engine_run(args, engine, modes, duration, serving, rollouts, core, device, progress)
                for engine, modes in engines.items()}
    if len(runs) == 1:
        return next(iter(runs.values()))
    return {"summary": {"engine": args.engine, **{e: r["summary"] for e, r in runs.items()}},
            "modes": {e: r["modes"] for e, r in runs.items()}}


def _engine_run(args: argparse.Namespace, engine: str, modes: list[tuple[str, str, float, tuple[str, ...]]],
                duration: float, serving: Path, rollouts: Rollouts, core: str | None, device: tuple[str, ...],
                progress: Any) -> dict[str, Any]:
    """serving_alone on `engine` (which sets its SLO), then every other mode on a fresh server."""
    loose = {"ttft_ms": 1e6, "tpot_ms": 1e6}
    tag = "" if args.engine == engine == "native" else f"{engine} "
    # vLLM's KV cache is its own: a share of the 512 MB, the rollout pool the rest.
    flags = (*(("--engine", "vllm", "--serving-pool-share", str(args.serving_pool_share))
               if engine == "vllm" else ()), *device)
    progress.describe(f"{tag}serving_alone")
    with bench_server(serving, rollouts, "serving_alone", "rose", loose, core, flags) as url:
        alone, requests = asyncio.run(_measure(url, "serving_alone", duration, args, loose))
    progress.advance()
    slo = {"ttft_ms": round(args.slo_factor * alone["p99_ttft_ms"], 1),
           "tpot_ms": round(args.slo_factor * alone["p99_tpot_ms"], 1)}
    results = {"serving_alone": {**alone, **summarize(requests, alone["wall_s"], **slo_kwargs(slo))}}
    added: dict[str, dict[str, float]] = {}
    print(f"{tag}serving_alone", alone, "slo", slo, flush=True)
    for mode, policy, seconds, extra in modes:
        progress.describe(f"{tag}{mode}")
        with bench_server(serving, rollouts, mode, policy, slo, core, (*extra, *flags)) as url:
            measured = _measure(url, mode, seconds, args, slo, rollouts.turn_adapter)
            results[mode], served = asyncio.run(measured)
        if served and seconds == duration:  # the same trace requests as serving alone's
            added[mode] = _ttft_added(requests, served)
        print(f"{tag}{mode}", {k: v for k, v in results[mode].items() if k != "rollout"}, flush=True)
        progress.advance()
    return {"summary": _summary(results, slo, added, args.admission_quantile), "modes": results}


def _summary(results: dict[str, dict[str, Any]], slo: dict[str, float], added: dict[str, dict[str, float]],
             admission_quantile: float) -> dict[str, Any]:
    """One engine's figures: per mode its P99s, attainment and rollout tokens/s, its P99s over
    serving alone's, its harvest against the idle capacity and against naive sharing's."""
    idle = 1.0 - results["serving_alone"]["serving_busy_fraction"]
    capacity = results["rollout_alone"]["rollout_tokens_per_s"]
    naive = results.get("naive_share", {}).get("rollout_tokens_per_s")
    alone = results["serving_alone"]
    summary: dict[str, Any] = {"slo": slo, "idle_fraction_serving_alone": round(idle, 4)}
    for mode, r in results.items():
        summary[mode] = {k: r.get(k) for k in ("p99_ttft_ms", "p99_tpot_ms", "slo_attainment",
                                               "rollout_tokens_per_s", "rollout_tokens_beside_serving",
                                               "completed")}
        if mode not in ("serving_alone", "rollout_alone"):
            summary[mode].update(ttft_vs_alone=round(r["p99_ttft_ms"] / alone["p99_ttft_ms"], 3),
                                 tpot_vs_alone=round(r["p99_tpot_ms"] / alone["p99_tpot_ms"], 3),
                                 harvest_ratio=round(r["rollout_tokens_per_s"] / (idle * capacity), 3),
                                 harvest_vs_naive=round(r["rollout_tokens_per_s"] / naive, 3) if naive
                                 else None,
                                 **added.get(mode, {}))
    summary["harvest_ratio"] = summary["rose"]["harvest_ratio"]
    summary["harvest_vs_naive"] = summary["rose"]["harvest_vs_naive"]
    summary["admission_quantile"] = admission_quantile
    summary["latency_model_error_rose"] = results["rose"]["latency_model_error"]
    summary["admission_overruns_rose"] = results["rose"]["admission_overruns"]
    if ADAPTER_MODE in results:
        summary["adapter_vs_two_models"] = round(
            results[ADAPTER_MODE]["rollout_tokens_per_s"] / results["rose"]["rollout_tokens_per_s"], 3)
    return summary


def _ttft_added(alone: list[RequestResult], beside: list[RequestResult]) -> dict[str, float]:
    """What a mode added to each trace request's TTFT over serving alone (the same request, sent
    at the same offset): a P99 rests on a few requests, these on all of them. `_long`: the
    tenth of requests with the longest prompts, where the TTFT tail is."""
    pairs = [(a.prompt_tokens, (b.ttft_s - a.ttft_s) * 1e3) for a, b in zip(alone, beside, strict=True)
             if a.ttft_s is not None and b.ttft_s is not None]
    if not pairs:
        return {}
    longest = np.percentile([p for p, _ in pairs], 90)
    added = np.array([d for _, d in pairs])
    return {"ttft_added_mean_ms": round(float(added.mean()), 2),
            "ttft_added_p90_ms": round(float(np.percentile(added, 90)), 2),
            "ttft_added_long_ms": round(float(np.mean([d for p, d in pairs if p >= longest])), 2)}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}


def _across_runs(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric figure of the per-run summaries as its median and spread."""
    out: dict[str, Any] = {}
    for key, first in summaries[0].items():
        if isinstance(first, dict) and key != "slo":
            out[key] = {k: _spread([s[key][k] for s in summaries]) for k, v in first.items()
                        if isinstance(v, int | float)}
        elif isinstance(first, int | float):
            out[key] = _spread([s[key] for s in summaries])
    out["slo"] = [s["slo"] for s in summaries]
    return out


def _combined(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's summary: a single run's as it is, several runs' as median and spread."""
    return summaries[0] if len(summaries) == 1 else _across_runs(summaries)


def plot_tradeoff(summaries: list[dict[str, Any]], path: str) -> None:
    """P99 TPOT and TTFT over serving alone's against harvest ratio, a point per mode and run,
    with the paper's Table 1 (8B) as reference lines (it gives no harvest ratio)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = [m for m in summaries[0] if m.startswith(("rose", "naive", "static", "priority"))]
    for ax, key, name in ((axes[0], "tpot_vs_alone", "P99 TPOT"), (axes[1], "ttft_vs_alone", "P99 TTFT")):
        for i, mode in enumerate(modes):
            xs = [s[mode]["harvest_ratio"] for s in summaries]
            ys = [s[mode][key] for s in summaries]
            ax.scatter(xs, ys, color=f"C{i}", label=mode)
        for j, (label, (ttft, tpot)) in enumerate(PAPER_8B.items()):
            ax.axhline(tpot if key == "tpot_vs_alone" else ttft, color=f"C{j + len(modes)}",
                       linestyle=":", label=f"paper 8B {label}")
        ax.axhline(summaries[0]["slo"]["tpot_ms" if key == "tpot_vs_alone" else "ttft_ms"]
                   / summaries[0]["serving_alone"][f"p99_{key[:4]}_ms"], color="k", linestyle="--",
                   label="SLO")
        ax.set(xlabel="harvest ratio (rollout tokens / idle capacity)", ylabel=f"{name} / serving alone",
               yscale="log")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_engine(args: argparse.Namespace, serving: Path | None) -> None:
    """`--engine vllm` needs vLLM in this Python (the servers run from it) and a serving model
    vLLM's CPU attention takes (the default `small` preset's head_dim, 64, it does)."""
    if args.engine != "vllm":
        return
    if not 0 < args.serving_pool_share < 1:
        raise ValueError(f"--serving-pool-share must be in (0, 1), got {args.serving_pool_share}")
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("--engine vllm: vllm is not installed in this Python (`make install-vllm` makes "
                         ".venv-vllm, which has it)")
    from rose.engine.vllm_engine import check_model
    from rose.model.device import resolve

    if serving is not None:
        try:
            check_model(ModelConfig.from_dir(serving), str(resolve(args.device, args.dtype)[0]))
        except ValueError as exc:
            raise ValueError(f"--engine vllm --serving-model {serving}: {exc}") from None


def check_rollout(args: argparse.Namespace) -> None:
    """`--rollout adapter`: an adapter of the serving model, on the native engine (its rollout
    model is the serving model again: none other may be named)."""
    if args.rollout != "adapter":
        return
    if args.engine != "native":
        raise ValueError("--rollout adapter: adapter mode runs on the native engine; expected --engine "
                         "native")
    if args.rollout_model is not None:
        raise ValueError("--rollout adapter: the policy is an adapter of the serving model, whose second "
                         "copy is the two-model modes' rollout model; expected no --rollout-model")
    if args.lora_rank < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {args.lora_rank}")


def pin_server_core() -> str | None:
    """The server's core (None with one core): the server gets a core of its own; this process,
    the load generator and the rollout driver, keeps the others."""
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        return None
    os.sched_setaffinity(0, cores - {max(cores)})
    return str(max(cores))


@contextlib.contextmanager
def default_models(serving: Path | None, rollout: Path | None) -> Iterator[tuple[Path, Path]]:
    """The checkpoints given, or fresh `small` ones (a Qwen2 serving, a Qwen3 rollout model)."""
    with tempfile.TemporaryDirectory() as tmp:
        yield (serving or init_model("qwen2", "small", Path(tmp) / "serving", seed=1),
               rollout or init_model("qwen3", "small", Path(tmp) / "rollout", seed=2))


def run(args: argparse.Namespace) -> int:
    if args.burst:
        from rose.bench import burst

        return burst.run(args)
    # The checkpoints, device and engine given are checked before anything changes or starts.
    device = serve_device_args(args)
    serving, rollout = (checkpoint_arg(flag, path, PROMPT_IDS[1]) if path is not None else None
                        for flag, path in (("--serving-model", args.serving_model),
                                           ("--rollout-model", args.rollout_model)))
    check_engine(args, serving)
    check_rollout(args)
    server_core = pin_server_core()
    with default_models(serving, rollout) as (serving, rollout), tempfile.TemporaryDirectory() as tmp:
        rollouts = (adapter_rollouts(serving, Path(tmp) / "adapter", args.lora_rank)
                    if args.rollout == "adapter" else Rollouts(rollout))
        runs = [_one_run(args, serving, rollouts, server_core, device) for _ in range(args.runs)]
        given_back = second_model_pages(serving, args.lora_rank, resolve(args.device, args.dtype)[1])
    summaries = [r["summary"] for r in runs]
    if args.rollout == "adapter":
        for s in summaries:
            s["second_model"] = given_back
    engines = ENGINES[args.engine]
    if len(engines) == 1:
        summary = _combined(summaries)
    else:  # a summary per engine, the one asked for first
        summary = {"engine": args.engine, **{e: _combined([s[e] for s in summaries]) for e in engines}}
        summaries = [s[args.engine] for s in summaries]
    if args.plot:  # the modes of the engine asked for
        plot_tradeoff(summaries, args.plot)
    config = {k: getattr(args, k) for k in ("engine", "serving_pool_share", "serving_model", "rollout_model",
                                            "rollout", "lora_rank",
                                            "duration", "baseline_duration", "quick", "rate", "trajectories",
                                            "start", "slo_factor", "runs",
                                            "admission_quantile", "tpot_inflation", "ttft_inflation",
                                            "sweep_quantile", "sweep_inflation", "device", "dtype")}
    write_report(args.json, summary, config=config, runs=runs)
    return 0
def slo_kwargs(slo: dict[str, float]) -> dict[str, float]:
    """The SLOs as `loadgen.summarize` takes them."""
    return {"slo_ttft_ms": slo["ttft_ms"], "slo_tpot_ms": slo["tpot_ms"]}
