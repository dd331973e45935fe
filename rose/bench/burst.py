"""`rose bench coserve --burst`: a serving spike that needs the KV pages rollouts hold.

One serving device as in `rose bench coserve` (a `rose serve` process on one core, a `small`
Qwen2 serving and a `small` Qwen3 rollout model, the backlog of multi-turn rollout turns on the
lease API), over one window of a real trace that holds a spike of its own (`burst_window`: the
stretch of `rose bench coserve`'s replay of the trace where the most KV tokens arrive), on a KV
pool small enough that serving's KV at the spike's peak needs more than the headroom the
executor keeps for it, so the rollouts' pages (`--burst-pool-mb`). Four modes over the same
window: `serving_alone`, `naive_share`, `static_partition`, `rose`. With `--engine vllm` vLLM's
engine serves (`rose serve --engine vllm`): its KV cache is its own, `--serving-pool-share` of the
pool, so the spike fills vLLM's cache, not the rollouts' pool, and vLLM preempts serving requests
when it is full; the modes there are `serving_alone`, `naive_share`, `priority` and `rose`.
`--rollout adapter` (native engine) adds `rose_adapter`, the executor's adapter mode: the policy
an adapter of the serving model, its turns' pages in the same pool as serving's (the two-model
`rose` runs the adapter on a second copy of the serving model, `rose.bench.rollouts`); both on
the same pool, the pages the second copy's weights would give back stated beside them.

Measured, besides what the server's /metrics say at the end:
- every ~100 ms, the pool (serving, rollout and free pages, the rollout budget, the burst
  state, rollout tokens so far): the timeline of the plot;
- the burst: each trigger, the emergency cuts, the pages and turns cut, how many iterations
  and milliseconds after the trigger rollouts held no more than the cut's budget (the pages are
  serving's), the burst and the freeze; the freeze lasts until the next RL step, which this
  benchmark begins (`POST /v1/lease/new_rl_step`) `--next-step-s` after each trigger (the freeze
  ends then, or once serving recedes);
- the hand-back: a cut turn streams its tokens before its abort (finish reason "abort"); its
  trajectory resumes it as the rollout scheduler does (its prompt plus the tokens produced, its
  budget less them) and the benchmark follows it until it finishes;
- serving's P99 TTFT and TPOT of the requests that arrive inside the spike and outside it,
  against serving alone's in the same windows;
- rollout tokens per second before the trigger, from it until the next RL step, and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from rose.bench import checkpoint_arg, serve_device_args
from rose.bench.coserve import (
    PROMPT_IDS,
    bench_server,
    check_engine,
    check_rollout,
    default_models,
    first_prompt,
    pin_server_core,
    rose_args,
    slo_kwargs,
)
from rose.bench.rollouts import ADAPTER_MODE, Rollouts, adapter_rollouts, second_model_pages
from rose.contracts import Turn, TurnOutput
from rose.coserve.lease_client import ExecutorBusy, LeaseClient, LeaseError
from rose.coserve.loadgen import RequestResult, build_trace, kv_tokens, replay, summarize
from rose.coserve.metrics import read_pool_sample, transitions
from rose.coserve.settings import ExecutorConfig
from rose.engine import SamplingParams
from rose.engine.kv_pool import KVSpec
from rose.model import ModelConfig
from rose.model.device import resolve
from rose.progress import bar
from rose.reporting import write_report
from rose.traces import Trace, densest, load_trace

# engine -> mode -> (server policy, rollouts)
ENGINE_MODES = {"native": {"serving_alone": ("rose", False), "naive_share": ("naive", True),
                           "static_partition": ("static", True), "rose": ("rose", True)},
                "vllm": {"serving_alone": ("rose", False), "naive_share": ("naive", True),
                         "priority": ("priority", True), "rose": ("rose", True)}}
TURN_TOKENS = 64  # a rollout turn's budget, as `rose bench coserve`'s backlog
SAMPLE_S = 0.1    # the pool timeline's period


@dataclasses.dataclass(frozen=True)
class Scale:
    """How the trace is replayed: its rate times `load`, prompts times `prompt_scale`, outputs at
    most `max_output`, every request within `max_context` tokens (`rose bench coserve`'s replay:
    0.35 requests/s)."""

    trace: str = "azure-conv"
    load: float = 0.35 / 5.53
    prompt_scale: float = 0.125
    max_output: int = 64
    max_context: int = 1024


@dataclasses.dataclass(frozen=True)
class BurstWindow:
    """A replay window: `duration_s` of the scaled trace from `start_s`, its spike from
    `spike[0]` to `spike[1]` seconds into the window."""

    scale: Scale
    start_s: float
    duration_s: float
    spike: tuple[float, float]
    spike_requests: int
    spike_kv_tokens: int  # prompt and output tokens of the requests that arrive in the spike
    mean_kv_tokens_per_s: float  # over the whole scaled trace: the spike against it

    def trace(self) -> Trace:
        s = self.scale
        return build_trace(s.trace, self.duration_s, load=s.load, start_s=self.start_s,
                           prompt_scale=s.prompt_scale)

    def inside(self, scheduled_s: float) -> bool:
        return self.spike[0] <= scheduled_s < self.spike[1]


def burst_window(scale: Scale, duration_s: float, spike_s: float, lead_s: float) -> BurstWindow:
    """The window of the scaled trace around its spike: the `spike_s` seconds in which the most
    KV tokens arrive (prompt and output, as replayed), `lead_s` seconds into a `duration_s` window.
    Refused when the window cannot hold the spike."""
    if not (spike_s > 0 and lead_s >= 0 and lead_s + spike_s <= duration_s):
        raise ValueError(f"the spike ({spike_s:g} s, {lead_s:g} s in) must lie inside the "
                         f"{duration_s:g} s window")
    trace = load_trace(scale.trace).scaled(rate=scale.load, prompt_tokens=scale.prompt_scale)
    tokens = kv_tokens(trace, scale.max_context, scale.max_output)
    at, held = densest(trace.arrival_s, tokens, spike_s)
    start = at - lead_s
    inside = (trace.arrival_s >= at) & (trace.arrival_s < at + spike_s)
    return BurstWindow(scale, start, duration_s, (lead_s, lead_s + spike_s), int(inside.sum()),
                       int(held), float(tokens.sum() / trace.period_s))


# -- the rollout backlog, following each cut turn ----------------------------------------------


@dataclasses.dataclass
class HandBack:
    """The rollout side of a mode: tokens, turns, and what became of the turns handed back."""

    tokens: int = 0               # rollout tokens streamed to the backlog
    turns_finished: int = 0       # turns that reached their end (a resumed one counted once)
    handed_back: int = 0          # attempts that ended with finish reason "abort"
    handed_back_with_tokens: int = 0  # those that had produced tokens (the rest: none to hand back)
    partial_tokens: int = 0       # the tokens they had produced, handed back with them
    resumed: int = 0              # handed-back attempts whose turn their trajectory sent again
    resumed_finished: int = 0     # handed-back attempts whose turn, resumed (perhaps handed back
                                  # again), reached its end
    unfinished_at_end: int = 0    # handed-back attempts whose turn had not finished when the window closed
    resumed_prefill_tokens: int = 0  # prompt tokens of the resumed attempts: KV built again, at most
    refused: int = 0              # attempts the executor turned away (429: lease slots full), retried
    lost: int = 0                 # attempts whose stream ended without a finish reason: tokens lost

    def figures(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class Room:
    """Where a turn the device handed back may go back to it, as `rose train`'s scheduler sends
    it (the benchmark has no other device): not before a capacity report made after the cut (the
    routing table marks the device full at the abort), then for one of the free slots a report
    gives, each taken once; in a burst the device reports none, frozen only what its halved
    budget holds. Once the freeze is over the turn goes back as the backlog's new turns do."""

    def __init__(self, url: str, client: httpx.AsyncClient) -> None:
        self.url, self.client = url, client
        self.free = 0  # slots of the last report, less those taken since
        self.normal = False  # the last report's burst state is normal
        self._poll: asyncio.Task[None] | None = None
        self._report = asyncio.Event()

    async def _polling(self) -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                capacity = (await self.client.get(f"{self.url}/v1/lease/capacity")).json()
                self.free, self.normal = capacity["free_slots"], capacity["state"] == "normal"
                self._report.set()
            await asyncio.sleep(0.25)

    async def take(self, stop_at: float) -> None:
        """Wait for a report made after this call that has room (or until `stop_at`)."""
        if self._poll is None:
            self._poll = asyncio.create_task(self._polling())
        self._report.clear()
        while time.perf_counter() < stop_at:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._report.wait(), max(0.0, stop_at - time.perf_counter()))
            if self.normal:
                return
            if self.free > 0:
                self.free -= 1
                return
            self._report.clear()

    async def close(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            await asyncio.gather(self._poll, return_exceptions=True)
        await self.client.aclose()


async def backlog(url: str, stop_at: float, trajectories: int, rng: np.random.Generator,
                  hand_back: HandBack, adapter: str | None = None) -> None:
    """Multi-turn rollouts that keep the device saturated until `stop_at`, as `rose bench
    coserve`'s backlog, resuming a turn handed back as the rollout scheduler does
    (`rose.rollout.routing.resume`): the tokens it produced join its prompt and come off its
    budget, so none is generated again, only their KV is built again (prefill); and it goes back
    once the device reports room for it again (`Room`)."""
    client, room = LeaseClient(url), Room(url, httpx.AsyncClient(timeout=httpx.Timeout(30.0)))

    async def trajectory(k: int) -> None:
        handed = [0]  # handed-back attempts of the turn in progress
        try:
            await turns(k, handed)
        finally:  # cancelled at the window's end too
            hand_back.unfinished_at_end += handed[0]

    async def turns(k: int, handed: list[int]) -> None:
        history = first_prompt(rng)
        turn = attempt = produced = 0
        while time.perf_counter() < stop_at:
            got = TurnOutput()
            params = SamplingParams(max_tokens=TURN_TOKENS - produced, temperature=1.0, ignore_eos=True)
            try:
                turn_id = f"t{k}-{turn}-{attempt}"
                await client.run_turn(Turn(turn_id, f"traj{k}", history, params, None, adapter), got)
            except ExecutorBusy:
                hand_back.refused += 1
                await asyncio.sleep(0.05)
                continue
            except LeaseError:
                await asyncio.sleep(0.05)
            finally:  # a turn cut off at the end of the window still counts what it produced
                hand_back.tokens += len(got.token_ids)
            hand_back.lost += got.finish_reason is None  # what came after its last event is lost
            history = history + got.token_ids
            produced += len(got.token_ids)
            attempt += 1
            if got.finish_reason == "abort":
                hand_back.handed_back += 1
                hand_back.handed_back_with_tokens += bool(got.token_ids)
                hand_back.partial_tokens += len(got.token_ids)
                handed[0] += 1
                await room.take(stop_at)
                if time.perf_counter() < stop_at:
                    hand_back.resumed += 1
                    hand_back.resumed_prefill_tokens += len(history)
            elif got.finish_reason is not None:
                hand_back.turns_finished += 1
                hand_back.resumed_finished += handed[0]
                history += rng.integers(*PROMPT_IDS, 32).tolist()  # the next observation
                if len(history) > 1500:
                    history = first_prompt(rng)
                turn, attempt, produced, handed[0] = turn + 1, 0, 0, 0

    tasks = [asyncio.create_task(trajectory(k)) for k in range(trajectories)]
    await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    await room.close()


# -- the pool timeline and the RL steps -------------------------------------------------------

async def timeline(url: str, t0: float, wall0: float, stop_at: float, next_step_s: float | None,
                   samples: list[dict[str, float]], steps: list[dict[str, Any]],
                   missed: list[dict[str, Any]]) -> None:
    """Scrape the pool every `SAMPLE_S` until `stop_at`; `next_step_s` after each burst trigger
    (the server's time of it), begin the next RL step (POST /v1/lease/new_rl_step), which lets the
    freeze end once serving recedes. Times are seconds from `t0` (perf_counter; `wall0` is the same
    instant in Unix time)."""
    last_trigger, step_at = 0.0, None
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
        while (now := time.perf_counter()) < stop_at:
            try:
                with_time = read_pool_sample((await client.get(f"{url}/metrics")).text)
            except httpx.HTTPError as exc:  # a scrape missed; the next one may answer
                missed.append({"t": round(now - t0, 3), "error": f"{type(exc).__name__}: {exc}"})
                await asyncio.sleep(SAMPLE_S)
                continue
            scrape_ms = round(1e3 * (time.perf_counter() - now), 1)
            samples.append({"t": round(now - t0, 3), "scrape_ms": scrape_ms, **with_time})
            if with_time["normal_to_burst"] > last_trigger:  # a new burst
                last_trigger = with_time["normal_to_burst"]
                if next_step_s is not None and step_at is None:
                    step_at = last_trigger - wall0 + next_step_s
            if step_at is not None and now - t0 >= step_at:
                r = await client.post(f"{url}/v1/lease/new_rl_step")
                steps.append({"t": round(time.perf_counter() - t0, 3), "at": step_at,
                              "state": r.json().get("state") if r.status_code == 200 else r.status_code})
                step_at = None
            await asyncio.sleep(max(0.0, SAMPLE_S - (time.perf_counter() - now)))


def burst_figures(events: list[tuple[float, str, str]], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The first burst's course: its trigger, the freeze, the next RL step (seconds into the
    window), and how many bursts began in all."""
    triggers = [t for t, a, b in events if a == "normal" and b == "burst"]
    out: dict[str, Any] = {"bursts": len(triggers)}
    if not triggers:
        return out
    trigger = triggers[0]
    later = [(t, a, b) for t, a, b in events if t >= trigger]
    normal = next((t for t, _, b in later if b == "normal"), None)
    frozen = next((t for t, _, b in later if b == "frozen" and (normal is None or t <= normal)), None)
    out.update(trigger_s=trigger, frozen_s=frozen, next_step_s=normal,
               burst_state_s=round(frozen - trigger, 3) if frozen is not None else None,
               freeze_s=round(normal - frozen, 3) if normal is not None and frozen is not None else None,
               trigger_to_next_step_s=round(normal - trigger, 3) if normal is not None else None,
               steps_begun=len(steps))
    return out


def harvest(samples: list[dict[str, float]], bounds: list[float]) -> list[float | None]:
    """Rollout tokens per second between consecutive `bounds` (seconds into the window), from the
    timeline's counter."""
    t = np.array([s["t"] for s in samples])
    tokens = np.array([s["rollout_tokens"] for s in samples])
    out: list[float | None] = []
    for lo, hi in itertools.pairwise(bounds):
        if hi - lo < 1.0 or len(t) < 2:
            out.append(None)
            continue
        a, b = np.interp([lo, hi], t, tokens)
        out.append(round(float(b - a) / (hi - lo), 2))
    return out


def value(text: str, sample: str, **labels: str) -> float:
    """One sample of a scrape of /metrics (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def histogram(text: str, name: str) -> dict[str, float | None]:
    """Count, mean and the least bucket bound that holds every observation of a histogram."""
    buckets: list[tuple[float, float]] = []
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{name}_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name == f"{name}_count":
                count = s.value
            elif s.name == f"{name}_sum":
                total = s.value
    if not count:
        return {"count": 0, "mean": None, "max_at_most": None}
    bound = min(le for le, c in buckets if c >= count)
    return {"count": int(count), "mean": total / count, "max_at_most": bound}


def window_figures(requests: list[RequestResult], window: BurstWindow, slo: dict[str, float]
                   ) -> dict[str, dict[str, Any]]:
    """Serving's P99s and SLO attainment over the requests that arrive inside the spike and the
    rest."""
    out = {}
    for part, keep in (("inside", True), ("outside", False)):
        chosen = [r for r in requests if window.inside(r.scheduled_s) is keep]
        spike = window.spike[1] - window.spike[0]
        s = summarize(chosen, spike if keep else window.duration_s - spike, **slo_kwargs(slo))
        out[part] = {k: s[k] for k in ("requests", "completed", "p99_ttft_ms", "p99_tpot_ms",
                                       "slo_attainment")}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


async def _measure(url: str, mode: str, window: BurstWindow, args: argparse.Namespace,
                   slo: dict[str, float], adapter: str | None) -> tuple[dict[str, Any], list[RequestResult]]:
    """One mode over the window: its figures and its serving requests' results."""
    policy, rollouts = engine_modes(args)[mode]
    scale = window.scale
    samples: list[dict[str, float]] = []
    steps: list[dict[str, Any]] = []
    missed: list[dict[str, Any]] = []
    hand_back = HandBack()
    t0, wall0 = time.perf_counter(), time.time()
    stop = t0 + window.duration_s
    next_step = args.next_step_s if rollouts and policy == "rose" else None
    jobs = [replay(url, window.trace(), max_context=scale.max_context, max_output=scale.max_output,
                   vocab=PROMPT_IDS),
            timeline(url, t0, wall0, stop, next_step, samples, steps, missed)]
    if rollouts:
        jobs.append(backlog(url, stop, args.trajectories, np.random.default_rng(1), hand_back, adapter))
    requests = (await asyncio.gather(*jobs))[0]
    wall = time.perf_counter() - t0
    text = httpx.get(f"{url}/metrics", timeout=60.0).text
    events = transitions(samples, wall0)
    course = burst_figures(events, steps)
    result: dict[str, Any] = {
        "wall_s": round(wall, 2), **course,
        # Every burst, the timeline's (a scrape sees one transition of a kind at most) or not.
        "bursts": value(text, "rose:burst_transitions_total", from_state="normal", to_state="burst"),
        "burst_cuts": value(text, "rose:burst_cuts_total"),
        "rollout_turns_cut": value(text, "rose:rollout_aborted_turns_total"),
        "rollout_pages_cut": value(text, "rose:burst_cut_pages_total"),
        "reclaim_iterations": histogram(text, "rose:burst_reclaim_iterations"),
        "reclaim_ms": {k: (round(v * 1e3, 3) if v is not None and k != "count" else v)
                       for k, v in histogram(text, "rose:burst_reclaim_seconds").items()},
        "serving_preemptions": value(text, "vllm:num_preemptions_total"),
        "serving_peak_pages": max((s["serving_pages"] - s["cached_serving_pages"] for s in samples),
                                  default=0.0),
        "pool_pages": max((s["serving_pages"] + s["rollout_pages"] + s["free_pages"] for s in samples),
                          default=None),
        **summarize(requests, wall, **slo_kwargs(slo)),
        "window": window_figures(requests, window, slo)}
    if rollouts:
        result["hand_back"] = hand_back.figures()
        result["rollout_tokens_per_s"] = round(hand_back.tokens / min(wall, window.duration_s), 2)
        if "trigger_s" in course:
            end = course.get("next_step_s") or window.duration_s
            before, during, after = harvest(samples, [0.0, course["trigger_s"], end, window.duration_s])
            result["harvest_tokens_per_s"] = {"before_trigger": before, "until_next_step": during,
                                              "after_next_step": after}
    result["scrapes_missed"] = len(missed)
    result["timeline"] = {"samples": samples, "events": events, "steps": steps, "missed": missed}
    return result, requests


def _one_run(args: argparse.Namespace, window: BurstWindow, serving: Path, rollouts: Rollouts,
             core: str | None, device: tuple[str, ...], run: int = 0) -> dict[str, Any]:
    pool = ("--pool-mb", str(args.burst_pool_mb))
    if args.engine == "vllm":  # vLLM's KV cache is its own: this share of the pool
        pool += ("--engine", "vllm", "--serving-pool-share", str(args.serving_pool_share))
    modes = {m: v for m, v in engine_modes(args).items() if m in burst_modes(args)}
    loose = {"ttft_ms": 1e6, "tpot_ms": 1e6}
    results: dict[str, Any] = {}
    requests: dict[str, list[RequestResult]] = {}
    with bar("bench coserve --burst", len(modes)) as progress:
        slo = loose
        for mode, (policy, _) in modes.items():
            progress.describe(mode)
            split = ("--static-rollout-pages", str(args.static_rollout_pages))
            log = (("--iteration-log", str(Path(args.iteration_log) / f"{mode}-run{run}.jsonl"))
                   if args.iteration_log else ())
            extra = (*pool, *(rose_args(args) if policy == "rose" else ()),
                     *(split if policy == "static" else ()), *log, *device)
            with bench_server(serving, rollouts, mode, policy, slo, core, extra) as url:
                measured = _measure(url, mode, window, args, slo, rollouts.turn_adapter)
                results[mode], requests[mode] = asyncio.run(measured)
            if mode == "serving_alone":  # its P99s over the window x --slo-factor: the others' SLO
                alone = results[mode]
                slo = {"ttft_ms": round(args.slo_factor * alone["p99_ttft_ms"], 1),
                       "tpot_ms": round(args.slo_factor * alone["p99_tpot_ms"], 1)}
                wall = alone["wall_s"]
                results[mode] = {**alone, **summarize(requests[mode], wall, **slo_kwargs(slo)),
                                 "window": window_figures(requests[mode], window, slo)}
            print(mode, {k: v for k, v in results[mode].items() if k != "timeline"}, flush=True)
            progress.advance()
    return {"slo": slo, "modes": results,
            "requests": {m: [dataclasses.asdict(r) | {"tpot_s": r.tpot_s} for r in rs]
                         for m, rs in requests.items()}}


def summarize_burst(run: dict[str, Any], window: BurstWindow, pool_mb: float,
                    static_rollout_pages: float = ExecutorConfig().static_rollout_pages) -> dict[str, Any]:
    """The headline figures: the burst in ROSE, each mode's serving inside and outside the spike
    against serving alone's in the same requests' window, the hand-back, the harvest."""
    modes = run["modes"]
    alone = modes["serving_alone"]["window"]
    e = ExecutorConfig()  # the settings every mode's server runs with, but for its pool
    pages = modes["rose"].get("pool_pages")
    pool: dict[str, Any] = {"mb": pool_mb, "pages": pages}
    if pages:
        headroom = int(pages * e.headroom)
        pool.update(headroom_pages=headroom,
                    watermark_pages=round(pages - headroom * (1 - e.high_watermark), 1),
                    static_serving_pages=pages - int(static_rollout_pages * pages),
                    # Whether the spike needs the rollouts' pages: serving alone's peak past the headroom.
                    serving_alone_peak_pages=modes["serving_alone"]["serving_peak_pages"])
    summary: dict[str, Any] = {"slo": run["slo"], "pool": pool, "window": {
        "trace": window.scale.trace, "start_s": window.start_s, "duration_s": window.duration_s,
        "spike_s": list(window.spike), "spike_requests": window.spike_requests,
        "load": window.scale.load, "prompt_scale": window.scale.prompt_scale}}
    for mode, r in modes.items():
        w = r["window"]
        figures: dict[str, Any] = {
            "slo_attainment": r.get("slo_attainment"), "p99_ttft_ms": r.get("p99_ttft_ms"),
            "p99_tpot_ms": r.get("p99_tpot_ms"), "serving_preemptions": r["serving_preemptions"],
            "serving_peak_pages": r["serving_peak_pages"]}
        for part in ("inside", "outside"):
            figures[part] = {**w[part],
                             "ttft_vs_alone": _ratio(w[part]["p99_ttft_ms"], alone[part]["p99_ttft_ms"]),
                             "tpot_vs_alone": _ratio(w[part]["p99_tpot_ms"], alone[part]["p99_tpot_ms"])}
        if "rollout_tokens_per_s" in r:
            figures["rollout_tokens_per_s"] = r["rollout_tokens_per_s"]
        summary[mode] = figures
    for name in ("rose", ADAPTER_MODE) if ADAPTER_MODE in modes else ("rose",):
        ran = modes[name]
        summary[name].update({k: ran.get(k) for k in (
            "bursts", "burst_cuts", "trigger_s", "burst_state_s", "freeze_s", "trigger_to_next_step_s",
            "rollout_pages_cut", "rollout_turns_cut", "reclaim_iterations", "reclaim_ms", "hand_back",
            "harvest_tokens_per_s")})
        reclaim = ran["reclaim_iterations"]["max_at_most"]
        summary[name]["reclaimed_within_one_iteration"] = reclaim is not None and reclaim <= 1
    ours = summary["rose"]["inside"]
    for mode, name in (("static_partition", "static"), ("priority", "priority")):
        if mode in summary:
            other = summary[mode]["inside"]
            summary[f"{name}_vs_rose_p99_tpot_inside"] = _ratio(other["p99_tpot_ms"], ours["p99_tpot_ms"])
            summary[f"{name}_vs_rose_p99_ttft_inside"] = _ratio(other["p99_ttft_ms"], ours["p99_ttft_ms"])
    return summary


def plot_burst(report: dict[str, Any], path: str) -> None:
    """The window, a column per mode: the pool (serving and rollout pages, the rollout budget)
    over time above, each serving request's TTFT and TPOT at its arrival below; the spike shaded,
    the triggers and the next RL step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = report["modes"]
    spike = report["summary"]["window"]["spike_s"]
    slo = report["summary"]["slo"]
    fig, axes = plt.subplots(2, len(modes), figsize=(4.2 * len(modes), 6.4), sharex=True, sharey="row")
    for col, (mode, r) in enumerate(modes.items()):
        top, bottom = axes[0][col], axes[1][col]
        samples = r["timeline"]["samples"]
        t = [s["t"] for s in samples]
        serving = [s["serving_pages"] - s["cached_serving_pages"] for s in samples]
        rollout = [s["rollout_pages"] - s["cached_rollout_pages"] for s in samples]
        top.stackplot(t, serving, rollout, colors=("C0", "C1"), alpha=0.7,
                      labels=("serving pages", "rollout pages (running turns)"))
        if mode == "rose":
            top.plot(t, [s["rollout_budget"] for s in samples], color="C1", linestyle=":",
                     label="rollout budget")
        if r.get("pool_pages"):
            top.axhline(r["pool_pages"], color="k", linewidth=0.8, label="pool")
        watermark = report["summary"]["pool"].get("watermark_pages")
        if watermark:
            top.axhline(watermark, color="k", linestyle="--", linewidth=0.8,
                        label="high watermark (rose: the burst trigger)")
        requests = report["requests"][mode]
        at = [q["scheduled_s"] for q in requests]
        bottom.scatter(at, [1e3 * q["ttft_s"] if q["ttft_s"] else np.nan for q in requests], s=8, color="C2",
                       label="TTFT")
        bottom.scatter(at, [1e3 * q["tpot_s"] if q["tpot_s"] else np.nan for q in requests], s=8, color="C3",
                       marker="x", label="TPOT")
        bottom.axhline(slo["ttft_ms"], color="C2", linestyle="--", linewidth=0.8, label="SLO TTFT")
        bottom.axhline(slo["tpot_ms"], color="C3", linestyle="--", linewidth=0.8, label="SLO TPOT")
        for ax in (top, bottom):
            ax.axvspan(*spike, color="0.9", zorder=0)
            for at_s, a, b in r["timeline"]["events"]:
                if a == "normal" and b == "burst":
                    ax.axvline(at_s, color="r", linewidth=0.8)
                elif b == "normal":
                    ax.axvline(at_s, color="g", linewidth=0.8)
            ax.grid(alpha=0.3)
        top.set_title(mode)
        bottom.set(yscale="log")
    axes[0][0].set_ylabel("KV pages")
    axes[1][0].set_ylabel("ms (request arrival on x)")
    for row in axes:  # one legend per row, the labels of its fullest panel
        handles, labels = max((ax.get_legend_handles_labels() for ax in row), key=lambda hl: len(hl[1]))
        row[-1].legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("rose: burst trigger red, next RL step (the freeze ends) green", fontsize=9)
    fig.supxlabel("seconds into the window (shaded: the spike's arrivals)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`rose bench coserve`'s options that only `--burst` reads (it reads most of the others too)."""
    g = p.add_argument_group("--burst", "a serving spike that needs the rollouts' KV pages "
                                        "(rose.bench.burst; --start does not apply)")
    g.add_argument("--burst-pool-mb", type=float, default=48.0,
                   help="the servers' KV pool, MiB (default: 48)")
    g.add_argument("--spike-s", type=float, default=20.0,
                   help="the spike: the seconds of the replay where the most KV tokens arrive (default: 20)")
    g.add_argument("--lead-s", type=float, default=20.0,
                   help="seconds of the window before the spike (default: 20)")
    g.add_argument("--next-step-s", type=float, default=10.0,
                   help="seconds from a burst's trigger to the next RL step, which lets the freeze end "
                   "once serving recedes (default: 10)")
    g.add_argument("--modes", help="comma-separated modes to run after serving_alone (default: all of the "
                   "engine's)")
    g.add_argument("--iteration-log", metavar="DIR", help="each server writes its executor's iterations "
                   "here, MODE-runK.jsonl (rose serve --iteration-log)")
    g.add_argument("--static-rollout-pages", type=float, default=ExecutorConfig().static_rollout_pages,
                   help="static_partition's rollout share of the pool (default: half, as without --burst)")


def engine_modes(args: argparse.Namespace) -> dict[str, tuple[str, bool]]:
    """The engine's modes, with adapter mode's under `--rollout adapter`."""
    adapter = {ADAPTER_MODE: ("rose", True)} if args.rollout == "adapter" else {}
    return {**ENGINE_MODES[args.engine], **adapter}


def burst_modes(args: argparse.Namespace) -> list[str]:
    """The modes to run on the engine: serving_alone (every other's SLO and reference), then
    `--modes` (all the engine's by default)."""
    known = list(engine_modes(args))
    if not args.modes:
        return known
    asked = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in asked if m not in known]
    if unknown:
        raise ValueError(f"--modes: {', '.join(unknown)}: not a mode of --engine {args.engine}; "
                         f"expected some of {', '.join(known[1:])}")
    return ["serving_alone", *(m for m in known[1:] if m in asked)]


