"""Typed contracts between the layers, with no implementation in them: what one layer hands
another. Everything else in `rose` may import from here; this package imports nothing of it."""

from rose.contracts.engine import GenerationEngine, InFlight, RequestOutput
from rose.contracts.load import TokenLoad
from rose.contracts.sampling import SamplingParams, StructuredKind, StructuredOutput
from rose.contracts.turn import TURN_CHUNK_S, Turn, TurnOutput
from rose.contracts.worker import (
    Capacity,
    Heartbeat,
    PushedHeartbeats,
    TurnHost,
    WeightUpdate,
    Worker,
    WorkerKind,
)

__all__ = [
    "TURN_CHUNK_S",
    "Capacity",
    "GenerationEngine",
    "Heartbeat",
    "InFlight",
    "PushedHeartbeats",
    "RequestOutput",
    "SamplingParams",
    "StructuredKind",
    "StructuredOutput",
    "TokenLoad",
    "Turn",
    "TurnHost",
    "TurnOutput",
    "WeightUpdate",
    "Worker",
    "WorkerKind",
]
