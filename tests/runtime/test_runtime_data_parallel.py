"""The trainer as two data-parallel Ray actors (gloo), replicated (DDP) or sharded (FSDP2): each
steps on its share of the groups and both end each step with the same weights, which rank 0
publishes to the rollout replicas and writes to checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from rose.rl.trainer import is_complete
from rose.runtime.cluster import Cluster
from rose.runtime.config import Mode, load_config

ray = pytest.importorskip("ray")


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_trainer_ranks_step_in_lockstep(tmp_path: Path, sharding: str) -> None:
    config = load_config(None, ["train.data_parallel=2", f"train.sharding={sharding}", "rollout.groups=4",
                                "rollout.group_size=4", f"train.out_dir={tmp_path}"])
    cluster = Cluster(config, Mode.FIXED, tmp_path)
    try:
        cluster.start()
        assert len(cluster.trainers.ranks) == 2
        before = ray.get(cluster.trainers.leader.digests.remote())
        for step in range(2):
            metrics = cluster.train(cluster.rollout(step).trajectories)
            # Metrics cover the whole batch, not rank 0's half of it.
            assert metrics["version"] == step + 1 and metrics["groups"] == 4 and metrics["sequences"] > 0
            digests = ray.get([t.digests.remote() for t in cluster.trainers.ranks])
            assert digests[0] == digests[1] != before
            cluster.sync_weights()
        assert is_complete(cluster.save(2))
    finally:
        cluster.shutdown()
