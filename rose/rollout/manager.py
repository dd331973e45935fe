"""The rollout manager: plays agents' tasks (environment episodes) turn by turn across workers.

Each task is one trajectory, played by an agent (rose.rollout.agent: `play_episode` by default)
whose `TurnHandle.generate` calls come here; each turn is routed on its own by the routing policy
(`RoutingTable`): cache affinity, then the least-loaded dedicated worker, then a serving
executor with SLO room, else the FIFO queue. Each finished attempt's tokens over its time is
its worker's measured decode rate, which decides when a served trajectory moves back to a
dedicated worker. A turn runs as one or more *attempts*: when an executor hands it back (an
emergency cut, finish reason "abort"), when `rebalance` moves it from a serving executor to a
dedicated worker, or when its worker dies (a failed call, or silence past the stall timeout),
the tokens it already produced join its prompt and the rest of it is routed again (`resume`):
nothing is regenerated and no trajectory is lost. A turn refused for what it is (a 4xx from an
executor, a dedicated worker's ValueError: a bad sampling parameter, a prompt past the context)
is the turn's failure, not its worker's: it is routed again (without its affinity) at most
`turn_retries` times, then its trajectory is reported failed with the reason (as is one whose
environment raised); the worker keeps its standing, as does an executor that turns a turn away
for lack of room (429: the turn is routed again). Only transport and liveness failures make a
worker suspect. A step that times out reports its unfinished trajectories as lost, each with
where it stood. Every attempt's placement is recorded, so a report can say where the turns ran;
every exit path (done, failed, timed out, cancelled) takes the trajectory out of the routing
table, so the next step finds its workers' slots free.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import time
import zlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from rose.contracts import SamplingParams, Turn, TurnOutput, WorkerKind
from rose.rl import Trajectory
from rose.rollout.agent import Agent, Task, TurnHandle, play_episode
from rose.rollout.registry import WorkerRegistry
from rose.rollout.routing import Route, RoutedTurn, RoutingTable, resume
from rose.rollout.workers import Failure, classify


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
    # "done", "abort" (handed back by its executor), "moved" (taken off for a faster worker),
    # "lost" (worker died), "rejected" (the turn was refused for what it is) or "busy" (the
    # worker had no room)
    outcome: str


@dataclasses.dataclass(frozen=True)
class Unfinished:
    """A trajectory that did not finish: how many turns its agent had generated, and why it stopped."""

    trajectory_id: str
    turns: int
    reason: str


@dataclasses.dataclass
class RolloutReport:
    trajectories: list[Trajectory]  # the finished ones, for training
    placements: list[Placement]
    seconds: float
    failed: list[Unfinished] = dataclasses.field(default_factory=list)  # refused turn, environment error
    lost: list[Unfinished] = dataclasses.field(default_factory=list)  # unfinished at the deadline

    def extend(self, later: RolloutReport, keep: Callable[[Trajectory], bool]) -> RolloutReport:
        """This report followed by `later` (a run right after it, its times shifted to follow),
        with those of `later`'s finished trajectories that `keep` passes."""
        shifted = [dataclasses.replace(p, start_s=p.start_s + self.seconds, end_s=p.end_s + self.seconds)
                   for p in later.placements]
        return RolloutReport(self.trajectories + [t for t in later.trajectories if keep(t)],
                             self.placements + shifted, self.seconds + later.seconds,
                             self.failed + later.failed, self.lost + later.lost)

    @property
    def failed_trajectories(self) -> int:
        return len(self.failed)

    @property
    def lost_trajectories(self) -> int:
        """Episodes that could not finish before the deadline (no worker left, or too slow)."""
        return len(self.lost)

    def tokens_on(self, kind: WorkerKind) -> int:
        return sum(p.tokens for p in self.placements if p.kind == kind.value)

    def turns_on(self, kind: WorkerKind) -> int:
        """Turns that finished on workers of `kind`."""
        return sum(p.kind == kind.value and p.outcome == "done" for p in self.placements)

    @property
    def serving_token_share(self) -> float:
        """Share of the generated tokens that serving executors produced."""
        total = sum(p.tokens for p in self.placements)
        return self.tokens_on(WorkerKind.SERVING) / total if total else 0.0

    @property
    def resumed_turns(self) -> int:
        return sum(p.outcome != "done" for p in self.placements)

    @property
    def handed_back_turns(self) -> int:
        """Attempts a serving executor handed back (an emergency cut), resumed elsewhere."""
        return sum(p.kind == WorkerKind.SERVING.value and p.outcome == "abort" for p in self.placements)

    @property
    def success_rate(self) -> float:
        return sum(t.success for t in self.trajectories) / max(len(self.trajectories), 1)


