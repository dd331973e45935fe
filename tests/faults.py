"""Faults injected in the middle of a step's rollouts (the chaos and multi-node tests)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rose.rollout.manager import RolloutReport
from rose.runtime.cluster import Cluster


def rollout_with_fault(cluster: Cluster, step: int, busy: str | None, fault: Callable[[], None],
                       rollout: Callable[[Cluster, int], RolloutReport] = Cluster.rollout) -> RolloutReport:
    """`rollout(cluster, step)` (`Cluster.rollout` as defined, even where a test patches it),
    with `fault()` called from another thread once worker `busy` has turns in flight (None: once
    any worker has); not at all if the rollout ends first."""
    in_flight, done = cluster.registry.table.in_flight, threading.Event()

    def strike() -> None:
        while not done.is_set() and not (any(in_flight.values()) if busy is None else in_flight.get(busy)):
            time.sleep(0.02)
        if not done.is_set():
            fault()

    thread = threading.Thread(target=strike)
    thread.start()
    try:
        return rollout(cluster, step)
    finally:
        done.set()
        thread.join()
