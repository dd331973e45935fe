"""The sharded control plane: a run's turns routed by K Ray actors instead of the driver alone.

One driver process routes every rollout turn: its CPU, one core and one GIL, bounds the
borrowed capacity a run can use (docs/runtime.md, "The control plane"). With `rollout.shards`
= K > 1 each shard is a Ray actor (`RolloutShard`) with a rollout manager, a routing table and a
turn stream to every device of its own. Shard k plays every K-th group of each step (groups k,
k + K, ...), so a trajectory's turns stay on its shard, and the trainer gets the shards' groups
as one batch (`ControlShards.rollout`, or `take` for asynchronous RL's stream). Each device's
rollout slots are split among the shards (`slot_share`); its capacity heartbeats reach every
shard, and a turn a device has no room for comes back to its shard to be routed again.

The driver keeps what is the run's: which devices exist (it tells the shards as replicas come,
go and come back), their liveness (its own stream to each device carries heartbeats only),
weights, pauses. A shard that dies is started again and plays its share again: a synchronous
step's groups from their first turn, an asynchronous stream's from the first group its
predecessor had not handed to a step. The dead shard's attempts end with its connections (each
device aborts a stream's turns when it closes), and no token of theirs reaches the trainer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from rose.contracts import WorkerKind
from rose.coserve.lease_stream import LeaseStream
from rose.model import load_tokenizer
from rose.rollout.manager import RolloutReport, settle_heap
from rose.rollout.registry import WorkerRegistry
from rose.rollout.routing import compile_kernels
from rose.rollout.stream import RolloutStream
from rose.runtime.actors import Role
from rose.runtime.checkpoints import Checkpoint, open_checkpoint
from rose.runtime.config import Config
from rose.runtime.placement import PlacementPolicy
from rose.runtime.rollouts import RolloutContext, heldout_rollout, load_rollout_function, stream_rollouts

SHARD_RESTARTS = 2  # per call: a shard that dies again right after its restart fails the step


@dataclasses.dataclass(frozen=True)
class Device:
    """A rollout replica as a control plane routes to it: its lease API and turn slots."""

    worker_id: str
    url: str
    key: str | None
    kind: WorkerKind
    slots: int

    def stream(self, slots: int | None = None) -> LeaseStream:
        """Its turn stream, with `slots` of its turn slots (None: all)."""
        return LeaseStream(self.url, key=self.key, worker_id=self.worker_id, kind=self.kind,
                           max_concurrency=self.slots if slots is None else slots)


def slot_share(slots: int, shard: int, shards: int) -> int:
    """Shard `shard`'s part of a device's `slots`: an even split, the remainder to the first
    shards, at least one each (a device with fewer slots than shards turns the excess away)."""
    return max(1, slots // shards + (shard < slots % shards))


def merge(reports: list[RolloutReport]) -> RolloutReport:
    """The shards' reports of one step as one: the step lasted as long as its slowest shard."""
    return RolloutReport([t for r in reports for t in r.trajectories],
                         [p for r in reports for p in r.placements],
                         max((r.seconds for r in reports), default=0.0),
                         [f for r in reports for f in r.failed], [u for r in reports for u in r.lost])


class RolloutShard(Role):
    """One shard: its share of every step's groups, routed to every device (a Ray async actor:
    its calls run on one event loop, where its turn streams live)."""

    def __init__(self, shard: int, shards: int, config: Config, policy: Checkpoint, cores: list[int] | None,
                 local: bool) -> None:
        self._start_as(f"shard-{shard}", cores, local)
        self.shard, self.shards, self.config = shard, shards, config
        self.tokenizer = load_tokenizer(open_checkpoint(policy))
        self.registry = WorkerRegistry(config.rollout.stall_timeout_s)
        self.version = 0
        self.stream: RolloutStream | None = None
        compile_kernels()
        settle_heap()

    async def ready(self) -> bool:
        return True

    async def route_to(self, device: Device, version: int) -> None:
        """Route to `device` (in place of an earlier one of its name), which holds `version`."""
        await self.registry.drop(device.worker_id)
        self.registry.add(device.stream(slot_share(device.slots, self.shard, self.shards)), version)

    async def forget(self, worker_id: str) -> None:
        await self.registry.drop(worker_id)

    async def pause(self, worker_ids: list[str], paused: bool) -> None:
        for wid in worker_ids:
            if wid in self.registry.table.workers:
                self.registry.table.set_paused(wid, paused)

    def _context(self, step: int, version: int) -> RolloutContext:
        c = self.config
        return RolloutContext(c, step, version, self.tokenizer, self.registry, self.shard, self.shards)

    async def rollout(self, evaluate: bool, step: int, version: int) -> RolloutReport:
        """This shard's share of a synchronous step's rollouts (or of the held-out evaluation)."""
        function = heldout_rollout if evaluate else load_rollout_function(self.config.rollout.function)
        return await function(self._context(step, version))

    async def take(self, step: int, version: int, timeout_s: float, first_step: int,
                   skip: int) -> tuple[RolloutReport, int]:
        """This shard's share of an asynchronous step's batch, and how many of its groups are done
        with (taken, dropped or expired): where a successor of this shard would go on. The
        stream starts at the first call, from its `skip`-th group of a stream begun at `first_step`."""
        self.version = max(self.version, version)
        if self.stream is None:
            ctx = self._context(step, version)
            self.stream = stream_rollouts(ctx, lambda: self.version, first_step, skip)
        report = await self.stream.take(timeout_s)
        counts = self.stream.counts()
        return report, skip + counts["started"] - counts["in_play"]

    async def set_version(self, version: int) -> None:
        """The trainer's weights moved on: groups the staleness window held back may start."""
        self.version = version
        if self.stream is not None:
            self.stream.refill()

    async def close(self) -> dict[str, int]:
        """Stop the stream's groups and the turn streams; the stream's group counts."""
        counts: dict[str, int] = {}
        if self.stream is not None:
            counts = self.stream.counts()
            await self.stream.close()
        for worker in list(self.registry.workers.values()):
            await worker.close()
        return counts


