"""The worker registry: which workers exist, which are alive, and what they report.

Mechanism around the pure `RoutingTable`: `poll` heartbeats every known worker at once and
feeds the replies to the table (a serving executor's free rollout slots, every worker's policy
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

    def alive(self) -> list[str]:
        return list(self.table.workers)

    async def poll(self) -> None:
        """Heartbeat every known worker concurrently; an answer within the stall timeout counts."""
        workers = list(self.workers.values())
        replies = await asyncio.gather(*(self._beat(w) for w in workers), return_exceptions=True)
        now = self.clock()
        for worker, reply in zip(workers, replies, strict=True):
            if isinstance(reply, BaseException) or worker.worker_id not in self.workers:
                continue
            if worker.worker_id not in self.table.workers:
                self._register(worker, reply)
            self.table.heartbeat(worker.worker_id, now, free_slots=reply.free_slots,
                                 policy_version=reply.policy_version)

    async def _beat(self, worker: Worker) -> Heartbeat:
        # The heartbeat's coroutine is made here, not before: a poll cancelled before this runs
        # (the step ended) leaves no coroutine never awaited.
        return await asyncio.wait_for(worker.heartbeat(), self.stall_timeout_s)

    def reap(self) -> list[RoutedTurn]:
        """Take out the workers silent past the stall timeout; return their turns in flight."""
        return self.table.reap(self.clock())

    def _register(self, worker: Worker, beat: Heartbeat) -> None:
        self.table.register(WorkerState(worker.worker_id, worker.kind, worker.max_concurrency,
                                        last_heartbeat_s=self.clock(), policy_version=beat.policy_version,
                                        free_slots=beat.free_slots))
