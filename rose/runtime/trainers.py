"""The trainer's data-parallel ranks, as one group that outlives the death of any rank.

Rank 0 publishes the weights and writes the checkpoints. Every call goes through `call`: when a
rank has died, the group starts again from the newest complete checkpoint this run wrote (the
run's starting point if none) and the call is made again on the new ranks, so a step's
trajectories are trained on, never dropped. A group that dies again at once stops the run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rose.rl import shard_by_group
from rose.rl.trainer import is_complete
from rose.runtime.actors import TrainerActor
from rose.runtime.config import Config, objective_options, rank_device, trainer_options

RESTARTS = 1  # per call: a trainer that dies again right after a restart stops the run


class TrainerGroup:
    def __init__(self, config: Config, relay: str, group: str, out_dir: Path, restarts: list[str]) -> None:
        self.config, self.relay, self.group, self.out_dir = config, relay, group, out_dir
        self.restarts = restarts  # the run's log of what died and came back, shared
        self.ranks: list[Any] = []
        self.version = 0
        self.start_path = ""  # the checkpoint the run started from
        self.checkpoints: list[Path] = []  # complete ones this run wrote, oldest first

    @property
    def leader(self) -> Any:
        """Rank 0."""
        return self.ranks[0]

    async def launch(self, path: str) -> list[Any]:
        """Start the ranks on checkpoint `path` (its optimizer state too, if it is one of ours);
        the refs of their `start` calls, each resolving to the version it starts from (the
        caller starts the rollout replicas meanwhile, then sets `version`)."""
        import ray

        self.start_path = self.start_path or path
        c = self.config
        # Data-parallel ranks share out the trainer's cores (all of them each, if too few).
        n, own = c.train.data_parallel, c.devices.trainer
        actor = ray.remote(TrainerActor).options(num_cpus=0)
        self.ranks = [actor.remote(own[r::n] if len(own) >= n else own, r, n) for r in range(n)]
        master = await self.leader.address.remote() if n > 1 else None
        objective = objective_options(c)
        return [t.start.remote(path, c.train.objective, objective,
                               {**trainer_options(c), "device": rank_device(c.train.device, rank, n)},
                               self.relay, self.group, is_complete(path), rank, n, master)
                for rank, t in enumerate(self.ranks)]

    async def call(self, call: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """The results of `call(ranks)` (one Ray call per rank), made again on new ranks after a
        restart when a rank has died."""
        import ray

        for restart in range(RESTARTS + 1):
            refs = call(self.ranks)
            try:
                return await asyncio.gather(*refs)  # fails as soon as one rank has died
            except ray.exceptions.RayActorError as exc:
                if restart == RESTARTS:
                    raise RuntimeError(
                        f"the trainer died again right after a restart ({exc.__class__.__name__}); the run "
                        f"stops at version {self.version}. Go on with: rose train --resume {self.out_dir}"
                    ) from exc
                await self._restart()
        raise AssertionError("unreachable")

    async def _restart(self) -> None:
        import ray

        for t in self.ranks:  # the surviving ranks wait in a collective for the dead one
            ray.kill(t)
        path = str(self.checkpoints[-1] if self.checkpoints else self.start_path)
        await asyncio.gather(*await self.launch(path))
        # Weights go back to the checkpoint's; the version goes on, so versions only move forward.
        await asyncio.gather(*(t.set_version.remote(self.version) for t in self.ranks))
        self.restarts.append(f"trainer restarted from {path} at version {self.version}")

    async def train(self, trajectories: list) -> dict[str, float]:
        """One optimizer step over the trajectories, whole GRPO groups per rank; rank 0's metrics."""
        shards = shard_by_group(trajectories, len(self.ranks))
        metrics = (await self.call(
            lambda ranks: [t.step.remote(s) for t, s in zip(ranks, shards, strict=True)]))[0]
        self.version = int(metrics["version"])
        return metrics

    async def publish(self) -> int:
        """Rank 0 sends its current weights through the relay; the payload bytes."""
        report = (await self.call(lambda ranks: [ranks[0].publish.remote()]))[0]
        return int(report["payload_bytes"])

    async def save(self, path: Path) -> None:
        await self.call(lambda ranks: [ranks[0].save.remote(str(path))])
        self.checkpoints.append(path)

    def kill(self) -> None:
        import ray

        for t in self.ranks:
            ray.kill(t)
