"""The worker registry: which workers exist, which are alive, and what they report.

Mechanism around the pure `RoutingTable`: `poll` reads the heartbeats that come by themselves
(a device's turn stream pushes its capacity) and heartbeats every other worker at once, and
feeds them to the table (a serving executor's free rollout slots, every worker's policy
version); `reap` takes out workers silent past the stall timeout (default 2 s)
and returns their turns in flight for the caller to resume. A worker that answers again later
is registered again (a restarted process, a network blip): the registry remembers every worker
it was given until `remove`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from rose.contracts import Heartbeat, Worker
from rose.rollout.routing import STALL_TIMEOUT_S, RoutedTurn, RoutingTable, WorkerState


class WorkerRegistry:
    def __init__(self, stall_timeout_s: float = STALL_TIMEOUT_S, affinity: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self.table = RoutingTable(stall_timeout_s, affinity)
        self.workers: dict[str, Worker] = {}
        self.clock = clock

    @property
    def stall_timeout_s(self) -> float:
        return self.table.stall_timeout_s

    def add(self, worker: Worker, policy_version: int = 0) -> None:
        """Register a worker, alive as of now."""
        if worker.worker_id in self.workers:
            raise ValueError(f"worker {worker.worker_id!r} is already registered")
        self.workers[worker.worker_id] = worker
        self._register(worker, Heartbeat(policy_version))

    def remove(self, worker_id: str) -> list[RoutedTurn]:
        """Forget a worker (released, shut down); return its turns in flight."""
        self.workers.pop(worker_id, None)
        return self.table.remove(worker_id) if worker_id in self.table.workers else []

    async def drop(self, worker_id: str) -> None:
        """Forget a worker and close it (its turns in flight end as its failure)."""
        worker = self.workers.get(worker_id)
        self.remove(worker_id)
        if worker is not None:
            await worker.close()

    def alive(self) -> list[str]:
        return list(self.table.workers)

    async def poll(self) -> None:
        """Read the heartbeats that came by themselves (a device's turn stream), and heartbeat
        every other worker concurrently; an answer within the stall timeout counts."""
        pulled = []
        now = self.clock()
        for worker in list(self.workers.values()):
            take = getattr(worker, "take_heartbeat", None)  # `PushedHeartbeats`
            if take is None:
                pulled.append(worker)
            elif (beat := take()) is not None:
                self._heard(worker, beat, now)
        if not pulled:
            return
        replies = await asyncio.gather(*(self._beat(w) for w in pulled), return_exceptions=True)
        now = self.clock()
        for worker, reply in zip(pulled, replies, strict=True):
            if not isinstance(reply, BaseException):
                self._heard(worker, reply, now)

    def _heard(self, worker: Worker, beat: Heartbeat, now: float) -> None:
        if worker.worker_id not in self.workers:
            return
        if worker.worker_id not in self.table.workers:
            self._register(worker, beat)
        self.table.heartbeat(worker.worker_id, now, free_slots=beat.free_slots,
                             policy_version=beat.policy_version)

    async def _beat(self, worker: Worker) -> Heartbeat:
        # The heartbeat's coroutine is made here, not before: a poll cancelled before this runs
        # (the step ended) leaves no coroutine never awaited.
        return await asyncio.wait_for(worker.heartbeat(), self.stall_timeout_s)

    def reap(self, grace_s: float = 0.0) -> list[RoutedTurn]:
        """Take out the workers silent past the stall timeout and `grace_s` (how late the
        caller's own loop runs: a busy driver reads its workers' heartbeats late, and must not
        take its own lateness for their silence); return their turns in flight."""
        return self.table.reap(self.clock() - grace_s)

    async def listen(self, tick_s: float = 0.25) -> None:
        """Poll and reap until cancelled: liveness where no rollout manager ticks (the driver of a
        sharded control plane, whose shards route the turns)."""
        while True:
            await self.poll()
            self.reap()
            await asyncio.sleep(tick_s)

    def _register(self, worker: Worker, beat: Heartbeat) -> None:
        self.table.register(WorkerState(worker.worker_id, worker.kind, worker.max_concurrency,
                                        last_heartbeat_s=self.clock(), policy_version=beat.policy_version,
                                        free_slots=beat.free_slots))
