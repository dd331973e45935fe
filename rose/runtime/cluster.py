"""The actors of one training run and what the driver asks of them.

`Cluster.start` initialises Ray (a local instance sized to this machine's cores, or
`ray_address`), writes the random-initialised checkpoints when no path is given, and starts the
trainer (`TrainerGroup`), the dedicated rollout workers and, in rose mode, the serving devices,
each with its HTTP server and its trace replay (`Replicas`); with `rollout.shards` > 1, the
control plane's shards, which then route the turns (`ControlShards`). Per step the driver calls
`rollout`, `train`, `sync_weights` and `save`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
import uuid
from pathlib import Path

from rose.coserve.loadgen import RequestResult
from rose.coserve.settings import ServerLimits
from rose.model import load_tokenizer
from rose.model.lora import adapter_base, is_adapter
from rose.rollout.manager import RolloutReport, settle_heap
from rose.rollout.registry import WorkerRegistry
from rose.rollout.routing import compile_kernels
from rose.rollout.stream import RolloutStream
from rose.runtime.checkpoints import check_checkpoint_dir, for_actors
from rose.runtime.config import Config, Mode, actor_device
from rose.runtime.devices import available_cores, cluster_address, init_ray, pinned
from rose.runtime.placement import Demand, PlacementPolicy, check_placeable
from rose.runtime.replicas import Replicas
from rose.runtime.rollouts import (
    RolloutContext,
    RolloutFunction,
    heldout_rollout,
    load_rollout_function,
    stream_rollouts,
)
from rose.runtime.shards import ControlShards
from rose.runtime.trainers import TrainerGroup, rank_cores
from rose.transfer import RayRelay

log = logging.getLogger(__name__)

PROMETHEUS_TARGETS = "prometheus_targets.json"  # in the run directory: the serving devices' /metrics


@dataclasses.dataclass
class SyncReport:
    seconds: float
    payload_bytes: int


class Cluster:
    def __init__(self, config: Config, mode: Mode, out_dir: Path, resume: Path | None = None) -> None:
        self.config, self.mode, self.out_dir, self.resume = config, mode, out_dir, resume
        self.loop = asyncio.new_event_loop()  # one loop for every async call (HTTP clients live on it)
        self.registry = WorkerRegistry(config.rollout.stall_timeout_s)
        relay, group = f"rose-relay-{uuid.uuid4().hex[:8]}", "rollout"
        self.restarts: list[str] = []  # what died and how it came back, in order
        self.placement = PlacementPolicy(local=cluster_address(config.ray_address) is None,
                                         resources=config.devices.resources)
        self.trainers = TrainerGroup(config, relay, group, out_dir, self.restarts, self.placement)
        # The serving devices' HTTP APIs are locked with keys of this run's own: only its driver
        # leases turns and loads weights, only its trace replay sends serving requests.
        limits = ServerLimits(api_key=secrets.token_urlsafe(32), lease_key=secrets.token_urlsafe(32))
        self.replicas = Replicas(config, self.registry, self.trainers, relay, group, limits, self.restarts,
                                 out_dir / PROMETHEUS_TARGETS, self.placement)
        self.rollout_function = load_rollout_function(config.rollout.function)
        # Asynchronous RL (train.max_staleness >= 1): the groups in play across steps, and the
        # watcher that starts dead replicas again all along (synchronous runs watch per step).
        self._stream: RolloutStream | None = None
        self.shards: ControlShards | None = None
        self._watching: tuple[asyncio.Event, asyncio.Task[None]] | None = None
        self.stream_groups: dict[str, int] = {}  # the stream's group counts when the run ended
        self._pinned = contextlib.ExitStack()
        self._relay: RayRelay | None = None
        self._relay_name = relay

    @property
    def version(self) -> int:
        """The trainer's weights' version: what the rollouts sample from."""
        return self.trainers.version

    @property
    def steps(self) -> int:
        """RL steps trained so far (a resumed run's too): where the driver goes on."""
        return self.trainers.steps

    # -- start and stop -------------------------------------------------------------------------

    def start(self) -> None:
        import ray

        c, r = self.config, self.replicas
        if self.placement.local:
            # The driver (rollout manager, environments) and a local Ray's own processes, started
            # from here, belong to the training side: on the trainer's cores, never on a serving
            # device's.
            self._pinned.enter_context(pinned(c.devices.trainer))
        if not ray.is_initialized():
            init_ray(c.ray_address, num_cpus=len(available_cores()))
        if not self.placement.local:
            check_placeable(self._demands(), [n["Resources"] for n in ray.nodes() if n["Alive"]])
        # Created here, the relay's directory belongs to the driver: it outlives any actor's death.
        self._relay = RayRelay(self._relay_name)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        policy = str(self.resume or c.model.checkpoint(self.out_dir / "initial"))
        self.tokenizer = load_tokenizer(policy)
        # The rollout engines load the model; a LoRA checkpoint is an adapter of its base.
        model = adapter_base(policy) if is_adapter(policy) else policy
        r.policy = for_actors(model, self.placement.local)
        trainer_start = r.policy if model == policy else for_actors(policy, self.placement.local)
        starts = self.loop.run_until_complete(self.trainers.launch(trainer_start))
        if c.rollout.shards > 1:  # before any replica registers: each is routed to by every shard
            self.shards = r.shards = ControlShards(c, r.policy, self.placement, self.restarts)
            self.shards.start()
        for i, cores in enumerate(c.devices.dedicated):
            r.start_dedicated(f"dedicated-{i}", cores)
        if self.mode is Mode.ROSE:
            serving = str(c.serving.model.checkpoint(self.out_dir / "serving-model"))
            r.serving_model = for_actors(serving, self.placement.local)
            for i, cores in enumerate(c.devices.serving):
                r.start_serving(f"serving-{i}", cores)
            for i, url in enumerate(c.serving.endpoints):
                r.attach(f"endpoint-{i}", url)
        # A resumed run goes on from its checkpoint's version and steps.
        self.trainers.version, self.trainers.steps = ray.get(starts)[0]
        if not self.placement.local:  # the trainer writes the checkpoints on its node
            probe = ray.get(self.trainers.leader.probe_dir.remote(str(self.out_dir.resolve())))
            if warning := check_checkpoint_dir(self.out_dir, probe):
                log.warning(warning)
        for wid in r.all():
            self.loop.run_until_complete(r.register(wid))
        self.sync_weights()  # every replica gets the trainer's weights (a full copy) before step one
        for handle in r.serving.values():
            ray.get(handle.start_replay.remote())
        compile_kernels()
        settle_heap()  # the driver's start-up objects out of the collector's sight before rollouts

    def _demands(self) -> list[Demand]:
        """What every actor this run starts asks of its node (on a cluster)."""
        c, d, n = self.config, self.config.devices, self.config.train.data_parallel
        roles = [("trainer", c.train.device, [rank_cores(d.trainer, r, n) for r in range(n)]),
                 ("dedicated", c.rollout.device, d.dedicated)]
        if self.mode is Mode.ROSE:
            roles.append(("serving", c.serving.device, d.serving))
        if self.mode is Mode.ELASTIC:
            roles.append(("elastic", c.rollout.device, d.elastic))
        if c.rollout.shards > 1:  # each a core's worth of the driver's work
            roles.append(("shard", "cpu", [d.trainer[:1]] * c.rollout.shards))
        return [self.placement.demand(role, cores, actor_device(device).startswith("cuda"))
                for role, device, listed in roles for cores in listed]

    def shutdown(self) -> None:
        self.loop.run_until_complete(self._stop_stream())
        self.loop.run_until_complete(self.replicas.close())
        self.trainers.kill()
        if self._relay is not None:
            self._relay.close()
        self.loop.close()
        self._pinned.close()

    # -- what the driver loop calls -------------------------------------------------------------

    def rollout(self, step: int) -> RolloutReport:
        """The step's rollouts (`rollout.function`), with the serving budgets renewed, dead
        replicas started again meanwhile and, in elastic mode, devices added for their length.
        Asynchronous (train.max_staleness >= 1): the step's batch, taken from the groups in play,
        which go on playing while the driver trains."""
        if not self.config.train.max_staleness:
            return self._run(self.rollout_function if self.shards is None else self._sharded(False), step)
        return self.loop.run_until_complete(self._take())

    def _sharded(self, evaluate: bool) -> RolloutFunction:
        """The step's rollouts (or evaluation) as the shards play them, each its share."""
        shards = self.shards
        assert shards is not None
        return lambda ctx: shards.rollout(evaluate, ctx.step, ctx.version)

    async def _take(self) -> RolloutReport:
        if self._watching is None:
            stop = asyncio.Event()
            self._watching = (stop, asyncio.create_task(self.replicas.watch(stop)))
        await self.replicas.new_rl_step()
        timeout_s = self.config.rollout.timeout_s
        if self.shards is not None:
            return await self.shards.take(self.steps, self.version, timeout_s)
        if self._stream is None:
            ctx = RolloutContext(self.config, self.steps, self.version, self.tokenizer, self.registry)
            self._stream = stream_rollouts(ctx, lambda: self.version)
        return await self._stream.take(timeout_s)

    async def _stop_stream(self) -> None:
        if self._stream is not None:
            self.stream_groups = self._stream.counts()  # those in play are stopped: no step needs them
            await self._stream.close()
        if self.shards is not None:
            await self.shards.close()
            self.stream_groups = self.shards.stream_groups
        if self._watching is not None:
            stop, watch = self._watching
            stop.set()
            await watch

    def evaluate(self, step: int) -> RolloutReport:
        """The held-out evaluation of the current policy, run as the rollouts are."""
        return self._run(heldout_rollout if self.shards is None else self._sharded(True), step)

    def _run(self, function: RolloutFunction, step: int) -> RolloutReport:
        ctx = RolloutContext(self.config, step, self.version, self.tokenizer, self.registry)
        return self.loop.run_until_complete(self._rollout(function, ctx))

    async def _rollout(self, function: RolloutFunction, ctx: RolloutContext) -> RolloutReport:
        await self.replicas.new_rl_step()
        stop = asyncio.Event()
        # One watcher at a time: an asynchronous run's watches all along.
        watch = asyncio.create_task(self.replicas.watch(stop)) if self._watching is None else None
        try:
            run = function(ctx)
            if self.mode is not Mode.ELASTIC:
                return await run
            return await self.replicas.with_elastic(run)
        finally:
            stop.set()
            if watch is not None:
                await watch  # a restart under way finishes: the replica is registered, not half started

    def train(self, trajectories: list) -> dict[str, float]:
        return self.loop.run_until_complete(self._train(trajectories))

    async def _train(self, trajectories: list) -> dict[str, float]:
        """One optimizer step. While an asynchronous run's rollouts go on, the workers on the
        trainer's device pause for it (turns in flight wait there): two busy processes on one device
        would slow the trainer far more than the rollouts they add, and the rest go on."""
        paused = self.replicas.beside_trainer() if self._watching is not None else []
        await self._pause(paused, True)
        try:
            return await self.trainers.train(trajectories)
        finally:  # a worker that died meanwhile is started again unpaused
            await self._pause(paused, False)

    async def _pause(self, wids: list[str], paused: bool) -> None:
        """Pause (or resume) the workers' engines, and route them no turn meanwhile."""
        table, handles = self.registry.table, self.replicas.dedicated
        for wid in wids:
            if wid in table.workers:
                table.set_paused(wid, paused)
        calls = [(handles[w].pause if paused else handles[w].resume).remote() for w in wids if w in handles]
        await asyncio.gather(*calls, return_exceptions=True)
        if self.shards is not None and wids:
            await self.shards.pause(wids, paused)

    def sync_weights(self) -> SyncReport:
        """Publish the trainer's weights; every replica pulls and applies them (between two of
        its engine's iterations: an asynchronous run's turns go on). Groups the staleness window
        held back may then start."""
        start = time.perf_counter()
        sent = self.loop.run_until_complete(self._sync())
        return SyncReport(time.perf_counter() - start, sent)

    async def _sync(self) -> int:
        sent = await self.replicas.sync(self.replicas.all())
        if self._stream is not None:
            self._stream.refill()
        if self.shards is not None and self._watching is not None:
            await self.shards.set_version(self.version)
        return sent

    def save(self, step: int) -> str:
        path = self.out_dir / f"step-{step}"
        self.loop.run_until_complete(self.trainers.save(path))
        return str(path)

    def serving_results(self, since: float = 0.0, stop: bool = False) -> list[tuple[float, RequestResult]]:
        return self.replicas.serving_results(since, stop)

    def pool_timelines(self, since: float = 0.0) -> dict[str, list[tuple[float, dict[str, float]]]]:
        return self.replicas.pool_timelines(since)