def _check_vllm_cache(args: argparse.Namespace, serving: Path, max_context: int) -> None:
    """vLLM's share of the pool must hold one request of the replay's longest context."""
    spec = KVSpec.of(ModelConfig.from_dir(serving), resolve(args.device, args.dtype)[1])
    need_mb = max_context * spec.bytes_per_token / 2**20
    if args.burst_pool_mb * args.serving_pool_share < need_mb:
        raise ValueError(f"--burst --engine vllm: --serving-pool-share {args.serving_pool_share:g} of "
                         f"--burst-pool-mb {args.burst_pool_mb:g} is vLLM's KV cache, less than one request "
                         f"of {max_context} tokens needs ({need_mb:g} MiB); give a share of at least "
                         f"{need_mb / args.burst_pool_mb:.2f}")


def worst_run(summaries: list[dict[str, Any]]) -> int:
    """The run whose `rose` kept serving worst: the lowest SLO attainment inside or outside the
    spike, then the highest P99 TTFT and TPOT inside it over serving alone's."""
    def badness(s: dict[str, Any]) -> tuple[float, float, float]:
        r = s["rose"]
        attainment = min(r[part]["slo_attainment"] or 0.0 for part in ("inside", "outside"))
        return (-attainment, r["inside"]["ttft_vs_alone"] or 0.0, r["inside"]["tpot_vs_alone"] or 0.0)

    return max(range(len(summaries)), key=lambda i: badness(summaries[i]))