class ControlShards:
    """The driver's side of the shards: starts them, tells them the devices, gathers their reports,
    and starts again a shard that died."""

    def __init__(self, config: Config, policy: Checkpoint, placement: PlacementPolicy,
                 restarts: list[str]) -> None:
        self.config, self.policy, self.placement, self.restarts = config, policy, placement, restarts
        self.count = config.rollout.shards
        self.devices: dict[str, tuple[Device, int]] = {}  # what every shard routes to, at which version
        self.paused: set[str] = set()
        self.handles: list[Any] = []
        self._first_step: int | None = None  # an asynchronous run's first step: its streams' origin
        self._done: list[int] = []  # per shard: its stream's groups done with at its last take
        self.stream_groups: dict[str, int] = {}

    def start(self) -> None:
        import ray

        self.handles = [self._start(k) for k in range(self.count)]
        self._done = [0] * self.count
        ray.get([h.ready.remote() for h in self.handles])

    def _start(self, k: int) -> Any:
        import ray

        cores = self.config.devices.trainer  # the driver's: off the devices' cores (local mode)
        options = self.placement.options(self.placement.demand("shard", cores[:1], cuda=False))
        return ray.remote(RolloutShard).options(**options).remote(k, self.count, self.config, self.policy,
                                                                   cores, self.placement.local)

    async def _restart(self, k: int, why: BaseException) -> None:
        """Start shard `k` again, routing to every device as its predecessor did."""
        import ray

        ray.kill(self.handles[k])
        self.handles[k] = handle = self._start(k)
        await handle.ready.remote()
        for device, version in self.devices.values():
            await handle.route_to.remote(device, version)
        await handle.pause.remote(sorted(self.paused), True)
        self.restarts.append(f"shard-{k} restarted ({type(why).__name__})")

    async def _on_every(self, call: str, *args: Any) -> None:
        """`call` on every shard; a dead one is skipped (its successor starts from `devices`
        and `paused`, which the caller updated first)."""
        import ray

        calls = [getattr(h, call).remote(*args) for h in self.handles]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException) and not isinstance(result, ray.exceptions.RayActorError):
                raise result

    async def route_to(self, device: Device, version: int) -> None:
        self.devices[device.worker_id] = (device, version)
        await self._on_every("route_to", device, version)

    async def forget(self, worker_id: str) -> None:
        self.devices.pop(worker_id, None)
        self.paused.discard(worker_id)
        await self._on_every("forget", worker_id)

    async def pause(self, worker_ids: list[str], paused: bool) -> None:
        (self.paused.update if paused else self.paused.difference_update)(worker_ids)
        await self._on_every("pause", worker_ids, paused)

    async def set_version(self, version: int) -> None:
        await self._on_every("set_version", version)

    async def rollout(self, evaluate: bool, step: int, version: int) -> RolloutReport:
        """A synchronous step's rollouts (or evaluation), every shard its share; a shard that dies
        is started again and plays its share again."""
        shares = [self._retried(k, lambda h: h.rollout.remote(evaluate, step, version))
                  for k in range(self.count)]
        return merge(list(await asyncio.gather(*shares)))

    async def take(self, step: int, version: int, timeout_s: float) -> RolloutReport:
        """An asynchronous step's batch, every shard its share of the groups."""
        if self._first_step is None:
            self._first_step = step

        async def share(k: int) -> RolloutReport:
            report, self._done[k] = await self._retried(
                k, lambda h: h.take.remote(step, version, timeout_s, self._first_step, self._done[k]))
            return report

        return merge(list(await asyncio.gather(*(share(k) for k in range(self.count)))))

    async def _retried(self, k: int, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """`call(shard k)`, made again on a new shard k as long as the shard dies, at most
        `SHARD_RESTARTS` times."""
        import ray

        deaths = 0
        while True:
            try:
                return await call(self.handles[k])
            except ray.exceptions.RayActorError as exc:
                deaths += 1
                if deaths > SHARD_RESTARTS:
                    raise RuntimeError(f"shard-{k} died {deaths} times in one call") from exc
                await self._restart(k, exc)

    async def close(self) -> None:
        """Stop every shard (an asynchronous run's groups in play with them); their group counts
        summed in `stream_groups`."""
        import ray

        counts = await asyncio.gather(*(h.close.remote() for h in self.handles), return_exceptions=True)
        for got in counts:
            if isinstance(got, dict):
                for name, n in got.items():
                    self.stream_groups[name] = self.stream_groups.get(name, 0) + n
        for handle in self.handles:
            ray.kill(handle)
        self.handles = []
