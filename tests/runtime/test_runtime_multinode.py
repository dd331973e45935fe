"""A run on a multi-node Ray cluster (three nodes on this machine, each with its own resources):
every role lands on the node that has what it asks for, a role no node can hold is refused
before any actor starts, and a node that leaves mid-step loses no trajectory."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faults import rollout_with_fault

from rose.runtime.cluster import Cluster
from rose.runtime.config import Mode, load_config, validate

ray = pytest.importorskip("ray")


@dataclasses.dataclass
class ThreeNodes:
    cluster: Any  # ray.cluster_utils.Cluster
    nodes: dict[str, Any]  # each role's node

    @property
    def node_ids(self) -> dict[str, str]:
        return {role: node.node_id for role, node in self.nodes.items()}


@pytest.fixture
def three_nodes() -> Iterator[ThreeNodes]:
    """A head with the trainer's resource, a rollout node and a serving node."""
    from ray.cluster_utils import Cluster as RayCluster

    ray.shutdown()  # a local instance of an earlier test: this run joins the cluster instead
    nodes = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"trainer": 1}})
    try:
        rollout = nodes.add_node(num_cpus=1, resources={"rollout": 1})
        serving = nodes.add_node(num_cpus=1, resources={"serving": 1})
        nodes.wait_for_nodes()
        yield ThreeNodes(nodes, {"trainer": nodes.head_node, "dedicated": rollout, "serving": serving})
    finally:
        ray.shutdown()
        nodes.shutdown()


ROLE_RESOURCES = ["devices.resources.trainer.trainer=1", "devices.resources.dedicated.rollout=1",
                  "devices.resources.serving.serving=1"]


@pytest.mark.slow
def test_each_role_lands_on_the_node_with_its_resources(three_nodes: ThreeNodes, tmp_path: Path) -> None:
    config = load_config(None, [f"ray_address={three_nodes.cluster.address}", "rollout.groups=2",
                                "rollout.group_size=2",
                                f"train.out_dir={tmp_path}", *ROLE_RESOURCES])
    validate(config, Mode.ROSE)
    cluster = Cluster(config, Mode.ROSE, tmp_path)
    try:
        cluster.start()
        handles = {"trainer": cluster.trainers.leader, "dedicated": cluster.replicas.dedicated["dedicated-0"],
                   "serving": cluster.replicas.serving["serving-0"]}
        assert {role: ray.get(h.node_id.remote()) for role, h in handles.items()} == three_nodes.node_ids
        # The relay's directory is on the driver's node (the head here): no other node's leaving
        # takes it down. (Ray's public state API needs the dashboard, which this cluster has not.)
        [directory] = [a for a in ray._private.state.actors().values()
                       if a["Name"] == cluster._relay_name and a["State"] == "ALIVE"]
        assert directory["Address"]["NodeID"] == three_nodes.node_ids["trainer"]
        report = cluster.rollout(0)
        metrics = cluster.train(report.trajectories)
        cluster.sync_weights()
        assert len(report.trajectories) == 4 and metrics["version"] == 1
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_a_role_no_node_can_hold_is_refused_before_anything_starts(three_nodes: ThreeNodes,
                                                                   tmp_path: Path) -> None:
    config = load_config(None, [f"ray_address={three_nodes.cluster.address}", f"train.out_dir={tmp_path}",
                                *ROLE_RESOURCES,
                                "devices.resources.serving.accelerator=1"])
    cluster = Cluster(config, Mode.ROSE, tmp_path)
    try:
        with pytest.raises(ValueError, match=r"devices.serving: no node of the Ray cluster can hold a "
                                             r"serving actor .*lacks 1 accelerator \(it has 0\)"):
            cluster.start()
        assert not cluster.replicas.all() and not cluster.trainers.ranks
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_a_node_removed_mid_step_loses_no_trajectory(three_nodes: ThreeNodes, tmp_path: Path) -> None:
    """The serving node leaves while its executor runs turns: they resume on the dedicated
    worker, the step ends with every trajectory, and the executor, which no node left can
    hold, is left out of routing and weight syncs instead of pending forever."""
    config = load_config(None, [f"ray_address={three_nodes.cluster.address}", "rollout.groups=2",
                                "rollout.group_size=4", "rollout.max_tokens=16",
                                "rollout.dedicated_concurrency=2", f"train.out_dir={tmp_path}",
                                *ROLE_RESOURCES])
    cluster = Cluster(config, Mode.ROSE, tmp_path)
    try:
        cluster.start()
        report = rollout_with_fault(cluster, 0, "serving-0",
                                    lambda: three_nodes.cluster.remove_node(three_nodes.nodes["serving"]))
        assert report.lost_trajectories == 0 and len(report.trajectories) == 8
        assert any(p.worker_id == "serving-0" and p.outcome == "lost" for p in report.placements)
        assert cluster.train(report.trajectories)["sequences"] > 0
        cluster.sync_weights()  # the dead executor is found, cannot be placed, and is left out
        assert "serving-0" not in cluster.replicas.all() and "serving-0" not in cluster.registry.workers
        assert any(line.startswith("serving-0 could not be restarted, the run goes on without it: "
                                   "devices.serving: no node of the Ray cluster can hold a serving actor")
                   for line in cluster.restarts), cluster.restarts
        later = cluster.rollout(1)  # the next step runs on what is left
        assert later.lost_trajectories == 0 and len(later.trajectories) == 8
        assert {p.worker_id for p in later.placements} == {"dedicated-0"}
    finally:
        cluster.shutdown()