def median_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number of the runs' summaries as its median over the runs (the rest as the first run's)."""
    first = summaries[0]
    if isinstance(first, dict):
        return {k: median_summary([s[k] for s in summaries]) for k in first}
    if isinstance(first, int | float) and not isinstance(first, bool) and all(
            isinstance(s, int | float) for s in summaries):
        return round(float(np.median(summaries)), 3)
    return first


def run(args: argparse.Namespace) -> int:
    for flag, given in (("--sweep-quantile", args.sweep_quantile),
                        ("--sweep-inflation", args.sweep_inflation),
                        ("--baseline-duration", args.baseline_duration)):
        if given:
            raise ValueError(f"{flag} does not apply to --burst (its modes over one window)")
    if "rose" not in burst_modes(args):
        raise ValueError("--burst --modes: the figures are rose's against the others; include rose")
    if args.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {args.runs}")
    device = serve_device_args(args)
    serving, rollout = (checkpoint_arg(flag, path, PROMPT_IDS[1]) if path is not None else None
                        for flag, path in (("--serving-model", args.serving_model),
                                           ("--rollout-model", args.rollout_model)))
    check_engine(args, serving)
    check_rollout(args)
    duration = args.duration or (60.0 if args.quick else 90.0)
    # The replay `rose bench coserve` makes (the trace's mean rate is 5.53 requests/s).
    window = burst_window(Scale(load=args.rate / 5.53), duration, args.spike_s, args.lead_s)
    if args.iteration_log:
        Path(args.iteration_log).mkdir(parents=True, exist_ok=True)
    with default_models(serving, rollout) as (serving, rollout), tempfile.TemporaryDirectory() as tmp:
        if args.engine == "vllm":
            _check_vllm_cache(args, serving, window.scale.max_context)
        core = pin_server_core()
        rollouts = (adapter_rollouts(serving, Path(tmp) / "adapter", args.lora_rank)
                    if args.rollout == "adapter" else Rollouts(rollout))
        reports = [_one_run(args, window, serving, rollouts, core, device, k) for k in range(args.runs)]
        second = (second_model_pages(serving, args.lora_rank, resolve(args.device, args.dtype)[1])
                  if args.rollout == "adapter" else None)
    summaries = [{"engine": args.engine, **summarize_burst(r, window, args.burst_pool_mb,
                                                            args.static_rollout_pages),
                  **({"second_model": second} if second else {})} for r in reports]
    worst = worst_run(summaries)
    summary = summaries[0] if args.runs == 1 else {
        "runs": args.runs, "worst_run": worst, "worst": summaries[worst], "median": median_summary(summaries),
        "each": summaries}
    if args.plot:
        plot_burst({**reports[worst], "summary": summaries[worst]}, args.plot)
    config = {k: getattr(args, k) for k in (
        "engine", "serving_pool_share", "serving_model", "rollout_model", "rollout", "lora_rank", "duration",
        "quick", "trajectories",
        "slo_factor", "admission_quantile", "tpot_inflation", "ttft_inflation", "burst_pool_mb",
        "next_step_s", "spike_s", "lead_s", "static_rollout_pages", "rate", "runs", "modes", "device",
        "dtype")}
    report = {"window": dataclasses.asdict(window), **reports[0]} if args.runs == 1 else {
        "window": dataclasses.asdict(window), "runs": reports}
    write_report(args.json, summary, config=config, **report)
    return 0
