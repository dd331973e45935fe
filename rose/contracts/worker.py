"""What the rollout scheduler talks to: a worker runs turns, answers heartbeats and aborts turns.
Dedicated workers implement it (`rose.rollout.workers`), and so does a serving executor's lease
API client (`rose.coserve.lease_client.LeaseClient`); Ray actors only carry it across processes
(`rose.runtime.actors`)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from rose.contracts.engine import RequestOutput
from rose.contracts.turn import Turn, TurnOutput

if TYPE_CHECKING:
    import torch


class WorkerKind(enum.Enum):
    DEDICATED = "dedicated"      # rollout model only; first-class capacity
    SERVING = "serving"          # a co-serving executor; opportunistic capacity


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    policy_version: int
    free_slots: int = 0  # serving executors: rollout turns they would take now


@dataclasses.dataclass(frozen=True)
class Capacity:
    """A serving executor's report (its lease API's capacity): what the heartbeat carries."""

    free_slots: int  # rollout turns this executor would take now
    predicted_slack_ms: float  # serving's iteration-time headroom under the SLOs (inf: idle)
    state: str  # of the burst state machine
    policy_version: int
    rollout_budget_pages: int
    rollout_pages_used: int
    running_turns: int


class Worker(Protocol):
    worker_id: str
    kind: WorkerKind
    max_concurrency: int

    async def run_turn(self, turn: Turn, output: TurnOutput) -> TurnOutput:
        """Run the turn to its end, its tokens written into `output` as they arrive: a caller
        that loses the worker midway (an exception, a cancellation) keeps every token produced
        and can resume the turn elsewhere."""
        ...

    async def heartbeat(self) -> Heartbeat: ...

    async def abort(self, turn_id: str) -> None: ...

    async def close(self) -> None: ...


class PushedHeartbeats(Protocol):
    """A worker whose heartbeats come to it unasked (a device's turn stream): the registry reads
    them instead of calling `heartbeat`, so that liveness costs no call per worker per tick."""

    def take_heartbeat(self) -> Heartbeat | None:
        """The latest heartbeat that came since the last call (None: none came)."""
        ...


class TurnHost(Protocol):
    """What runs leased turns on a device, called on the thread that steps its engine: a
    co-serving executor, or a dedicated worker's engine (`rose.coserve.turn_stream.EngineHost`).
    Refusals: ValueError for a turn that is wrong wherever it runs, `TurnSlotsFull` (the
    executor's) when there is no room."""

    def submit_turn(self, turn: Turn) -> str: ...

    def abort_turn(self, turn_id: str) -> RequestOutput | None:
        """Stop a leased turn (None if no such turn runs): its last output, its tokens so far."""
        ...

    def capacity(self) -> Capacity: ...


# A rollout replica's weight-update hook: load these (name, tensor) pairs as policy `version`
# between two engine iterations (the transfer layer's Receiver calls it).
WeightUpdate = Callable[[Iterable[tuple[str, "torch.Tensor"]], int], None]
