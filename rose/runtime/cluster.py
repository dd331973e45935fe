"""The actors of one training run and what the driver asks of them.

`Cluster.start` initialises Ray (a local instance sized to this machine's cores, or
`ray_address`), writes the random-initialised checkpoints when no path is given, and starts the
trainer, the dedicated rollout workers and, in rose mode, the serving devices (each with its
HTTP server and its trace replay). In elastic mode `rollout` also provisions the elastic devices
on demand: each pays the configured provisioning delay plus its real start-up (process, model
load, a full weight sync) and is released when the step's rollouts end, as spot or serverless
capacity is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from rose.coserve.executor import ExecutorConfig
from rose.coserve.lease_client import LeaseError
from rose.coserve.loadgen import RequestResult
from rose.coserve.server import ServerLimits
from rose.engine import SamplingParams
from rose.model import init_model, load_tokenizer
from rose.rl import Episode, make_env, shard_by_group
from rose.rl.trainer import is_complete
from rose.rollout.manager import RolloutManager, RolloutReport
from rose.rollout.registry import WorkerRegistry
from rose.rollout.workers import LeaseWorker
from rose.runtime.actors import (
    ActorWorker,
    DedicatedWorkerActor,
    ServingDeviceActor,
    TrainerActor,
)
from rose.runtime.config import Config, Mode
from rose.runtime.devices import available_cores, init_ray, pinned
from rose.transfer import RayRelay

SYNC_TIMEOUT_S = 120.0
SYNC_ROUNDS = 3  # publishes per weight sync: a replica that missed one, or was just restarted, gets the next
TRAINER_RESTARTS = 1  # per call: a trainer that dies again right after a restart stops the run


@dataclasses.dataclass
class SyncReport:
    seconds: float
    payload_bytes: int


class Cluster:
    def __init__(self, config: Config, mode: Mode, out_dir: Path, resume: Path | None = None) -> None:
        self.config, self.mode, self.out_dir, self.resume = config, mode, out_dir, resume
        self.loop = asyncio.new_event_loop()  # one loop for every async call (HTTP clients live on it)
        self.registry = WorkerRegistry(config.rollout.stall_timeout_s)
        self.relay, self.group = f"rose-relay-{uuid.uuid4().hex[:8]}", "rollout"
        # The serving devices' HTTP APIs are locked with keys of this run's own: only its driver
        # leases turns and loads weights, only its trace replay sends serving requests.
        self.server_limits = ServerLimits(api_key=secrets.token_urlsafe(32),
                                          lease_key=secrets.token_urlsafe(32))
        self.trainers: list[Any] = []  # data-parallel ranks
        self.dedicated: dict[str, Any] = {}
        self.serving: dict[str, Any] = {}
        self.cores: dict[str, list[int]] = {}  # each replica's device, to start it again there
        self.checkpoints: list[Path] = []  # complete ones this run wrote, oldest first
        self.restarts: list[str] = []  # what died and how it came back, in order
        self.elastic_alloc_s: list[float] = []  # allocations that arrived: seconds from request to routable
        self.elastic_cancelled_s: list[float] = []  # still pending when a step's rollouts ended: time wasted
        self._pinned = contextlib.ExitStack()
        self._relay: RayRelay | None = None

    @property
    def trainer(self) -> Any:
        """Rank 0: it publishes the weights and writes the checkpoints."""
        return self.trainers[0]

    # -- start and stop -------------------------------------------------------------------------

    def start(self) -> None:
        import ray

        c = self.config
        # The driver (rollout manager, environments) and a local Ray's own processes, started from
        # here, belong to the training side: on the trainer's cores, never on a serving device's.
        self._pinned.enter_context(pinned(c.devices.trainer))
        if not ray.is_initialized():
            init_ray(c.ray_address, **({} if c.ray_address else {"num_cpus": len(available_cores())}))
        # Created here, the relay's directory belongs to the driver: it outlives any actor's death.
        self._relay = RayRelay(self.relay)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.model_path = str(self.resume or c.model.path or init_model(
            c.model.arch, c.model.preset, self.out_dir / "initial", seed=c.model.seed))
        self.tokenizer = load_tokenizer(self.model_path)
        starts = self.loop.run_until_complete(self._start_trainers(self.model_path))
        for i, cores in enumerate(c.devices.dedicated):
            self.cores[f"dedicated-{i}"] = cores
            self.dedicated[f"dedicated-{i}"] = self._start_dedicated(f"dedicated-{i}", cores)
        if self.mode is Mode.ROSE:
            self.serving_path = str(init_model(c.serving.arch, c.serving.preset,
                                               self.out_dir / "serving-model", seed=c.serving.seed))
            for i, cores in enumerate(c.devices.serving):
                self.cores[f"serving-{i}"] = cores
                self.serving[f"serving-{i}"] = self._start_serving(f"serving-{i}", cores)
        self.version = ray.get(starts)[0]
        for wid in self._replicas():
            self.loop.run_until_complete(self._register(wid))
        self.sync_weights()  # every replica gets the trainer's weights (a full copy) before step one
        for handle in self.serving.values():
            ray.get(handle.start_replay.remote())

    async def _start_trainers(self, path: str) -> list[Any]:
        """Start the ranks on checkpoint `path` (its optimizer state too, if it is one of ours);
        the refs of their `start` calls (each returns the version it starts from)."""
        import ray

        c = self.config
        trainer_cfg = {"lr": c.train.lr, "micro_batch_size": c.train.micro_batch_size,
                       "mini_batches": c.train.mini_batches, "min_lr_ratio": c.train.min_lr_ratio,
                       "lr_decay_steps": c.train.steps if c.train.lr_schedule == "cosine" else 0}
        # Data-parallel ranks share out the trainer's cores (all of them each, if too few).
        n, own = c.train.data_parallel, c.devices.trainer
        actor = ray.remote(TrainerActor).options(num_cpus=0)
        self.trainers = [actor.remote(own[r::n] if len(own) >= n else own) for r in range(n)]
        master = await self.trainer.address.remote() if n > 1 else None
        objective = {k: getattr(c.train, k) for k in ("scale_advantages", "step_advantage_weight",
                                                      "discount")}
        return [t.start.remote(path, c.train.objective, objective, trainer_cfg, self.relay, self.group,
                               is_complete(path), rank, n, master)
                for rank, t in enumerate(self.trainers)]

    def _start_dedicated(self, wid: str, cores: list[int]) -> Any:
        import ray

        engine = {"kv_cache_bytes": self.config.rollout.kv_cache_mb << 20}
        return ray.remote(DedicatedWorkerActor).options(num_cpus=0, max_concurrency=1000).remote(
            wid, cores, self.model_path, engine, self.relay, self.group)

    def _start_serving(self, wid: str, cores: list[int]) -> Any:
        import ray

        s = self.config.serving
        executor = ExecutorConfig(pool_bytes=s.pool_mb << 20, slo_ttft_ms=s.slo_ttft_ms,
                                  slo_tpot_ms=s.slo_tpot_ms, admission_quantile=s.admission_quantile,
                                  tpot_inflation=s.tpot_inflation, ttft_inflation=s.ttft_inflation,
                                  max_rollout_turns=self.config.rollout.serving_concurrency)
        return ray.remote(ServingDeviceActor).options(num_cpus=0).remote(
            wid, cores, self.serving_path, self.model_path, executor, s, self.relay, self.group,
            self.server_limits)

    def _replicas(self) -> dict[str, Any]:
        return {**self.dedicated, **self.serving}

    async def _register(self, wid: str) -> None:
        """Route to replica `wid` (in place of a dead one of the same name)."""
        handle, r = self._replicas()[wid], self.config.rollout
        if wid in self.serving:
            worker: Any = LeaseWorker(wid, await handle.address.remote(), r.serving_concurrency,
                                      key=self.server_limits.lease_key)
        else:
            await handle.ready.remote()
            worker = ActorWorker(wid, handle, r.dedicated_concurrency)
        old = self.registry.workers.get(wid)
        if old is not None:
            self.registry.remove(wid)
            await old.close()
        self.registry.add(worker, self.version)

    def shutdown(self) -> None:
        import ray

        for worker in self.registry.workers.values():
            self.loop.run_until_complete(worker.close())
        for handle in [*self.trainers, *self.dedicated.values(), *self.serving.values()]:
            ray.kill(handle)
        if self._relay is not None:
            self._relay.close()
        self.loop.close()
        self._pinned.close()

    # -- faults: the trainer or a replica died ---------------------------------------------------

    async def _on_trainers(self, call: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """The results of `call(ranks)` (one Ray call per rank). When a rank has died the trainer
        starts again from the newest complete checkpoint this run wrote (the run's starting
        point if none) and the call is made again on the new ranks: a step's trajectories are
        trained on, never dropped. A trainer that dies again at once stops the run."""
        import ray

        for restart in range(TRAINER_RESTARTS + 1):
            refs = call(self.trainers)
            try:
                return await asyncio.gather(*refs)  # fails as soon as one rank has died
            except ray.exceptions.RayActorError as exc:
                if restart == TRAINER_RESTARTS:
                    raise RuntimeError(
                        f"the trainer died again right after a restart ({exc.__class__.__name__}); the run "
                        f"stops at version {self.version}. Go on with: rose train --resume {self.out_dir}"
                    ) from exc
                await self._restart_trainers()
        raise AssertionError("unreachable")

    async def _restart_trainers(self) -> None:
        import ray

        for t in self.trainers:  # the surviving ranks wait in a collective for the dead one
            ray.kill(t)
        path = str(self.checkpoints[-1] if self.checkpoints else self.model_path)
        await asyncio.gather(*await self._start_trainers(path))
        # Weights go back to the checkpoint's; the version goes on, so versions only move forward.
        await asyncio.gather(*(t.set_version.remote(self.version) for t in self.trainers))
        self.restarts.append(f"trainer restarted from {path} at version {self.version}")

    async def _dead(self, wid: str) -> bool:
        import ray

        try:
            await asyncio.wait_for(self._replicas()[wid].ready.remote(), self.registry.stall_timeout_s)
        except ray.exceptions.RayActorError:
            return True
        except (asyncio.TimeoutError, ray.exceptions.RayError):
            pass  # slow, not gone
        return False

    async def _revive(self, wid: str) -> None:
        """Start replica `wid` again on its device, give it the current weights, route to it."""
        import ray

        start = self._start_serving if wid in self.serving else self._start_dedicated
        old, new = self._replicas()[wid], start(wid, self.cores[wid])
        with contextlib.suppress(Exception):
            ray.kill(old)
        (self.serving if wid in self.serving else self.dedicated)[wid] = new
        await new.ready.remote()  # it has joined the relay group: the next publish includes it
        await self._sync({wid: new}, revive=False)
        await self._register(wid)
        if wid in self.serving:
            await new.start_replay.remote()
        self.restarts.append(f"{wid} restarted at version {self.version}")

    async def _watch(self, stop: asyncio.Event) -> None:
        """While a step's rollouts run: a replica the registry gave up on whose actor has died is
        started again, so the step gets its capacity back."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.registry.stall_timeout_s)
            if stop.is_set():
                return
            alive = set(self.registry.alive())
            reaped = [w for w in self._replicas()
                      if w in self.registry.workers and w not in alive and not w.startswith("elastic-")]
            for wid in reaped:
                if await self._dead(wid):
                    try:
                        await self._revive(wid)
                    except Exception as exc:  # the step goes on without it; the weight sync tries again
                        self.restarts.append(f"{wid} could not be restarted: {exc!r}")

    # -- what the driver loop calls -------------------------------------------------------------

    def episodes(self, step: int) -> list[Episode]:
        c, r = self.config, self.config.rollout
        first = c.train.seed * 100003 + step * r.groups
        return [Episode(make_env(c.env.name, **c.env.options), self.tokenizer, seed=first + g,
                        group_id=(step, g), max_context_tokens=r.max_context_tokens)
                for g in range(r.groups) for _ in range(r.group_size)]

    def rollout(self, step: int) -> RolloutReport:
        r = self.config.rollout
        params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature,
                                stop_token_ids=tuple(self.tokenizer.stop_token_ids))
        manager = RolloutManager(self.registry, params, seed=self.config.train.seed * 7919 + step)
        return self.loop.run_until_complete(self._rollout(manager, step))

    async def _rollout(self, manager: RolloutManager, step: int) -> RolloutReport:
        for worker in self.registry.workers.values():
            if isinstance(worker, LeaseWorker):
                with contextlib.suppress(httpx.HTTPError, LeaseError):  # a dead executor has no budget
                    await worker.client.new_rl_step()  # the executor may grow its rollout budget again
        stop = asyncio.Event()
        watch = asyncio.create_task(self._watch(stop))
        try:
            run = manager.run(self.episodes(step), self.version, prefix=f"s{step}-",
                              timeout_s=self.config.rollout.timeout_s)
            if self.mode is not Mode.ELASTIC:
                return await run
            return await self._with_elastic(run)
        finally:
            stop.set()
            await watch  # a restart under way finishes: the replica is registered, not half started

    async def _with_elastic(self, run: Awaitable[RolloutReport]) -> RolloutReport:
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
            handle = self._start_dedicated(wid, cores)
            self.dedicated[wid] = handle
            await handle.ready.remote()
            pulls = [h.sync_weights.remote(SYNC_TIMEOUT_S) for h in self.dedicated.values()]
            await self.trainer.publish.remote()  # the current version again: a full copy for the newcomer
            await asyncio.gather(*pulls)
        except asyncio.CancelledError:
            self.elastic_cancelled_s.append(time.perf_counter() - start)
            raise
        self.registry.add(ActorWorker(wid, handle, self.config.rollout.dedicated_concurrency), self.version)
        self.elastic_alloc_s.append(time.perf_counter() - start)

    async def _release_elastic(self) -> None:
        import ray

        for wid in [w for w in self.dedicated if w.startswith("elastic-")]:
            handle = self.dedicated.pop(wid)
            self.registry.remove(wid)
            with contextlib.suppress(ray.exceptions.RayActorError):  # a dead one has left already
                await handle.leave.remote()
            ray.kill(handle)

    def train(self, trajectories: list) -> dict[str, float]:
        shards = shard_by_group(trajectories, len(self.trainers))
        metrics = self.loop.run_until_complete(self._on_trainers(
            lambda ranks: [t.step.remote(s) for t, s in zip(ranks, shards, strict=True)]))[0]
        self.version = int(metrics["version"])
        return metrics

    def sync_weights(self) -> SyncReport:
        """Publish the trainer's weights; every replica pulls and applies them."""
        start = time.perf_counter()
        sent = self.loop.run_until_complete(self._sync(self._replicas()))
        return SyncReport(time.perf_counter() - start, sent)

    async def _sync(self, replicas: dict[str, Any], revive: bool = True) -> int:
        """Publish until every one of `replicas` holds the trainer's version (one that died
        meanwhile is started again, if `revive`); the payload bytes sent."""
        import ray

        sent, todo, errors = 0, dict(replicas), {}
        for _ in range(SYNC_ROUNDS):
            pulls = [h.sync_weights.remote(SYNC_TIMEOUT_S) for h in todo.values()]
            report = (await self._on_trainers(lambda ranks: [ranks[0].publish.remote()]))[0]
            sent += int(report["payload_bytes"])
            got = await asyncio.gather(*(asyncio.wait_for(p, SYNC_TIMEOUT_S) for p in pulls),
                                       return_exceptions=True)
            errors = {wid: g for wid, g in zip(todo, got, strict=True)
                      if isinstance(g, BaseException) or g["version"] != self.version}
            for wid in [w for w, e in errors.items() if isinstance(e, ray.exceptions.RayActorError)]:
                if revive:
                    await self._revive(wid)  # it syncs as it starts
                    del errors[wid]
            todo = {wid: todo[wid] for wid in errors}
            if not todo:
                return sent
        raise RuntimeError(f"weight sync: {', '.join(f'{w} ({e})' for w, e in errors.items())} did not take "
                           f"version {self.version} in {SYNC_ROUNDS} publishes")

    def save(self, step: int) -> str:
        path = self.out_dir / f"step-{step}"
        self.loop.run_until_complete(self._on_trainers(lambda ranks: [ranks[0].save.remote(str(path))]))
        self.checkpoints.append(path)
        return str(path)

    def serving_results(self, since: float = 0.0, stop: bool = False) -> list[tuple[float, RequestResult]]:
        import ray

        results = []
        for handle in self.serving.values():
            try:
                results += ray.get(handle.serving_results.remote(since, stop), timeout=120)
            except ray.exceptions.RayError:
                continue  # a serving device that died keeps its measurements
        return results
