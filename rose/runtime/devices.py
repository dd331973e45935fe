"""A "device" on a CPU machine is a set of cores: pin a process to it, one torch thread per core.

Two processes with two torch threads each on two cores run about ten times slower than one
thread each (they keep preempting each other's spin-waiting OpenMP threads), so every actor
pins itself and all of its threads before it loads anything.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import torch

from rose.logs import DEFAULT_LEVEL, LEVEL_ENV


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


def cluster_address(address: str | None) -> str | None:
    """The Ray cluster a run joins: `address`, else `$RAY_ADDRESS` (as `ray.init` reads it);
    None: a local instance."""
    return address or os.environ.get("RAY_ADDRESS") or None


def init_ray(address: str | None = None, **local: object) -> None:
    """`ray.init` whose workers keep the driver's priority and log at its level, their lines
    forwarded to the driver's terminal (each actor names its role in them: `rose.logs`).

    It joins the cluster at `address`, else at `$RAY_ADDRESS` (as `ray.init` itself does), else
    starts a local instance of its own sized by `local` (`num_cpus`, `object_store_memory`),
    never the cluster a `ray start` on this machine left running (which `ray.init()` would join):
    Ray refuses resource options when joining a cluster, whose nodes declare their own.

    A local Ray starts its workers at niceness 15 by default, so any ordinary process -- the
    driver, a shell, a test run -- would preempt an actor that holds a device's cores; a serving
    device then misses its SLOs for reasons no admission policy can see.
    """
    import ray

    address = cluster_address(address)
    options = {} if address else {"_system_config": {"worker_niceness": 0}, **local}
    level = {LEVEL_ENV: os.environ.get(LEVEL_ENV, DEFAULT_LEVEL)}
    ray.init(address=address or "local", include_dashboard=False, configure_logging=False, log_to_driver=True,
             runtime_env={"env_vars": level}, **options)


def available_cores() -> set[int]:
    return set(os.sched_getaffinity(0))


@contextlib.contextmanager
def pinned(cores: Iterable[int]) -> Iterator[None]:
    """`pin` for a while, then give this process back the cores and torch threads it had."""
    before, threads = available_cores(), torch.get_num_threads()
    pin(cores)
    try:
        yield
    finally:
        pin(before)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
