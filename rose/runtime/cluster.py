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
import time
import uuid
from pathlib import Path
from typing import Any

from rose.coserve.executor import ExecutorConfig
from rose.coserve.loadgen import RequestResult
from rose.engine import SamplingParams
from rose.model import init_model, load_tokenizer
from rose.rl import Episode, make_env, shard_by_group
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

SYNC_TIMEOUT_S = 120.0


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
        self.trainers: list[Any] = []  # data-parallel ranks
        self.dedicated: dict[str, Any] = {}
        self.serving: dict[str, Any] = {}
        self.elastic_alloc_s: list[float] = []  # allocations that arrived: seconds from request to routable
        self.elastic_cancelled_s: list[float] = []  # still pending when a step's rollouts ended: time wasted
        self._pinned = contextlib.ExitStack()

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
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.model_path = str(self.resume or c.model.path or init_model(
            c.model.arch, c.model.preset, self.out_dir / "initial", seed=c.model.seed))
        self.tokenizer = load_tokenizer(self.model_path)
        trainer_cfg = {"lr": c.train.lr, "micro_batch_size": c.train.micro_batch_size,
                       "mini_batches": c.train.mini_batches, "min_lr_ratio": c.train.min_lr_ratio,
                       "lr_decay_steps": c.train.steps if c.train.lr_schedule == "cosine" else 0}
        # Data-parallel ranks share out the trainer's cores (all of them each, if too few).
        n, own = c.train.data_parallel, c.devices.trainer
        actor = ray.remote(TrainerActor).options(num_cpus=0)
        self.trainers = [actor.remote(own[r::n] if len(own) >= n else own) for r in range(n)]
        master = ray.get(self.trainer.address.remote()) if n > 1 else None
        objective = {k: getattr(c.train, k) for k in ("scale_advantages", "step_advantage_weight",
                                                      "discount")}
        starts = [t.start.remote(self.model_path, c.train.objective, objective, trainer_cfg, self.relay,
                                 self.group, self.resume is not None, rank, n, master)
                  for rank, t in enumerate(self.trainers)]
        for i, cores in enumerate(c.devices.dedicated):
            self.dedicated[f"dedicated-{i}"] = self._start_dedicated(f"dedicated-{i}", cores)
        if self.mode is Mode.ROSE:
            serving_path = str(init_model(c.serving.arch, c.serving.preset, self.out_dir / "serving-model",
                                          seed=c.serving.seed))
            s = c.serving
            executor = ExecutorConfig(pool_bytes=s.pool_mb << 20, slo_ttft_ms=s.slo_ttft_ms,
                                      slo_tpot_ms=s.slo_tpot_ms,
                                      max_rollout_turns=c.rollout.serving_concurrency)
            for i, cores in enumerate(c.devices.serving):
                wid = f"serving-{i}"
                self.serving[wid] = ray.remote(ServingDeviceActor).options(num_cpus=0).remote(
                    wid, cores, serving_path, self.model_path, executor, s, self.relay, self.group)
        self.version = ray.get(starts)[0]
        for wid, handle in self.dedicated.items():
            ray.get(handle.ready.remote())
            self.registry.add(ActorWorker(wid, handle, c.rollout.dedicated_concurrency), self.version)
        for wid, handle in self.serving.items():
            url = ray.get(handle.address.remote())
            self.registry.add(LeaseWorker(wid, url, c.rollout.serving_concurrency), self.version)
        self.sync_weights()  # every replica gets the trainer's weights (a full copy) before step one
        for handle in self.serving.values():
            ray.get(handle.start_replay.remote())

    def _start_dedicated(self, wid: str, cores: list[int]) -> Any:
        import ray

        engine = {"kv_cache_bytes": self.config.rollout.kv_cache_mb << 20}
        return ray.remote(DedicatedWorkerActor).options(num_cpus=0, max_concurrency=1000).remote(
            wid, cores, self.model_path, engine, self.relay, self.group)

    def shutdown(self) -> None:
        import ray

        for worker in self.registry.workers.values():
            self.loop.run_until_complete(worker.close())
        for handle in [*self.trainers, *self.dedicated.values(), *self.serving.values()]:
            ray.kill(handle)
        self.loop.close()
        self._pinned.close()

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
                await worker.client.new_rl_step()  # the executor may grow its rollout budget again
        run = manager.run(self.episodes(step), self.version, prefix=f"s{step}-",
                          timeout_s=self.config.rollout.timeout_s)
        if self.mode is not Mode.ELASTIC:
            return await run
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
            try:
                await handle.leave.remote()
            finally:
                ray.kill(handle)

    def train(self, trajectories: list) -> dict[str, float]:
        import ray

        shards = shard_by_group(trajectories, len(self.trainers))
        metrics = ray.get([t.step.remote(s) for t, s in zip(self.trainers, shards, strict=True)])[0]
        self.version = int(metrics["version"])
        return metrics

    def sync_weights(self) -> SyncReport:
        """Publish the trainer's weights; every replica pulls and applies them."""
        import ray

        start = time.perf_counter()
        replicas = [*self.dedicated.values(), *self.serving.values()]
        pulls = [h.sync_weights.remote(SYNC_TIMEOUT_S) for h in replicas]
        sent = ray.get(self.trainer.publish.remote())
        ray.get(pulls, timeout=SYNC_TIMEOUT_S)
        return SyncReport(time.perf_counter() - start, int(sent["payload_bytes"]))

    def save(self, step: int) -> str:
        import ray

        return ray.get(self.trainer.save.remote(str(self.out_dir / f"step-{step}")))

    def serving_results(self, since: float = 0.0, stop: bool = False) -> list[tuple[float, RequestResult]]:
        import ray

        results = []
        for handle in self.serving.values():
            try:
                results += ray.get(handle.serving_results.remote(since, stop), timeout=120)
            except ray.exceptions.RayError:
                continue  # a serving device that died keeps its measurements
        return results
