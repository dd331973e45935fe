"""Kill a dedicated rollout worker, and separately a co-serving executor, in the middle of a
step: the step completes, every trajectory comes back whole (lost_trajectories 0)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rose.runtime.cluster import Cluster
from rose.runtime.config import Mode, load_config

ray = pytest.importorskip("ray")


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["dedicated-0", "serving-0"])
def test_a_step_survives_a_killed_worker(victim: str, tmp_path: Path) -> None:
    config = load_config(None, ["rollout.groups=4", "rollout.group_size=4", "rollout.max_tokens=16",
                                "rollout.dedicated_concurrency=8", "rollout.serving_concurrency=8",
                                f"train.out_dir={tmp_path}"])
    cluster = Cluster(config, Mode.ROSE, tmp_path)
    cluster.start()
    try:
        handle = {**cluster.dedicated, **cluster.serving}[victim]
        killer = threading.Timer(1.0, lambda: ray.kill(handle))
        killer.start()
        report = cluster.rollout(0)
        killer.join()
        assert report.lost_trajectories == 0 and len(report.trajectories) == 16
        assert all(t.done or t.truncated for t in report.trajectories)
        assert any(p.worker_id == victim for p in report.placements)  # it did run turns before
        metrics = cluster.train(report.trajectories)
        assert metrics["sequences"] > 0
    finally:
        cluster.dedicated.pop(victim, None)
        cluster.serving.pop(victim, None)
        cluster.shutdown()
