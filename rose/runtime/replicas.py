"""The rollout replicas of a training run: dedicated workers, serving devices, attached serving
endpoints, elastic devices.

Each replica is a Ray actor on its own cores. This module starts them, routes to them (the
worker registry), gives them the trainer's weights (`sync`), starts a dead one again on its
device (`watch`, `revive`), and in elastic mode provisions devices on demand for the length of
a step's rollouts: each pays the configured provisioning delay plus its real start-up (process,
model load, a full weight sync) and is released when the rollouts end, as spot or serverless
capacity is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx

from rose.contracts import WorkerKind
from rose.coserve.lease_client import LeaseClient, LeaseError
from rose.coserve.loadgen import RequestResult
from rose.coserve.settings import ServerLimits
from rose.rollout.manager import RolloutReport
from rose.rollout.registry import WorkerRegistry
from rose.runtime.actors import DedicatedWorkerActor, EndpointActor, ServingDeviceActor
from rose.runtime.checkpoints import Checkpoint
from rose.runtime.config import Config, actor_device
from rose.runtime.placement import PlacementPolicy, Unplaceable, check_placeable
from rose.runtime.shards import ControlShards, Device
from rose.runtime.trainers import TrainerGroup

SYNC_TIMEOUT_S = 120.0
# A replica started again must be up (model loaded, joined the relay) within this: past it, the
# run goes on without it rather than wait on an actor Ray cannot place.
REVIVE_TIMEOUT_S = 300.0
SYNC_ROUNDS = 3  # publishes per weight sync: a replica that missed one, or was just restarted, gets the next


class Replicas:
    def __init__(self, config: Config, registry: WorkerRegistry, trainers: TrainerGroup, relay: str,
                 group: str, server_limits: ServerLimits, restarts: list[str], targets_file: Path,
                 placement: PlacementPolicy) -> None:
        self.config, self.registry, self.trainers, self.placement = config, registry, trainers, placement
        self.targets_file = targets_file  # the serving devices' /metrics, for Prometheus's file_sd
        self.metrics_urls: dict[str, str] = {}
        self.relay, self.group, self.server_limits = relay, group, server_limits
        # A dedicated worker's lease API takes only the run's lease key (it serves no OpenAI API).
        self._dedicated_limits = ServerLimits(lease_key=server_limits.lease_key)
        self.restarts = restarts  # the run's log of what died and came back, shared
        self.dedicated: dict[str, Any] = {}
        self.serving: dict[str, Any] = {}
        self.endpoints: dict[str, Any] = {}  # attached `rose serve` processes' receiving ends, by id
        self.endpoint_urls: dict[str, str] = {}
        self.cores: dict[str, list[int]] = {}  # each replica's device, to start it again there
        # The policy's and the serving model's checkpoints as the actors get them (paths in local
        # mode, shipped through the object store on a cluster: rose/runtime/checkpoints.py).
        self.policy: Checkpoint = ""
        self.serving_model: Checkpoint = ""
        self.elastic_alloc_s: list[float] = []  # allocations that arrived: seconds from request to routable
        self.elastic_cancelled_s: list[float] = []  # still pending when a step's rollouts ended: time wasted
        # One publish at a time: an asynchronous run's watcher may start a replica again (and
        # sync it) while the driver syncs every replica.
        self._publishing = asyncio.Lock()
        # A sharded control plane (rollout.shards > 1): the shards route the turns, to the
        # replicas this driver tells them of; its own registry keeps their liveness.
        self.shards: ControlShards | None = None

    def all(self) -> dict[str, Any]:
        return {**self.dedicated, **self.serving, **self.endpoints}

    def beside_trainer(self) -> list[str]:
        """The dedicated workers pinned to cores of the trainer's (local mode; on a cluster Ray
        gives each actor devices of its own)."""
        trainer = set(self.config.devices.trainer)
        return [wid for wid in self.dedicated if self.placement.local and trainer & set(self.cores[wid])]

    # -- start, route, stop --------------------------------------------------------------------

    def start_dedicated(self, wid: str, cores: list[int]) -> Any:
        """A dedicated (or, named `elastic-N`, an elastic) rollout worker on `cores`."""
        import ray

        r = self.config.rollout
        engine = {"kv_cache_bytes": r.kv_cache_mb << 20, "device": actor_device(r.device)}
        options = self._options(wid.split("-")[0], cores, engine["device"])
        self.cores[wid] = cores
        actor = ray.remote(DedicatedWorkerActor).options(**options)
        self.dedicated[wid] = actor.remote(wid, cores, self.placement.local, self.policy, engine, self.relay,
                                           self.group, self._dedicated_limits, r.dedicated_concurrency,
                                           r.backend, self.config.model.lora)
        return self.dedicated[wid]

    def start_serving(self, wid: str, cores: list[int]) -> Any:
        import ray

        s, device = self.config.serving, actor_device(self.config.serving.device)
        # Its lease slots: the turns the run keeps on each serving device.
        executor = dataclasses.replace(s.executor, max_rollout_turns=self.config.rollout.serving_concurrency)
        options = self._options("serving", cores, device)
        self.cores[wid] = cores
        self.serving[wid] = ray.remote(ServingDeviceActor).options(**options).remote(
            wid, cores, self.placement.local, self.serving_model, self.policy, executor, device, s,
            self.relay, self.group, self.server_limits, s.engine, self.config.model.lora)
        return self.serving[wid]

    def _options(self, role: str, cores: list[int], device: str) -> dict[str, Any]:
        """A `role` actor's Ray options; on a cluster, `Unplaceable` naming the missing resource
        when no live node can hold it now (its node left: Ray would keep it pending forever)."""
        import ray

        p = self.placement
        demand = p.demand(role, cores, device.startswith("cuda"))
        if not p.local:
            check_placeable([demand], [n["Resources"] for n in ray.nodes() if n["Alive"]])
        return p.options(demand)

    def attach(self, wid: str, url: str) -> Any:
        """A `rose serve` process started on its own, at `url`: its receiving end of the weights
        (`EndpointActor`), with nothing asked of Ray; the server is not this run's to start."""
        import ray

        self.endpoint_urls[wid] = url
        self.endpoints[wid] = ray.remote(EndpointActor).options(num_cpus=0).remote(
            wid, url, self.config.serving.endpoint_key, self.policy, self.relay, self.group,
            self.config.model.lora)
        return self.endpoints[wid]

    async def forget(self, wid: str, why: str) -> None:
        """Route to replica `wid` no more and leave it out of weight syncs: the run goes on
        without it (an attached server that could not take the weights keeps serving its own
        traffic; a replica that could not be started again is gone with its node)."""
        import ray

        await self._unroute(wid)
        for replicas in (self.dedicated, self.serving, self.endpoints):
            if wid in replicas:
                with contextlib.suppress(Exception):  # already dead
                    ray.kill(replicas.pop(wid))
        if self.metrics_urls.pop(wid, None) is not None:
            write_prometheus_targets(self.targets_file, self.metrics_urls)
        self.restarts.append(f"{wid} {why}")

    async def register(self, wid: str, version: int | None = None) -> None:
        """Route to replica `wid` (in place of a dead one of the same name), which holds weights
        of `version` or later (None: the trainer's; its heartbeats say which from then on)."""
        handle = self.all()[wid]
        url = await handle.address.remote()
        if wid in self.serving or wid in self.endpoints:
            self.metrics_urls[wid] = url
            write_prometheus_targets(self.targets_file, self.metrics_urls)
        await self._route_to(self._device(wid, url), self.trainers.version if version is None else version)

    def _device(self, wid: str, url: str) -> Device:
        """Replica `wid`, whose lease API is at `url`, as the rollout manager routes to it."""
        r = self.config.rollout
        if wid in self.dedicated:
            key, kind, slots = self.server_limits.lease_key, WorkerKind.DEDICATED, r.dedicated_concurrency
            return Device(wid, url, key, kind, slots)
        key = self.config.serving.endpoint_key if wid in self.endpoints else self.server_limits.lease_key
        return Device(wid, url, key, WorkerKind.SERVING, r.serving_concurrency)

    async def _route_to(self, device: Device, version: int) -> None:
        """Route turns to `device` (in place of an earlier one of its name), which holds `version`."""
        await self._unroute(device.worker_id)
        self.registry.add(device.stream(), version)
        if self.shards is not None:
            await self.shards.route_to(device, version)

    async def _unroute(self, wid: str) -> None:
        await self.registry.drop(wid)
        if self.shards is not None:
            await self.shards.forget(wid)

    async def new_rl_step(self) -> None:
        """Tell every serving executor a new step begins: it may grow its rollout budget again."""
        for worker in list(self.registry.workers.values()):  # a replica may come back meanwhile
            if isinstance(worker, LeaseClient) and worker.kind is WorkerKind.SERVING:
                with contextlib.suppress(httpx.HTTPError, LeaseError):  # a dead executor has no budget
                    await worker.new_rl_step()

    async def close(self) -> None:
        import ray

        for worker in list(self.registry.workers.values()):
            await worker.close()
        for handle in self.all().values():
            ray.kill(handle)

    # -- weights --------------------------------------------------------------------------------

    async def sync(self, replicas: dict[str, Any], revive: bool = True) -> int:
        """Publish until every one of `replicas` holds the trainer's version (one that died
        meanwhile is started again, if `revive`); the payload bytes sent."""
        import ray

        sent, todo, errors = 0, dict(replicas), {}
        for _ in range(SYNC_ROUNDS):
            pulls = [h.sync_weights.remote(SYNC_TIMEOUT_S) for h in todo.values()]
            async with self._publishing:
                sent += await self.trainers.publish()
            got = await asyncio.gather(*(asyncio.wait_for(p, SYNC_TIMEOUT_S) for p in pulls),
                                       return_exceptions=True)
            errors = {wid: g for wid, g in zip(todo, got, strict=True)
                      if isinstance(g, BaseException) or g["version"] != self.trainers.version}
            for wid in [w for w, e in errors.items() if isinstance(e, ray.exceptions.RayActorError)]:
                if revive:
                    del errors[wid]
                    await self.revive_or_forget(wid)  # it syncs as it starts
            for wid in [w for w in errors if w in self.endpoints]:
                await self.forget(wid, f"({self.endpoint_urls[wid]}) detached: {errors.pop(wid)}")
            todo = {wid: todo[wid] for wid in errors}
            if not todo:
                return sent
        raise RuntimeError(f"weight sync: {', '.join(f'{w} ({e})' for w, e in errors.items())} did not take "
                           f"version {self.trainers.version} in {SYNC_ROUNDS} publishes")

    # -- faults: a replica died -------------------------------------------------------------------

    async def _dead(self, wid: str) -> bool:
        import ray

        try:
            await asyncio.wait_for(self.all()[wid].ready.remote(), self.registry.stall_timeout_s)
        except ray.exceptions.RayActorError:
            return True
        except (asyncio.TimeoutError, ray.exceptions.RayError):
            pass  # slow, not gone
        return False

    async def revive(self, wid: str) -> None:
        """Start replica `wid` again on its device, give it the current weights, route to it."""
        import ray

        old = self.all()[wid]
        if wid in self.endpoints:
            new = self.attach(wid, self.endpoint_urls[wid])
        else:
            start = self.start_serving if wid in self.serving else self.start_dedicated
            new = start(wid, self.cores[wid])
        with contextlib.suppress(Exception):
            ray.kill(old)
        try:  # then it has joined the relay group: the next publish includes it
            await asyncio.wait_for(new.ready.remote(), REVIVE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{wid} was not up {REVIVE_TIMEOUT_S:g} s after it was started again "
                               "(no node free to hold it?)") from None
        # Routed as of the version it is synced to: an asynchronous run trains meanwhile, and the
        # trainer's version may move on before it is registered (its heartbeats then catch up).
        version = self.trainers.version
        await self.sync({wid: new}, revive=False)
        await self.register(wid, version)
        if wid in self.serving:
            await new.start_replay.remote()
        self.restarts.append(f"{wid} restarted at version {self.trainers.version}")

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop` (a step's rollouts ended): a replica the registry gave up on whose actor
        has died is started again, so the step gets its capacity back. With a sharded control
        plane the driver's registry hears the replicas itself meanwhile (no rollout manager here
        ticks it)."""
        listen = asyncio.create_task(self.registry.listen()) if self.shards is not None else None
        try:
            await self._watch(stop)
        finally:
            if listen is not None:
                listen.cancel()
                await asyncio.gather(listen, return_exceptions=True)

    async def _watch(self, stop: asyncio.Event) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.registry.stall_timeout_s)
            if stop.is_set():
                return
            alive = set(self.registry.alive())
            reaped = [w for w in self.all()
                      if w in self.registry.workers and w not in alive and not w.startswith("elastic-")]
            for wid in reaped:
                if await self._dead(wid):
                    try:
                        await self.revive_or_forget(wid)
                    except Exception as exc:  # the step goes on without it; the weight sync tries again
                        self.restarts.append(f"{wid} could not be restarted: {exc!r}")

    async def revive_or_forget(self, wid: str) -> None:
        """Start dead replica `wid` again, or go on without it when no node can hold it (its
        node left the cluster); any other failure is raised."""
        try:
            await self.revive(wid)
        except (Unplaceable, TimeoutError) as exc:
            await self.forget(wid, f"could not be restarted, the run goes on without it: {exc}")

    # -- elastic devices --------------------------------------------------------------------------

    async def with_elastic(self, run: Awaitable[RolloutReport]) -> RolloutReport:
        """`run` (a step's rollouts) with the elastic devices provisioned meanwhile, then released."""
        provisions = [asyncio.create_task(self._provision(f"elastic-{i}", cores))
                      for i, cores in enumerate(self.config.devices.elastic)]
        try:
            return await run
        finally:
            for task in provisions:
                task.cancel()
            await asyncio.gather(*provisions, return_exceptions=True)
            await self._release_elastic()

    async def _provision(self, wid: str, cores: list[int]) -> None:
        """Allocate an on-demand device: wait for it, start it, sync it, then route to it."""
        start = time.perf_counter()
        try:
            await asyncio.sleep(self.config.devices.provision_delay_s)
            handle = self.start_dedicated(wid, cores)
            await handle.ready.remote()
            pulls = [h.sync_weights.remote(SYNC_TIMEOUT_S) for h in self.dedicated.values()]
            await self.trainers.leader.publish.remote()  # the current version again: a full copy for it
            await asyncio.gather(*pulls)
        except asyncio.CancelledError:
            self.elastic_cancelled_s.append(time.perf_counter() - start)
            raise
        await self._route_to(self._device(wid, await handle.address.remote()), self.trainers.version)
        self.elastic_alloc_s.append(time.perf_counter() - start)

    async def _release_elastic(self) -> None:
        import ray

        for wid in [w for w in self.dedicated if w.startswith("elastic-")]:
            handle = self.dedicated.pop(wid)
            self.cores.pop(wid, None)
            await self._unroute(wid)
            with contextlib.suppress(ray.exceptions.RayActorError):  # a dead one has left already
                await handle.leave.remote()
            ray.kill(handle)

    # -- serving measurements ---------------------------------------------------------------------

    def serving_results(self, since: float = 0.0, stop: bool = False) -> list[tuple[float, RequestResult]]:
        import ray

        results = []
        for handle in self.serving.values():
            try:
                results += ray.get(handle.serving_results.remote(since, stop), timeout=120)
            except ray.exceptions.RayError:
                continue  # a serving device that died keeps its measurements
        return results

    def pool_timelines(self, since: float = 0.0) -> dict[str, list[tuple[float, dict[str, float]]]]:
        """Each serving device's pool timeline from `since` (wall clock), by replica."""
        import ray

        timelines = {}
        for wid, handle in self.serving.items():
            with contextlib.suppress(ray.exceptions.RayError):  # a serving device that died has none
                timelines[wid] = ray.get(handle.pool_timeline.remote(since), timeout=120)
        return timelines


def write_prometheus_targets(path: Path, urls: dict[str, str]) -> None:
    """Prometheus file_sd targets, one group per serving device (a restarted one's new port
    replaces its old): written whole and renamed, as Prometheus may read it at any time."""
    groups = [{"targets": [url.removeprefix("http://")], "labels": {"job": "rose-serving", "replica": wid}}
              for wid, url in sorted(urls.items())]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups, indent=2) + "\n")
    os.replace(tmp, path)
