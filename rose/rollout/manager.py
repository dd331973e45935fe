"""The rollout manager: plays environment episodes turn by turn across workers.

Each episode is one trajectory; each of its turns is routed on its own by the routing policy
(`RoutingTable`): cache affinity, then the least-loaded dedicated worker, then a serving
executor with SLO room, else the FIFO queue. Each finished attempt's tokens over its time is
its worker's measured decode rate, which decides when a served trajectory moves back to a
dedicated worker. A turn runs as one or more *attempts*: when an executor hands it back (an
emergency cut, finish reason "abort"), when `rebalance` moves it from a serving executor to a
dedicated worker, or when its worker dies (a failed call, or silence past the stall timeout),
the tokens it already produced join its prompt and the rest of it is routed again (`resume`):
nothing is regenerated and no trajectory is lost. Every attempt's placement is recorded, so a
report can say where the turns ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import zlib
from collections.abc import Sequence

from rose.engine import SamplingParams
from rose.rl import Episode, Trajectory
from rose.rollout.registry import WorkerRegistry
from rose.rollout.routing import Route, RoutingTable, TurnRequest, WorkerKind, resume
from rose.rollout.workers import TurnResult, extend


@dataclasses.dataclass(frozen=True)
class Placement:
    """One attempt of one turn on one worker."""

    trajectory_id: str
    turn: int
    attempt: int
    worker_id: str
    kind: str  # "dedicated" or "serving"
    start_s: float  # since the rollout started
    end_s: float
    tokens: int
    outcome: str  # "done", "abort" (handed back or moved) or "lost" (worker died)


@dataclasses.dataclass
class RolloutReport:
    trajectories: list[Trajectory]
    placements: list[Placement]
    seconds: float
    lost_trajectories: int  # episodes that could not finish (no worker left before the deadline)

    def tokens_on(self, kind: WorkerKind) -> int:
        return sum(p.tokens for p in self.placements if p.kind == kind.value)

    @property
    def serving_fraction(self) -> float:
        """Share of the generated tokens that serving executors produced."""
        total = sum(p.tokens for p in self.placements)
        return self.tokens_on(WorkerKind.SERVING) / total if total else 0.0

    @property
    def resumed_turns(self) -> int:
        return sum(p.outcome != "done" for p in self.placements)

    @property
    def success_rate(self) -> float:
        return sum(t.success for t in self.trajectories) / max(len(self.trajectories), 1)


@dataclasses.dataclass
class _Turn:
    """A turn in progress: its routing request, its prompt and what its attempts produced."""

    request: TurnRequest
    prompt: list[int]
    done: asyncio.Future[TurnResult]
    out: TurnResult = dataclasses.field(default_factory=TurnResult)
    task: asyncio.Task[None] | None = None
    move_to: str | None = None  # a rebalance move in progress
    lost: bool = False  # its worker was reaped: the cancellation is ours


class RolloutManager:
    def __init__(self, registry: WorkerRegistry, params: SamplingParams, *, rebalance: bool = True,
                 tick_s: float = 0.25, seed: int = 0) -> None:
        """`params`: sampling for every turn (`max_tokens` is a turn's budget; the stop ids end a
        turn early). Each attempt gets its own seed, drawn from `seed` and the turn."""
        self.registry, self.params = registry, params
        self.rebalance, self.tick_s, self.seed = rebalance, tick_s, seed
        self._turns: dict[str, _Turn] = {}
        self._placements: list[Placement] = []
        self._aborts: set[asyncio.Task[None]] = set()  # rebalance aborts in flight
        self._t0 = 0.0

    @property
    def table(self) -> RoutingTable:
        return self.registry.table

    async def run(self, episodes: Sequence[Episode], policy_version: int, prefix: str = "t",
                  timeout_s: float | None = None) -> RolloutReport:
        """Play every episode to its end; turns need workers on at least `policy_version`.
        Trajectory ids are `prefix` + index (unique among the runs a worker sees)."""
        self._placements, self._t0 = [], time.perf_counter()
        ticker = asyncio.create_task(self._tick())
        plays = [asyncio.create_task(self._play(f"{prefix}{i}", e, policy_version))
                 for i, e in enumerate(episodes)]
        try:
            await asyncio.wait(plays, timeout=timeout_s)
        finally:
            ticker.cancel()
            for task in plays:
                task.cancel()
            await asyncio.gather(*plays, ticker, return_exceptions=True)
            for t in list(self._turns.values()):
                if t.task is not None:
                    t.task.cancel()
        kept = [e.trajectory for e, p in zip(episodes, plays, strict=True) if e.done and not p.cancelled()]
        return RolloutReport(kept, self._placements, self._elapsed(), len(episodes) - len(kept))

    # -- one episode, one turn -----------------------------------------------------------------

    async def _play(self, tid: str, episode: Episode, version: int) -> None:
        k = 0
        try:
            while not episode.done:
                out = await self._turn(TurnRequest(tid, k, len(episode.prompt_ids), self.params.max_tokens,
                                                   version), episode.prompt_ids)
                episode.record(out.token_ids, out.logprobs, out.versions)
                k += 1
        finally:
            self.table.finish_trajectory(tid)

    async def _turn(self, request: TurnRequest, prompt: list[int]) -> TurnResult:
        t = _Turn(request, prompt, asyncio.get_running_loop().create_future())
        self._turns[request.trajectory_id] = t
        try:
            self._dispatch(t, self.table.route(request, self._now()))
            return await t.done
        finally:
            del self._turns[request.trajectory_id]
            if t.task is not None and not t.task.done():
                t.task.cancel()

    def _dispatch(self, t: _Turn, route: Route) -> None:
        """Start an attempt where the table placed the turn; a queued turn waits for `_drain`."""
        if route.worker_id is not None:
            t.move_to = None
            t.task = asyncio.create_task(self._attempt(t, route.worker_id, t.request))

    async def _attempt(self, t: _Turn, wid: str, req: TurnRequest) -> None:
        worker = self.registry.workers[wid]
        got, start, outcome = TurnResult(), self._elapsed(), "done"
        seed = zlib.crc32(f"{self.seed}:{req.trajectory_id}:{req.turn}:{req.attempt}".encode())
        params = dataclasses.replace(self.params, max_tokens=req.max_tokens, seed=seed)
        turn_id = f"{req.trajectory_id}:{req.turn}:{req.attempt}"
        try:
            await worker.run_turn(turn_id, req.trajectory_id, t.prompt + t.out.token_ids, params,
                                  req.policy_version, got)
            outcome = "abort" if got.finish_reason == "abort" else "done"
        except asyncio.CancelledError:
            if not t.lost:
                raise
            outcome = "lost"
        except Exception:  # any failure of the call: the worker is presumed dead
            outcome = "lost"
            self.registry.suspect(wid)
        extend(t.out, got)
        end, produced = self._elapsed(), len(got.token_ids)
        self._placements.append(Placement(req.trajectory_id, req.turn, req.attempt, wid, worker.kind.value,
                                          start, end, produced, outcome))
        in_flight = req.trajectory_id in self.table.in_flight.get(wid, {})
        if produced and wid in self.table.workers:
            self.table.measure(wid, produced / max(end - start, 1e-6))
        stopped = bool(got.token_ids) and got.token_ids[-1] in self.params.stop_token_ids
        if outcome == "done" or produced == req.max_tokens or stopped:
            if in_flight:
                self.table.complete(wid, req.trajectory_id)
            if outcome != "done":
                t.out.finish_reason = "stop" if stopped else "length"
            t.done.set_result(t.out)
        else:
            t.lost, t.request = False, resume(req, produced)
            now = self._now()
            if outcome == "abort" and in_flight and t.move_to in self.table.workers:
                route = self.table.move(req.trajectory_id, wid, t.move_to, produced)
            elif outcome == "abort" and in_flight:
                route = self.table.abort(wid, req.trajectory_id, produced, now)
            else:
                if in_flight:
                    self.table.complete(wid, req.trajectory_id)
                route = self.table.route(t.request, now)
            self._dispatch(t, route)
        self._drain()

    # -- the periodic half: heartbeats, dead workers, queued turns, rebalancing ------------------

    async def _tick(self) -> None:
        while True:
            await self.registry.poll()
            for turn in self.registry.reap():
                t = self._turns.get(turn.trajectory_id)
                if t is not None and t.task is not None and not t.task.done():
                    t.lost = True
                    t.task.cancel()
            self._drain()
            if self.rebalance:
                for turn, src, dst in self.table.rebalance(self._now()):
                    t = self._turns.get(turn.trajectory_id)
                    if t is not None and t.move_to is None:
                        t.move_to = dst
                        self._aborts.add(asyncio.create_task(self.registry.workers[src].abort(
                            f"{turn.trajectory_id}:{turn.turn}:{turn.attempt}")))
                        self._aborts = {a for a in self._aborts if not a.done()}
            await asyncio.sleep(self.tick_s)

    def _drain(self) -> None:
        for turn, route in self.table.drain(self._now()):
            t = self._turns[turn.trajectory_id]
            t.request = turn
            self._dispatch(t, route)

    def _now(self) -> float:
        """The routing table's clock."""
        return self.registry.clock()

    def _elapsed(self) -> float:
        return time.perf_counter() - self._t0
