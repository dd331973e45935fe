"""A "device" on a CPU machine is a set of cores: pin a process to it, one torch thread per core.

Two processes with two torch threads each on two cores run about ten times slower than one
thread each (they keep preempting each other's spin-waiting OpenMP threads), so every actor
pins itself and all of its threads before it loads anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch


def pin(cores: Iterable[int]) -> None:
    """Pin every thread of this process to `cores` and give torch one thread per core."""
    cores = set(cores)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            continue
    torch.set_num_threads(len(cores))
    os.environ["OMP_NUM_THREADS"] = str(len(cores))


def available_cores() -> set[int]:
    return set(os.sched_getaffinity(0))