@dataclasses.dataclass(frozen=True)
class Play:
    """One task being played: `task` resolves to its Trajectory or the reason it failed; `turns`,
    the turns its agent has generated so far."""

    task: asyncio.Task[Trajectory | str]
    handle: TurnHandle

    @property
    def turns(self) -> int:
        return self.handle.turns


@dataclasses.dataclass
class _Turn:
    """A turn in progress: its routing request, its prompt and what its attempts produced."""

    request: RoutedTurn
    prompt: list[int]
    done: asyncio.Future[TurnOutput]
    out: TurnOutput = dataclasses.field(default_factory=TurnOutput)
    task: asyncio.Task[None] | None = None
    move_to: str | None = None  # a rebalance move in progress
    lost: bool = False  # its worker was reaped: the cancellation is ours
    rejections: int = 0


# Young collections every this many allocations, not CPython's 700: a rollout allocates a few
# objects a token, and each collection's pass grows with the trajectories in flight.
GC_THRESHOLDS = (50_000, 20, 10)


def settle_heap() -> None:
    """Tune the driver's garbage collector, once it has started: collect, then freeze what
    survives (modules, configs, the tokenizer) out of the collector's sight, so that a full
    collection scans only what rollouts made (with 370,000 such objects, one took 0.3 s of the
    driver and held every token behind it at 1,024 trajectories: `rose bench control-plane`),
    and collect the young less often (`GC_THRESHOLDS`)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class TurnFailed(Exception):
    """A turn refused every time it was tried: its trajectory cannot go on."""


class RolloutManager:
    def __init__(self, registry: WorkerRegistry, params: SamplingParams, *, rebalance: bool = True,
                 tick_s: float = 0.25, seed: int = 0, turn_retries: int = 2,
                 adapter: str | None = None) -> None:
        """`params`: sampling for every turn (`max_tokens` is a turn's budget; the stop ids end a
        turn early). Each attempt gets its own seed, drawn from `seed` and the turn. A turn
        refused for what it is is tried again at most `turn_retries` times. `adapter`: the LoRA
        adapter every turn runs with (the policy, when it is one), or None."""
        if turn_retries < 0:
            raise ValueError(f"turn_retries must be >= 0, got {turn_retries}")
        self.registry, self.params = registry, params
        self.rebalance, self.tick_s, self.seed = rebalance, tick_s, seed
        self.turn_retries, self.adapter = turn_retries, adapter
        self._turns: dict[str, _Turn] = {}
        self._placements: list[Placement] = []
        self._tasks: set[asyncio.Task[None]] = set()  # attempts and rebalance aborts in flight
        self._t0 = time.perf_counter()  # `run` starts its own clock; a stream uses this one

    @property
    def table(self) -> RoutingTable:
        return self.registry.table

    async def run(self, tasks: Sequence[Task], policy_version: int, prefix: str = "t",
                  timeout_s: float | None = None, agent: Agent[Task] = play_episode) -> RolloutReport:
        """Play every task (an `Episode` for the default agent) to its end with `agent`; turns
        need workers on at least `policy_version`. Trajectory ids are `prefix` + index (unique
        among the runs a worker sees)."""
        self._placements, self._t0 = [], time.perf_counter()
        ids = [f"{prefix}{i}" for i in range(len(tasks))]
        ticker = asyncio.create_task(self._tick())
        plays = [self.play(tid, task, policy_version, agent) for tid, task in zip(ids, tasks, strict=True)]
        late: dict[str, str] = {}
        try:
            _, pending = await asyncio.wait([p.task for p in plays], timeout=timeout_s)
            late = {tid: f"unfinished at the {timeout_s} s timeout: {self._whereabouts(tid)}"
                    for tid, p in zip(ids, plays, strict=True) if p.task in pending}
        finally:
            await self.stop([ticker, *(p.task for p in plays)])
        report = RolloutReport([], self._placements, self.elapsed())
        for tid, play in zip(ids, plays, strict=True):
            if tid in late:
                report.lost.append(Unfinished(tid, play.turns, late[tid]))
            elif isinstance(got := play.task.result(), str):
                report.failed.append(Unfinished(tid, play.turns, got))
            else:
                report.trajectories.append(got)
        return report

    def play(self, tid: str, task: Task, policy_version: int, agent: Agent[Task] = play_episode,
             priority: int = 0) -> Play:
        """Start playing one task as trajectory `tid` (its turns need workers on at least
        `policy_version`; queued, they start before those of a higher `priority`): a task resolving
        to its Trajectory or the reason it failed. The caller runs the manager's `tick` meanwhile
        and `stop`s what it started."""
        handle = TurnHandle(functools.partial(self._agent_turn, tid, policy_version, priority),
                            self.params.max_tokens)
        play = asyncio.create_task(self._play(tid, task, agent, handle))
        return Play(play, handle)

    def take_placements(self, origin_s: float) -> list[Placement]:
        """The attempts that ended since the last call, their times counted from `origin_s`
        (seconds since the manager started); a stream's steps report them, and the manager
        keeps no more of them."""
        taken, self._placements = self._placements, []
        return [dataclasses.replace(p, start_s=p.start_s - origin_s, end_s=p.end_s - origin_s) for p in taken]

    def tick(self) -> asyncio.Task[None]:
        """The periodic half (heartbeats, dead workers, queued turns, rebalancing), as a task."""
        return asyncio.create_task(self._tick())

    async def stop(self, tasks: Sequence[asyncio.Future[Any]]) -> None:
        """Cancel `tasks` (plays, the ticker) and wait for them all: each play takes its
        trajectory out of the routing table, and no call to a worker outlives them."""
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while self._tasks:
            left = list(self._tasks)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
            self._tasks.difference_update(left)

    def _whereabouts(self, tid: str) -> str:
        """Where a trajectory's current turn stands, for a timeout's report."""
        t = self._turns.get(tid)
        if t is None:
            return "between two turns"
        req = t.request
        wid = next((w for w, turns in self.table.in_flight.items() if tid in turns), None)
        if wid is None:
            return f"turn {req.turn} (attempt {req.attempt}) queued: no eligible worker had room"
        return f"turn {req.turn} (attempt {req.attempt}) running on {wid}"

    # -- one trajectory, one turn ---------------------------------------------------------------

    async def _play(self, tid: str, task: Task, agent: Agent[Task], handle: TurnHandle) -> Trajectory | str:
        """The agent's trajectory of the task, or the reason it failed."""
        try:
            trajectory = await agent(handle, task)
        except TurnFailed as exc:
            return str(exc)
        except Exception as exc:  # the agent's or the environment's error: this trajectory's, not the step's
            return f"{type(exc).__name__}: {exc}"
        finally:
            self.table.cancel(tid)
        if not isinstance(trajectory, Trajectory):
            return f"the agent returned {type(trajectory).__name__}, not a Trajectory"
        return trajectory

    async def _agent_turn(self, tid: str, version: int, priority: int, k: int, prompt: list[int],
                          max_tokens: int) -> TurnOutput:
        request = RoutedTurn(tid, k, len(prompt), max_tokens, version, priority=priority)
        return await self._turn(request, prompt)

    async def _turn(self, request: RoutedTurn, prompt: list[int]) -> TurnOutput:
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
            t.task = self._spawn(self._attempt(t, route.worker_id, t.request))

    def _spawn(self, call: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(call)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _attempt(self, t: _Turn, wid: str, req: RoutedTurn) -> None:
        got, start = TurnOutput(), self.elapsed()
        turn_id = req.attempt_id
        params = dataclasses.replace(self.params, max_tokens=req.max_tokens,
                                     seed=zlib.crc32(f"{self.seed}:{turn_id}".encode()))
        worker = self.registry.workers[wid]
        error: Exception | None = None
        try:
            await worker.run_turn(Turn(turn_id, req.trajectory_id, t.prompt + t.out.token_ids, params,
                                       req.policy_version, self.adapter), got)
            if got.finish_reason is None:  # a stream cut short: not a finished turn
                raise ConnectionError(f"{wid} ended turn {turn_id!r} without a finish reason")
            outcome = "done" if got.finish_reason != "abort" else "moved" if t.move_to else "abort"
        except asyncio.CancelledError:
            if not t.lost or t.done.done():
                raise
            outcome = Failure.WORKER.value
        except Exception as exc:
            error, outcome = exc, classify(exc).value
            if outcome == Failure.WORKER.value:
                self.table.suspect(wid)
        t.out.extend(got)
        end, produced = self.elapsed(), len(got.token_ids)
        self._placements.append(Placement(req.trajectory_id, req.turn, req.attempt, wid, worker.kind.value,
                                          start, end, produced, outcome))
        if produced and wid in self.table.workers:
            self.table.measure(wid, produced / max(end - start, 1e-6))
        if not t.done.done():
            try:
                self._settle(t, wid, req, produced, outcome, error)
            except Exception as exc:  # a bug: the turn fails with it rather than waiting for the deadline
                t.done.set_exception(exc)
        self._drain()

    def _settle(self, t: _Turn, wid: str, req: RoutedTurn, produced: int, outcome: str,
                error: Exception | None) -> None:
        """After an attempt: the turn is done, failed, or goes on from its tokens elsewhere."""
        tid = req.trajectory_id
        in_flight = tid in self.table.in_flight.get(wid, {})
        stopped = produced > 0 and t.out.token_ids[-1] in self.params.stop_token_ids
        if outcome == "done" or produced == req.max_tokens or stopped:
            if in_flight:
                self.table.complete(wid, tid)
            if outcome != "done":
                t.out.finish_reason = "stop" if stopped else "length"
            t.done.set_result(t.out)
            return
        if outcome == Failure.REJECTED.value:
            t.rejections += 1
            if t.rejections > self.turn_retries:
                if in_flight:
                    self.table.complete(wid, tid)
                t.done.set_exception(TurnFailed(f"turn {req.turn} refused {t.rejections} times, the last by "
                                                f"{wid}: {error}"))
                return
        t.lost, t.request = False, resume(req, produced)
        now = self._now()
        if outcome == "moved" and in_flight and t.move_to in self.table.workers:
            route = self.table.move(tid, wid, t.move_to, produced)
        elif outcome != Failure.WORKER.value and in_flight:
            if outcome == Failure.BUSY.value:
                self.table.full(wid)
            # handed back, refused or turned away: resumed elsewhere, without this worker's affinity
            route = self.table.abort(wid, tid, produced, now)
        else:
            if in_flight:
                self.table.complete(wid, tid)
            route = self.table.route(t.request, now)
        self._dispatch(t, route)

    # -- the periodic half: heartbeats, dead workers, queued turns, rebalancing ------------------

    async def _tick(self) -> None:
        late = 0.0  # how late this loop wakes: the reaper's grace (decays once the loop catches up)
        while True:
            await self.registry.poll()
            for turn in self.registry.reap(late):
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
                        self._spawn(self.registry.workers[src].abort(turn.attempt_id))
            due = time.monotonic() + self.tick_s
            await asyncio.sleep(self.tick_s)
            late = max(time.monotonic() - due, late - self.tick_s)

    def _drain(self) -> None:
        for turn, route in self.table.drain(self._now(), lambda turn: turn.trajectory_id in self._turns):
            t = self._turns[turn.trajectory_id]
            t.request = turn
            self._dispatch(t, route)

    def _now(self) -> float:
        """The routing table's clock."""
        return self.registry.clock()

    def elapsed(self) -> float:
        """Seconds since this manager's clock started (its last `run`'s start, or its creation)."""
        return time.perf_counter() - self._t0
