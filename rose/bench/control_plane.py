"""`rose bench control-plane`: what the driver's rollout manager costs per turn and per token,
and how many tokens one driver core can route, against fake devices in other processes.

The driver is this process: the real `RolloutManager`, `WorkerRegistry` and routing, and a
transport, `stream` (`LeaseStream`: one WebSocket per device, every turn multiplexed on it) or
`http` (`LeaseClient`: one HTTP request per turn, its tokens streamed as server-sent events,
the lease API's simplest form). The devices are real lease servers around a fake engine
(`rose.bench.fake_devices`) in `--device-processes` processes on the other cores: each gives
its running turns one token per `--iteration-ms` (Table 1's 117.8 ms TPOT by default), at most
`--per-device` of them (the paper's 16 trajectories per GPU). Each trajectory plays `--turns`
turns of `--turn-tokens` tokens, its prompt growing by each reply and an observation.

Each point reports the driver's CPU (`time.process_time`, this process alone) per turn and per
token, tokens per driver CPU-second (what one core sustains), the delay from a token's
making to the manager (P50, P99, over every fourth device's chunks, each timed by its oldest
token: each token's logprob carries when it was made), attempts
resumed away from their device (none is dead, so any is a false alarm), and, with
`--profile`, where the driver's time goes. The sweep: dedicated and serving devices alone from
256 to 4,096 trajectories; the paper's 8B deployment (64 serving + 48 dedicated devices, 1,024
trajectories) on both transports, measured one after the other in this run; and past it
(1,000 devices, 16,000 trajectories) without `--quick`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import cProfile
import dataclasses
import multiprocessing as mp
import os
import pstats
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from rose.contracts import SamplingParams, Turn, TurnOutput, Worker, WorkerKind
from rose.coserve.lease_client import LeaseClient
from rose.coserve.lease_stream import LeaseStream
from rose.progress import bar
from rose.reporting import write_report
from rose.rl import Trajectory, TurnRecord
from rose.rollout.agent import TurnHandle
from rose.rollout.manager import RolloutManager, settle_heap
from rose.rollout.registry import WorkerRegistry
from rose.rollout.routing import compile_kernels

KEY = "bench-control-plane"
# Tokens a second the fake devices keep up with on this machine's one other core (at 4,096
# trajectories of Table 1's 117.8 ms, 35,000 a second, they fell seconds behind, and the driver
# took their silence for death).
FAKE_TOKENS_PER_S = 10_000
OBSERVATION_TOKENS = 16  # what the "environment" adds to the prompt after each reply


@dataclasses.dataclass(frozen=True)
class Point:
    name: str
    dedicated: int  # devices
    serving: int
    trajectories: int
    transport: str = "stream"
    shards: int = 1  # control planes, each in a process of its own, each owning 1/shards of the devices
    turn_scale: int = 1  # x --turn-tokens: longer turns, with as many tokens fewer turns per second

    def iteration_s(self, args: argparse.Namespace) -> float:
        """The fake devices' iteration: `--iteration-ms`, or longer where the point's tokens would
        be more than `FAKE_TOKENS_PER_S` (what the fakes' one core keeps up with): the driver's
        cost per token and per turn does not depend on how fast tokens come."""
        return max(args.iteration_ms / 1e3, self.trajectories / FAKE_TOKENS_PER_S)


def sweep(quick: bool) -> list[Point]:
    sizes = (256, 1024) if quick else (256, 1024, 4096)
    points = [Point(f"{kind}-{n}", n // 16 * (kind == "dedicated"), n // 16 * (kind == "serving"), n)
              for kind in ("dedicated", "serving") for n in sizes]
    points += [Point("paper-8b-http", 48, 64, 1024, "http"), Point("paper-8b", 48, 64, 1024),
               Point("paper-8b-long-turns", 48, 64, 1024, turn_scale=3)]
    # k shards, each owning a quarter of the paper's deployment: the load grows with the shards, as
    # capacity should (the fakes of 8 whole deployments are more than the other core can run).
    points += [Point(f"shards-{k}", 12 * k, 16 * k, 256 * k, shards=k) for k in ((1, 2, 4) if quick
                                                                               else (1, 2, 4, 8))]
    if not quick:
        points.append(Point("fleet-16k", 400, 600, 16_000))
    return points


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="up to 1,024 trajectories (the paper's point too)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--iteration-ms", type=float, default=117.8, help="a fake device's iteration (its TPOT)")
    p.add_argument("--per-device", type=int, default=16, help="turns a device runs at once")
    p.add_argument("--turns", type=int, default=2, help="turns per trajectory")
    p.add_argument("--turn-tokens", type=int, default=40, help="tokens per turn, on average")
    p.add_argument("--prompt-tokens", type=int, default=256, help="a trajectory's first prompt")
    p.add_argument("--device-processes", type=int, default=4, help="processes serving the fake devices")
    p.add_argument("--points", help="comma-separated names of the sweep's points to run (default: all)")
    p.add_argument("--profile", action="store_true", help="profile the driver at the paper's point")


class _Stamped(TurnOutput):
    """A turn's output that records, as each chunk arrives, how long ago its oldest token was
    made (the fake engine's logprob is minus the second it was made): each token's delay, or
    more where a chunk holds several."""

    def __init__(self, target: TurnOutput, delays: list[float]) -> None:
        super().__init__()
        self.target, self.delays = target, delays

    def add(self, token_ids: list[int], logprobs: list[float], versions: list[int], finish_reason: str | None,
            top_logprobs: list[list[tuple[int, float]]]) -> TurnOutput:
        if logprobs:
            self.delays.append(time.time() + logprobs[0])
        return self.target.add(token_ids, logprobs, versions, finish_reason, top_logprobs)


class _Timed:
    """A worker whose turns' tokens are timed on arrival; everything else is the worker's."""

    def __init__(self, worker: Worker, delays: list[float]) -> None:
        self._worker, self._delays = worker, delays

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)

    async def run_turn(self, turn: Turn, output: TurnOutput) -> TurnOutput:
        await self._worker.run_turn(turn, _Stamped(output, self._delays))
        return output


def _agent(turns: int, turn_tokens: int, prompt_tokens: int) -> Any:
    """Each trajectory's turns: replies of 0.5x to 1.5x `turn_tokens` (spread by its seed), so
    that turns end at their own times, as an agent's replies do."""

    async def play(handle: TurnHandle, seed: int) -> Trajectory:
        trajectory = Trajectory(group_id=seed)
        prompt = [1 + (seed + i) % 1000 for i in range(prompt_tokens)]
        for k in range(turns):
            length = turn_tokens // 2 + (seed * 7919 + k * 104729) % (turn_tokens + 1)
            out = await handle.generate(prompt, length)
            trajectory.turns.append(TurnRecord(prompt, out.token_ids, out.logprobs, out.versions))
            prompt = prompt + out.token_ids + [7] * OBSERVATION_TOKENS
        return trajectory

    return play


@contextlib.contextmanager
def fake_devices(count: int, processes: int, iteration_s: float, cap: int) -> Iterator[list[str]]:
    """`count` fake devices in `processes` processes, pinned off this process's core where
    there are others; their URLs."""
    others = sorted(os.sched_getaffinity(0))[1:]
    shares = [count // processes + (i < count % processes) for i in range(processes)]
    procs, urls = [], []
    try:
        for n in shares:
            serve = [sys.executable, "-m", "rose.bench.fake_devices", str(n), str(iteration_s), str(cap), KEY]
            procs.append(subprocess.Popen(serve, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            if others:
                os.sched_setaffinity(procs[-1].pid, others)
        for proc, n in zip(procs, shares, strict=True):
            assert proc.stdout is not None
            for _ in range(n):
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"a fake-device process exited with {proc.wait()}")
                urls.append(line.strip())
        yield urls
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@dataclasses.dataclass
class _Run:
    """What one control plane (one shard) measured."""

    cpu_s: float
    wall_s: float
    attempts: int
    tokens: int
    frames: int
    finished: int
    lost: int
    resumed: dict[str, int]  # attempts that did not finish, by why (rose.rollout.manager.Placement)
    delays_s: list[float]


async def _play(point: Point, urls: list[str], args: argparse.Namespace, seeds: list[int],
                profile: cProfile.Profile | None = None) -> _Run:
    """Play the trajectories of `seeds` on the point's devices (`urls`: the dedicated ones first)
    with one rollout manager, this process's CPU measured."""
    delays: list[float] = []
    registry = WorkerRegistry()
    kinds = [WorkerKind.DEDICATED] * point.dedicated + [WorkerKind.SERVING] * point.serving
    clients: list[LeaseClient] = []
    for i, (url, kind) in enumerate(zip(urls, kinds, strict=True)):
        make = LeaseStream if point.transport == "stream" else LeaseClient
        client = make(url, key=KEY, worker_id=f"{kind.value}-{i}", max_concurrency=args.per_device)
        client.kind = kind
        clients.append(client)
        # Every fourth device's tokens are timed: the timing costs the driver too.
        registry.add(_Timed(client, delays) if i % 4 == 0 else client)  # type: ignore[arg-type]
    await asyncio.gather(*(c.heartbeat() for c in clients))  # every device reached before the clock starts
    turn_tokens = args.turn_tokens * point.turn_scale
    manager = RolloutManager(registry, SamplingParams(max_tokens=turn_tokens, ignore_eos=True))
    compile_kernels()  # as `rose train`'s driver does once started
    settle_heap()
    agent = _agent(args.turns, turn_tokens, args.prompt_tokens)
    cpu, wall = time.process_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    report = await manager.run(seeds, 0, prefix="b", agent=agent)
    if profile is not None:
        profile.disable()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    frames = sum(getattr(c, "frames", 0) for c in clients)
    for client in clients:
        await client.close()
    return _Run(cpu, wall, len(report.placements), sum(t.num_generated_tokens for t in report.trajectories),
                frames, len(report.trajectories), report.lost_trajectories + report.failed_trajectories,
                dict(collections.Counter(p.outcome for p in report.placements if p.outcome != "done")),
                delays)


def _shard(point: Point, urls: list[str], args: argparse.Namespace, seeds: list[int]) -> _Run:
    """One shard in a process of its own: a short warm-up (imports, compiled kernels), then its part."""
    asyncio.run(_play(point, urls, args, seeds[:8]))
    return asyncio.run(_play(point, urls, args, seeds))


def _part(point: Point, urls: list[str], k: int) -> tuple[Point, list[str], list[int]]:
    """Shard k's part of the point: every `shards`-th device of each kind and trajectory. A shard
    owns its devices, so that each device's frames go to one shard, whole (a device shared by k
    shards would send k frames an interval, each with a k-th of its tokens)."""
    n = point.shards
    dedicated, serving = urls[:point.dedicated][k::n], urls[point.dedicated:][k::n]
    seeds = list(range(point.trajectories))[k::n]
    part = dataclasses.replace(point, dedicated=len(dedicated), serving=len(serving), trajectories=len(seeds),
                               shards=1)
    return part, dedicated + serving, seeds


def _measure(point: Point, urls: list[str], args: argparse.Namespace,
             profile: cProfile.Profile | None) -> dict[str, Any]:
    urls = urls[:point.dedicated] + urls[point.dedicated:point.dedicated + point.serving]
    if point.shards == 1:
        runs = [asyncio.run(_play(point, urls, args, list(range(point.trajectories)), profile))]
    else:
        parts = [_part(point, urls, k) for k in range(point.shards)]
        with concurrent.futures.ProcessPoolExecutor(point.shards, mp_context=mp.get_context("spawn")) as pool:
            points, device_urls, seeds = zip(*parts, strict=True)
            runs = list(pool.map(_shard, points, device_urls, [args] * point.shards, seeds))
    cpu, wall = sum(r.cpu_s for r in runs), max(r.wall_s for r in runs)
    attempts, tokens = sum(r.attempts for r in runs), sum(r.tokens for r in runs)
    # Shards that share one core wait for each other: their delays say nothing of the control plane's.
    lag = np.array(runs[0].delays_s if point.shards == 1 else []) * 1e3
    return {
        "transport": point.transport, "shards": point.shards, "dedicated": point.dedicated,
        "serving": point.serving, "trajectories": point.trajectories,
        "finished": sum(r.finished for r in runs),
        "lost": sum(r.lost for r in runs), "attempts": attempts,
        "resumed": sum(n for r in runs for n in r.resumed.values()),
        "resumed_by": dict(sum((collections.Counter(r.resumed) for r in runs), collections.Counter())),
        "tokens": tokens, "frames": sum(r.frames for r in runs), "wall_s": round(wall, 2),
        "iteration_ms": round(point.iteration_s(args) * 1e3, 1),
        "turns_wall_s": round(args.turns * args.turn_tokens * point.turn_scale * point.iteration_s(args), 2),
        "driver_cpu_s": round(cpu, 3), "driver_core_share": round(cpu / wall, 3),
        "cpu_per_turn_us": round(cpu / max(attempts, 1) * 1e6, 1),
        "cpu_per_token_us": round(cpu / max(tokens, 1) * 1e6, 2),
        "tokens_per_driver_cpu_s": round(tokens / cpu),
        "tokens_per_s": round(tokens / wall),
        "delay_p50_ms": round(float(np.percentile(lag, 50)), 1) if len(lag) else None,
        "delay_p99_ms": round(float(np.percentile(lag, 99)), 1) if len(lag) else None,
    }


def _where(profile: cProfile.Profile) -> dict[str, float]:
    """The profiled driver's own CPU time (tottime) by where its code lives, as shares."""
    buckets = {"transport (rose.coserve)": ("rose/coserve",), "websockets": ("websockets",),
               "httpx/httpcore/h11": ("httpx", "httpcore", "h11"), "json/pydantic": ("json", "pydantic"),
               "manager (rose.rollout.manager)": ("rose/rollout/manager",),
               "routing (rose.rollout.routing/registry)": ("rose/rollout/routing", "rose/rollout/registry"),
               "agent and turn handle": ("rose/bench/control_plane", "rose/rollout/agent", "rose/rl"),
               "event loop (asyncio)": ("asyncio",), "numpy": ("numpy",)}
    stats = pstats.Stats(profile)
    totals: dict[str, float] = dict.fromkeys([*buckets, "other"], 0.0)
    for (path, _, _), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        bucket = next((b for b, keys in buckets.items() if any(k in path for k in keys)), "other")
        totals[bucket] += tottime
    whole = sum(totals.values()) or 1.0
    return {b: round(t / whole, 3) for b, t in sorted(totals.items(), key=lambda kv: -kv[1]) if t}


def run(args: argparse.Namespace) -> int:
    points = sweep(args.quick)
    if args.points:
        wanted = {p.strip() for p in args.points.split(",")}
        unknown = wanted - {p.name for p in points}
        if unknown:
            raise ValueError(f"--points: {', '.join(sorted(unknown))}; expected some of "
                             f"{', '.join(p.name for p in points)}")
        points = [p for p in points if p.name in wanted]
    counts = (args.per_device, args.turns, args.turn_tokens - 1, args.device_processes)
    if args.iteration_ms <= 0 or min(counts) < 1:
        raise ValueError("--iteration-ms must be > 0, --turn-tokens >= 2, and --per-device, --turns and "
                         "--device-processes >= 1")
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])  # the driver: one core
    results: dict[str, dict[str, Any]] = {}
    profile = cProfile.Profile(time.process_time) if args.profile else None
    with bar("bench control-plane", len(points)) as progress:
        for iteration_s in sorted({p.iteration_s(args) for p in points}):  # a set of fakes each
            group = [p for p in points if p.iteration_s(args) == iteration_s]
            devices = max(p.dedicated + p.serving for p in group)
            with fake_devices(devices, args.device_processes, iteration_s, args.per_device) as urls:
                for transport in sorted({p.transport for p in group}):  # first connections, imports, schemas
                    _measure(Point("warm-up", 4, 4, 128, transport), urls, args, None)
                for point in group:
                    progress.describe(point.name)
                    watched = profile if point.name == "paper-8b" else None
                    results[point.name] = _measure(point, urls, args, watched)
                    print(point.name, results[point.name], flush=True)
                    progress.advance()
    summary = _summary(results)
    details: dict[str, Any] = {"points": results, "settings": {
        k: getattr(args, k) for k in ("iteration_ms", "per_device", "turns", "turn_tokens", "prompt_tokens")}}
    if profile is not None:
        details["driver_time_paper_8b"] = _where(profile)
    write_report(args.json, summary, **details)
    return 0


def _summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    paper, http = results.get("paper-8b"), results.get("paper-8b-http")
    if paper is not None:
        summary.update({f"paper_8b_{k}": paper[k] for k in (
            "driver_core_share", "cpu_per_turn_us", "cpu_per_token_us", "tokens_per_driver_cpu_s",
            "delay_p50_ms", "delay_p99_ms", "resumed", "lost", "wall_s", "turns_wall_s")})
    if http is not None:
        summary.update({f"paper_8b_http_{k}": http[k] for k in (
            "driver_core_share", "cpu_per_turn_us", "tokens_per_driver_cpu_s", "delay_p99_ms", "resumed",
            "wall_s")})
    if paper is not None and http is not None:
        summary["tokens_per_cpu_s_stream_vs_http"] = round(
            paper["tokens_per_driver_cpu_s"] / http["tokens_per_driver_cpu_s"], 2)
    fit = _costs(results)
    if fit is not None:
        summary.update(fit)
    for kind in ("dedicated", "serving"):
        per_turn = [r["cpu_per_turn_us"] for n, r in results.items() if n.startswith(kind)]
        if len(per_turn) > 1:
            summary[f"{kind}_cpu_per_turn_max_over_min"] = round(max(per_turn) / min(per_turn), 3)
    return summary


def _costs(results: dict[str, dict[str, Any]]) -> dict[str, float] | None:
    """The stream's driver CPU as a cost per turn attempt, per token (a turn's chunk of a frame,
    one token at these rates) and per frame: least squares over the one-shard points (the
    simulator's control-plane model, `rose.sim.costs.STREAM`)."""
    rows = [r for r in results.values() if r["transport"] == "stream" and r["shards"] == 1]
    if len(rows) < 3:
        return None
    counts = np.array([[r["attempts"], r["tokens"], r["frames"]] for r in rows], float)
    cpu = np.array([r["driver_cpu_s"] for r in rows])
    (turn, token, frame), *_ = np.linalg.lstsq(counts, cpu, rcond=None)
    return {"fit_cpu_per_turn_us": round(turn * 1e6, 1), "fit_cpu_per_chunk_us": round(token * 1e6, 2),
            "fit_cpu_per_frame_us": round(frame * 1e6, 1)}
