"""Placement by Ray resources: local mode pins to core ids; on a joined cluster each role asks
for CPUs, GPUs and its custom resources, and what no node could hold is refused up front."""

from __future__ import annotations

from pathlib import Path

import pytest

from rose.runtime.config import Mode, load_config, validate
from rose.runtime.placement import Demand, PlacementPolicy, check_placeable


def test_local_actors_ask_ray_for_nothing_and_pin_themselves() -> None:
    p = PlacementPolicy()
    assert p.options(p.demand("serving", [1], cuda=False)) == {"num_cpus": 0}


def test_on_a_cluster_an_actor_asks_for_its_cores_gpu_and_role_resources() -> None:
    p = PlacementPolicy(local=False, resources={"serving": {"serving": 1}})
    serving = p.demand("serving", [4, 5], cuda=True)
    assert p.options(serving) == {"num_cpus": 2, "num_gpus": 1, "resources": {"serving": 1}}
    assert serving.resources() == {"CPU": 2, "GPU": 1, "serving": 1}
    assert p.options(p.demand("trainer", [0], cuda=False)) == {"num_cpus": 1, "num_gpus": 0, "resources": {}}
    with pytest.raises(ValueError, match="no role 'router'; the roles are trainer, dedicated, serving"):
        p.demand("router", [0], cuda=False)


def test_an_actor_no_node_can_hold_is_refused_naming_what_is_missing() -> None:
    nodes = [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 2.0, "serving": 4.0}]
    check_placeable([Demand("trainer", 4, 1), Demand("serving", 2, 0, {"serving": 1})], nodes)
    with pytest.raises(ValueError, match=r"devices.serving: no node of the Ray cluster can hold a serving "
                                         r"actor \(2 CPU, 1 GPU, 1 serving\); the closest lacks 1 serving"):
        check_placeable([Demand("serving", 2, 1, {"serving": 1})], nodes)
    with pytest.raises(ValueError, match=r"lacks 1 rollout \(it has 0\)"):
        check_placeable([Demand("dedicated", 1, 0, {"rollout": 1})], nodes)


def test_more_than_the_cluster_has_in_all_is_refused() -> None:
    nodes = [{"CPU": 2.0}, {"CPU": 2.0}]
    check_placeable([Demand("trainer", 2), Demand("dedicated", 2)], nodes)
    with pytest.raises(ValueError, match=r"the run's actors \(dedicated, trainer\) ask for 6 CPU in all; the "
                                         r"Ray cluster's nodes have 4"):
        check_placeable([Demand("trainer", 2), Demand("dedicated", 2), Demand("dedicated", 2)], nodes)
    with pytest.raises(ValueError, match="the Ray cluster has no alive node"):
        check_placeable([Demand("trainer", 1)], [])


def test_core_ids_are_checked_against_this_machine_only_in_local_mode(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    far = ["devices.trainer=[64]", "devices.dedicated=[[65]]", "devices.serving=[[66,67]]"]
    with pytest.raises(ValueError, match=r"devices.trainer uses core\(s\) \[64\], but this machine has only"):
        validate(load_config(None, far), Mode.ROSE)
    joined = load_config(None, [*far, "ray_address=ray://head:10001", "devices.resources.serving.serving=1"])
    validate(joined, Mode.ROSE)  # on a cluster core lists count CPUs
    assert joined.devices.resources == {"serving": {"serving": 1.0}}
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    validate(load_config(None, far), Mode.ROSE)


@pytest.mark.parametrize("override, message", [
    ("devices.resources.router.gpu=1", "devices.resources: no role router; the roles are trainer, dedicated"),
    ("devices.resources.serving.serving=-1", r"devices.resources.serving: amounts must be finite and >= 0"),
])
def test_bad_role_resources(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate(load_config(None, [override]), Mode.ROSE)
