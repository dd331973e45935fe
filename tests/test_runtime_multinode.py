"""A run on a multi-node Ray cluster (three nodes on this machine, each with its own resources):
every role lands on the node that has what it asks for, and a role no node can hold is refused
before any actor starts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rose.runtime.cluster import Cluster
from rose.runtime.config import Mode, load_config, validate

ray = pytest.importorskip("ray")


@pytest.fixture
def three_nodes() -> Iterator[tuple[str, dict[str, str]]]:
    """A head with the trainer's resource, a rollout node and a serving node: the cluster's
    address and each role's node id."""
    from ray.cluster_utils import Cluster as RayCluster

    ray.shutdown()  # a local instance of an earlier test: this run joins the cluster instead
    nodes = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"trainer": 1}})
    try:
        rollout = nodes.add_node(num_cpus=1, resources={"rollout": 1})
        serving = nodes.add_node(num_cpus=1, resources={"serving": 1})
        nodes.wait_for_nodes()
        yield nodes.address, {"trainer": nodes.head_node.node_id, "dedicated": rollout.node_id,
                              "serving": serving.node_id}
    finally:
        ray.shutdown()
        nodes.shutdown()


ROLE_RESOURCES = ["devices.resources.trainer.trainer=1", "devices.resources.dedicated.rollout=1",
                  "devices.resources.serving.serving=1"]


@pytest.mark.slow
def test_each_role_lands_on_the_node_with_its_resources(three_nodes: tuple[str, dict[str, str]],
                                                         tmp_path: Path) -> None:
    address, node_of = three_nodes
    config = load_config(None, [f"ray_address={address}", "rollout.groups=2", "rollout.group_size=2",
                                f"train.out_dir={tmp_path}", *ROLE_RESOURCES])
    validate(config, Mode.ROSE)
    cluster = Cluster(config, Mode.ROSE, tmp_path)
    try:
        cluster.start()
        handles = {"trainer": cluster.trainers.leader, "dedicated": cluster.replicas.dedicated["dedicated-0"],
                   "serving": cluster.replicas.serving["serving-0"]}
        assert {role: ray.get(h.node_id.remote()) for role, h in handles.items()} == node_of
        report = cluster.rollout(0)
        metrics = cluster.train(report.trajectories)
        cluster.sync_weights()
        assert len(report.trajectories) == 4 and metrics["version"] == 1
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_a_role_no_node_can_hold_is_refused_before_anything_starts(three_nodes: tuple[str, dict[str, str]],
                                                                   tmp_path: Path) -> None:
    address, _ = three_nodes
    config = load_config(None, [f"ray_address={address}", f"train.out_dir={tmp_path}", *ROLE_RESOURCES,
                                "devices.resources.serving.accelerator=1"])
    cluster = Cluster(config, Mode.ROSE, tmp_path)
    try:
        with pytest.raises(ValueError, match=r"devices.serving: no node of the Ray cluster can hold a "
                                             r"serving actor .*lacks 1 accelerator \(it has 0\)"):
            cluster.start()
        assert not cluster.replicas.all() and not cluster.trainers.ranks
    finally:
        cluster.shutdown()
