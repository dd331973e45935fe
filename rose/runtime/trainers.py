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
from rose.runtime.checkpoints import Checkpoint, written_at
from rose.runtime.config import Config, objective_options, rank_device, trainer_options
from rose.runtime.placement import Demand, PlacementPolicy

RESTARTS = 1  # per call: a trainer that dies again right after a restart stops the run
PLACEMENT_TIMEOUT_S = 120.0  # for the ranks' placement group on a cluster: then a clear error, not a hang


def rank_cores(cores: list[int], rank: int, world: int) -> list[int]:
    """Data-parallel rank `rank`'s share of the trainer's cores (all of them, if too few)."""
    return cores[rank::world] if len(cores) >= world else cores


class TrainerGroup:
    def __init__(self, config: Config, relay: str, group: str, out_dir: Path, restarts: list[str],
                 placement: PlacementPolicy) -> None:
        self.config, self.relay, self.group, self.out_dir = config, relay, group, out_dir
        self.placement = placement
        self.bundles: Any = None  # the ranks' placement group, on a cluster
        self.restarts = restarts  # the run's log of what died and came back, shared
        self.ranks: list[Any] = []
        self.version = self.steps = 0  # the weights' version, the optimizer steps taken (Trainer's)
        self.first_checkpoint: Checkpoint = ""  # the one the run started from
        self.checkpoints: list[Path] = []  # complete ones this run wrote, oldest first

    @property
    def leader(self) -> Any:
        """Rank 0."""
        return self.ranks[0]

    async def launch(self, checkpoint: Checkpoint) -> list[Any]:
        """Start the ranks on `checkpoint` (its optimizer state too, if it is one of ours); the
        refs of their `start` calls, each resolving to the version it starts from (the caller
        starts the rollout replicas meanwhile, then sets `version` and `steps`)."""
        import ray

        self.first_checkpoint = self.first_checkpoint or checkpoint
        c, p = self.config, self.placement
        n, local = c.train.data_parallel, p.local
        devices = [rank_device(c.train.device, rank, n, local) for rank in range(n)]
        cores = [rank_cores(c.devices.trainer, rank, n) for rank in range(n)]
        demands = [p.demand("trainer", cores[r], devices[r].startswith("cuda")) for r in range(n)]
        # On a cluster the ranks are placed together, or not at all.
        options = [p.options(d) for d in demands] if local else await self._bundle(demands)
        self.ranks = [ray.remote(TrainerActor).options(**options[r]).remote(cores[r], r, n, local)
                      for r in range(n)]
        master = await self.leader.address.remote() if n > 1 else None
        objective = objective_options(c)
        return [t.start.remote(checkpoint, c.train.objective, objective,
                               {**trainer_options(c), "device": devices[rank]}, self.relay, self.group,
                               is_complete(written_at(checkpoint)), rank, n, master)
                for rank, t in enumerate(self.ranks)]

    async def _bundle(self, demands: list[Demand]) -> list[dict[str, Any]]:
        """The ranks' Ray options, each in its bundle of one placement group, once Ray has
        reserved it; a ValueError naming what was asked if it cannot within the timeout."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._unbundle()
        bundles = [d.resources() for d in demands]
        self.bundles = placement_group(bundles, strategy="PACK")
        try:
            await asyncio.wait_for(self.bundles.ready(), PLACEMENT_TIMEOUT_S)
        except TimeoutError:
            self._unbundle()
            raise ValueError(f"devices.trainer: the Ray cluster did not place the trainer's ranks {bundles} "
                             f"within {PLACEMENT_TIMEOUT_S:g} s") from None
        return [{**d.options(), "scheduling_strategy": PlacementGroupSchedulingStrategy(self.bundles, r)}
                for r, d in enumerate(demands)]

    def _unbundle(self) -> None:
        if self.bundles is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.bundles)
            self.bundles = None

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
        # The newest checkpoint this run wrote is on the trainer's node (rose/runtime/checkpoints.py).
        checkpoint = str(self.checkpoints[-1]) if self.checkpoints else self.first_checkpoint
        restored, _ = (await asyncio.gather(*await self.launch(checkpoint)))[0]
        # Weights rolled back to an older checkpoint take a version of their own (the newer
        # tokens then lag behind them); the steps, and with them the schedule, go on.
        if restored != self.version:
            self.version += 1
        await asyncio.gather(*(t.renumber.remote(self.version, self.steps) for t in self.ranks))
        self.restarts.append(f"trainer restarted from {written_at(checkpoint)} (version {restored}): its "
                             f"weights are version {self.version}, at step {self.steps}")

    async def train(self, trajectories: list) -> dict[str, float]:
        """One optimizer step over the trajectories, whole GRPO groups per rank; rank 0's metrics."""
        shards = shard_by_group(trajectories, len(self.ranks))
        metrics = (await self.call(
            lambda ranks: [t.step.remote(s) for t, s in zip(ranks, shards, strict=True)]))[0]
        self.version, self.steps = int(metrics["version"]), int(metrics["steps"])
        return metrics

    async def publish(self) -> int:
        """Rank 0 sends its current weights through the relay; the payload bytes."""
        report = (await self.call(lambda ranks: [ranks[0].publish.remote()]))[0]
        return int(report["payload_bytes"])

    async def save(self, path: Path) -> None:
        await self.call(lambda ranks: [t.save.remote(str(path)) for t in ranks])  # rank 0 writes
        self.checkpoints.append(path)

    def kill(self) -> None:
        import ray

        for t in self.ranks:
            ray.kill(t)
        self._unbundle()
