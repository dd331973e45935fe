"""The systems compared: one simulation core, these policy differences.

Each system is a small record of choices the engine consults: whether training and rollout
share the dedicated GPUs (synchronous, colocated) or overlap on a split (asynchronous), which
extra capacity rollouts may use (none, rented GPUs, serverless functions, or serving GPUs)
and how that capacity is shared, and how weights reach it.
"""

from __future__ import annotations

import dataclasses
import enum


class Extra(enum.Enum):
    NONE = "none"
    SPOT = "spot"                # rented preemptible GPUs, per step (RLBoost-style)
    SERVERLESS = "serverless"    # serverless GPU functions, per step
    COSERVE = "coserve"          # serving GPUs, turn by turn (ROSE)


class Sharing(enum.Enum):
    """How rollouts share a serving GPU."""

    ROSE = "rose"      # dual-SLO admission, serving prefill first, headroom + burst state machine
    NAIVE = "naive"    # rollouts admitted whenever pages allow; no priority, no headroom
    # the executor's `static` policy: a fixed share of the pool and a fixed number of rollout
    # tokens in every iteration, whatever serving needs
    STATIC = "static"


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    label: str
    colocated: bool = True                 # rollout on the training GPUs (sync: then train)
    staleness: int = 0                     # async: rollout may run this many versions ahead
    extra: Extra = Extra.NONE
    sharing: Sharing = Sharing.ROSE
    affinity: bool = True                  # cache-affinity routing (prefix KV reuse)
    sparse_sync: bool = True               # sparse bit-exact deltas to serving GPUs


SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("fixed-sync", "fixed (sync, ROLL-style)"),
    System("fixed-async", "fixed (async, AReaL-style)", colocated=False, staleness=1),
    # `rose train` with train.max_staleness=1: the trainer trains on its devices while the next
    # step's rollouts go on, on those devices too (time-shared) and, for ROSE, on serving GPUs.
    System("fixed-async-shared", "fixed (async, devices shared with training)", staleness=1),
    System("rose-async", "ROSE (async)", staleness=1, extra=Extra.COSERVE),
    System("elastic-spot", "elastic (spot, RLBoost-style)", extra=Extra.SPOT),
    System("elastic-serverless", "elastic (serverless)", extra=Extra.SERVERLESS),
    System("rose", "ROSE", extra=Extra.COSERVE),
    System("rose-no-affinity", "ROSE w/o cache affinity", extra=Extra.COSERVE, affinity=False),
    System("rose-full-weights", "ROSE w/ full-weight sync", extra=Extra.COSERVE, sparse_sync=False),
    System("naive-share", "naive sharing (no admission)", extra=Extra.COSERVE, sharing=Sharing.NAIVE),
    System("static-split", "static split (fixed pages and tokens)", extra=Extra.COSERVE,
           sharing=Sharing.STATIC),
)}


def batchable(system: System) -> bool:
    """Whether `sim.rollout_model=batched` simulates the system: synchronous, on the job's GPUs
    and serving GPUs only (no elastic capacity, no split or shared devices)."""
    return system.colocated and system.staleness == 0 and system.extra in (Extra.NONE, Extra.COSERVE)
