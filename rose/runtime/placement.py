"""Where the actors of a run go: pure decisions over plain data, applied by the runtime.

Local mode (the default: a Ray instance the run starts on this machine): an actor asks Ray for
nothing (`num_cpus=0`) and pins itself to its device's core ids, which `validate` checked
against this machine. On a cluster the run joins (`--address`, `ray_address`, `$RAY_ADDRESS`)
core ids name nothing on another host: an actor asks for as many CPUs as its device has cores,
one GPU when its device is CUDA, and the custom resources its role names in
`devices.resources` (e.g. `{serving: {serving: 1}}` for serving nodes started with
`ray start --resources '{"serving": 8}'`); Ray puts it on a node that has them, and it does not
pin. An actor that no node of the cluster could hold is refused before anything starts, with
what is missing named (Ray itself would leave it pending for ever).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("trainer", "dedicated", "serving", "elastic", "shard")


@dataclasses.dataclass(frozen=True)
class Demand:
    """What one actor of `role` asks of the node it runs on."""

    role: str
    cpus: int
    gpus: int = 0
    custom: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def resources(self) -> dict[str, float]:
        """In Ray's names (`CPU`, `GPU`, custom), the nonzero ones: a placement group's bundle."""
        return {k: v for k, v in {"CPU": self.cpus, "GPU": self.gpus, **self.custom}.items() if v}

    def options(self) -> dict[str, Any]:
        """`ray.remote(...).options(**these)`."""
        return {"num_cpus": self.cpus, "num_gpus": self.gpus, "resources": dict(self.custom)}

    def lacks(self, node: Mapping[str, float]) -> list[str]:
        """What `node` (its total resources) has too little of for this actor, in words."""
        return [f"{amount:g} {name} (it has {node.get(name, 0):g})"
                for name, amount in self.resources().items() if node.get(name, 0) < amount]


@dataclasses.dataclass(frozen=True)
class PlacementPolicy:
    """How this run places its actors: `local`, or on a joined cluster with `resources`, each
    role's custom Ray resources."""

    local: bool = True
    resources: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)

    def demand(self, role: str, cores: Sequence[int], cuda: bool) -> Demand:
        """An actor of `role` on a device of `cores` (a count of CPUs on a cluster)."""
        if role not in ROLES:
            raise ValueError(f"no role {role!r}; the roles are {', '.join(ROLES)}")
        return Demand(role, len(cores), 1 if cuda else 0, dict(self.resources.get(role, {})))

    def options(self, demand: Demand) -> dict[str, Any]:
        """The Ray options of an actor with `demand`: none in local mode, where it pins itself."""
        return {"num_cpus": 0} if self.local else demand.options()


class Unplaceable(ValueError):
    """No alive node of the cluster can hold what the run asks for."""


def check_placeable(demands: Sequence[Demand], nodes: Sequence[Mapping[str, float]]) -> None:
    """`Unplaceable` naming what is missing when the cluster's alive `nodes` (each one's total
    resources) cannot hold the actors: one that fits on no node, or more of a resource asked
    for in all than the nodes have together. Only certain failures: a set that passes may still
    wait for resources that other jobs hold."""
    if not nodes:
        raise Unplaceable("the Ray cluster has no alive node")
    for d in demands:
        if all(d.lacks(node) for node in nodes):
            closest = min(nodes, key=lambda node: len(d.lacks(node)))
            raise Unplaceable(f"devices.{d.role}: no node of the Ray cluster can hold a {d.role} actor "
                             f"({_words(d.resources())}); the closest lacks {', '.join(d.lacks(closest))}. "
                             f"Start a node with those resources (`ray start --num-cpus N --num-gpus N "
                             f"--resources JSON`) or ask for less (devices.{d.role}, devices.resources)")
    total: dict[str, float] = {}
    for d in demands:
        for name, amount in d.resources().items():
            total[name] = total.get(name, 0) + amount
    for name, amount in total.items():
        have = sum(node.get(name, 0) for node in nodes)
        if have < amount:
            roles = sorted({d.role for d in demands if d.resources().get(name)})
            raise Unplaceable(f"the run's actors ({', '.join(roles)}) ask for {amount:g} {name} in all; "
                             f"the Ray cluster's nodes have {have:g}")


def _words(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items()) or "nothing"
