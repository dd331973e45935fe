"""The sharded control plane (`rollout.shards`): each shard a Ray actor in a process of its own,
playing its share of the groups and routing to every device; the trainer gets one batch of
groups, synchronous or asynchronous; a shard killed mid-step is started again and plays its
share again, with no trajectory lost and none twice."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rose.contracts import WorkerKind
from rose.rl import Trajectory
from rose.rollout.manager import Placement, RolloutReport, Unfinished
from rose.runtime.cluster import Cluster
from rose.runtime.config import Mode, load_config
from rose.runtime.driver import train
from rose.runtime.rollouts import RolloutContext
from rose.runtime.shards import merge, slot_share

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("slots,shards", [(16, 1), (16, 3), (7, 2), (8, 8)])
def test_the_shards_split_each_devices_slots(slots: int, shards: int) -> None:
    shares = [slot_share(slots, k, shards) for k in range(shards)]
    assert sum(shares) == slots and max(shares) - min(shares) <= 1


def test_a_device_with_fewer_slots_than_shards_gives_each_one() -> None:
    assert [slot_share(2, k, 3) for k in range(3)] == [1, 1, 1]


def test_the_shards_partition_the_groups_and_name_them_apart() -> None:
    config = load_config(None, ["rollout.groups=7"])
    ctxs = [RolloutContext(config, 0, 0, None, None, k, 3) for k in range(3)]  # type: ignore[arg-type]
    assert sorted(g for c in ctxs for g in c.mine(7)) == list(range(7))
    assert len({c.prefix("s0-") for c in ctxs}) == 3
    assert RolloutContext(config, 0, 0, None, None).prefix("s0-") == "s0-"  # type: ignore[arg-type]


def test_a_step_is_its_shards_reports_together() -> None:
    def report(group: int, seconds: float) -> RolloutReport:
        placement = Placement(f"t{group}", 0, 0, "w", WorkerKind.SERVING.value, 0.0, seconds, 3, "done")
        return RolloutReport([Trajectory(group)], [placement], seconds, [Unfinished(f"f{group}", 1, "x")])

    step = merge([report(0, 2.0), report(1, 5.0)])
    assert [t.group_id for t in step.trajectories] == [0, 1] and step.seconds == 5.0
    assert len(step.placements) == 2 and len(step.failed) == 2 and step.lost == []


def _config(tmp_path: Path, *more: str):  # type: ignore[no-untyped-def]
    return load_config(None, ["rollout.groups=4", "rollout.group_size=4", "rollout.max_tokens=16",
                              "rollout.dedicated_concurrency=8", "rollout.serving_concurrency=8",
                              "rollout.shards=2", f"train.out_dir={tmp_path}", *more])


def test_a_sharded_step_survives_a_killed_shard(tmp_path: Path) -> None:
    cluster = Cluster(_config(tmp_path), Mode.ROSE, tmp_path)
    try:
        cluster.start()
        assert cluster.shards is not None
        first = cluster.rollout(0)  # every shard plays its groups, on every device
        assert first.lost_trajectories == 0 and len(first.trajectories) == 16
        assert sorted({t.group_id for t in first.trajectories}) == [(0, 0, g) for g in range(4)]
        assert {p.worker_id for p in first.placements} == {"dedicated-0", "serving-0"}
        assert {p.trajectory_id.split(".")[0] for p in first.placements} == {"s0-k0", "s0-k1"}
        victim = cluster.shards.handles[1]
        # Early in the step (which takes seconds): the shard dies with turns in flight, or before
        # its call arrives; either way the step needs its successor.
        killer = threading.Timer(0.3, lambda: ray.kill(victim))
        killer.start()
        second = cluster.rollout(1)
        killer.join()
        # Shard 1 was started again and played its groups again: each group once, whole.
        assert any(line.startswith("shard-1 restarted") for line in cluster.restarts), cluster.restarts
        assert second.lost_trajectories == 0 and len(second.trajectories) == 16
        groups = [t.group_id for t in second.trajectories]
        assert sorted(set(groups)) == [(1, 0, g) for g in range(4)]
        assert all(groups.count(g) == 4 for g in groups)
        assert all(t.done or t.truncated for t in second.trajectories)
        assert cluster.train(second.trajectories)["sequences"] > 0
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_asynchronous_rl_takes_one_stream_of_groups_from_the_shards(tmp_path: Path) -> None:
    config = _config(tmp_path, "train.steps=3", "rollout.max_tokens=8", "train.max_staleness=1")
    result = train(config, Mode.FIXED)
    assert [r.version for r in result.steps] == [1, 2, 3]
    assert result.summary["lost_trajectories"] == 0 and result.summary["failed_trajectories"] == 0
    groups = result.summary["stream_groups"]
    assert groups["taken"] == 3 * 4 and groups["started"] == sum(groups[k] for k in (
        "taken", "dropped", "expired", "in_play"))


@pytest.mark.slow
def test_an_asynchronous_shard_killed_between_steps_is_replaced_and_plays_on(tmp_path: Path) -> None:
    cluster = Cluster(_config(tmp_path, "train.steps=3", "rollout.max_tokens=8", "train.max_staleness=1"),
                      Mode.FIXED, tmp_path)
    try:
        cluster.start()
        assert cluster.shards is not None
        first = cluster.rollout(0)
        cluster.train(first.trajectories)
        cluster.sync_weights()
        ray.kill(cluster.shards.handles[1])  # its groups in play die with it
        second = cluster.rollout(1)
        assert any(line.startswith("shard-1 restarted") for line in cluster.restarts), cluster.restarts
        for report in (first, second):
            groups = [t.group_id for t in report.trajectories]
            assert len(set(groups)) == 4 and all(groups.count(g) == 4 for g in groups)
        # The successor went on from the first group its predecessor had not handed to a step:
        # no group trained twice.
        assert not {t.group_id for t in first.trajectories} & {t.group_id for t in second.trajectories}
    finally:
        cluster.shutdown()
