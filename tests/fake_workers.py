"""In-process stand-ins for rollout workers (the rollout manager's and stream's tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from rose.contracts import Heartbeat, Turn, TurnOutput, WorkerKind
from rose.coserve.lease_client import ExecutorBusy
from rose.engine import SamplingParams

TOKEN = 50  # what fake workers generate


class FakeWorker:
    """`refuse`: trajectories whose turns it refuses (a ValueError, as an engine refuses a bad
    sampling parameter); `stuck`: trajectories whose turns never end (its heartbeats go on);
    `busy_calls`: how many first calls it turns away (429); `break_after`: its streams end after
    that many tokens, without a finish reason (a connection closed early)."""

    def __init__(self, worker_id: str, kind: WorkerKind = WorkerKind.DEDICATED, cap: int = 8, *,
                 abort_after: int | None = None, die_after: int | None = None, hang_after: int | None = None,
                 delay_s: float = 0.002, refuse: Collection[str] = (), stuck: Collection[str] = (),
                 busy_calls: int = 0, break_after: int | None = None) -> None:
        self.worker_id, self.kind, self.max_concurrency = worker_id, kind, cap
        self.abort_after, self.die_after, self.hang_after = abort_after, die_after, hang_after
        self.break_after = break_after
        self.delay_s, self.refuse, self.stuck, self.busy_calls = delay_s, refuse, stuck, busy_calls
        self.calls: list[tuple[str, list[int], int]] = []
        self.aborted: set[str] = set()
        self.dead = self.hung = False
        self.policy_version = 0
        self.running = 0  # calls in progress: all end with the step

    async def run_turn(self, turn: Turn, result: TurnOutput) -> TurnOutput:
        self.calls.append((turn.turn_id, list(turn.token_ids), turn.params.max_tokens))
        self.running += 1
        try:
            return await self._generate(turn.turn_id, turn.trajectory_id, turn.params, result)
        finally:
            self.running -= 1

    async def _generate(self, turn_id: str, trajectory_id: str, params: SamplingParams,
                        result: TurnOutput) -> TurnOutput:
        if len(self.calls) <= self.busy_calls:
            raise ExecutorBusy(f"{self.worker_id}: HTTP 429: lease slots full", 429)
        if trajectory_id in self.refuse:
            raise ValueError("temperature must be >= 0, got -1.0")
        if trajectory_id in self.stuck:
            await asyncio.Event().wait()
        for i in range(params.max_tokens):
            if self.dead:
                raise ConnectionError(f"{self.worker_id} is gone")
            if i == self.abort_after or turn_id in self.aborted:
                result.finish_reason = "abort"  # an emergency cut: handed back with its tokens
                return result
            if i == self.die_after:
                self.dead = True
                raise ConnectionError(f"{self.worker_id} died")
            if i == self.break_after:
                return result
            if i == self.hang_after:
                self.hung = True
                await asyncio.Event().wait()
            await asyncio.sleep(self.delay_s)
            last = i == params.max_tokens - 1
            result.extend(TurnOutput([TOKEN], [-1.0], [self.policy_version], "length" if last else None))
        return result

    async def heartbeat(self) -> Heartbeat:
        if self.dead:
            raise ConnectionError(f"{self.worker_id} is gone")
        if self.hung:
            await asyncio.sleep(60)
        return Heartbeat(self.policy_version, free_slots=self.max_concurrency)

    async def abort(self, turn_id: str) -> None:
        self.aborted.add(turn_id)

    async def close(self) -> None:
        pass
