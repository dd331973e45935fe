"""Cross-cluster weight transfer: shard-aware routing, bit-exact sparse deltas, a relay.

    layouts   who holds which slice of each parameter (trainer FSDP/TP/PP, receiver TP/PP);
              a LoRA adapter's tensors as a model of their own (`adapter_spec`)
    plan      the routing plan: fragments and buckets, sender rank -> receivers (pure)
    codec     bit-exact overwrite deltas with checksums (`encode`, `apply`, `CorruptDelta`)
    versions  sync policy (delta or full), in-flight option, membership and announcement records
    relay     the store trainers push to and receivers pull from (Ray object store, in-process)
    link      token-bucket emulation of the cross-cluster link
    sender    one per trainer rank: encode and push, pipelined
    receiver  one per rollout process: pull, apply, verify, hand over to the engine
"""

from rose.transfer.codec import CorruptDelta, apply, encode
from rose.transfer.layouts import (
    ModelSpec,
    ParamSpec,
    ReceiverSpec,
    Split,
    TrainerSpec,
    adapter_spec,
    config_spec,
    model_spec,
    receiver_layout,
    trainer_layout,
)
from rose.transfer.link import Link, LinkError
from rose.transfer.plan import TransferPlan, build_plan
from rose.transfer.receiver import Receiver, load_into
from rose.transfer.relay import LocalRelay, RayRelay, Relay
from rose.transfer.sender import Sender
from rose.transfer.versions import SyncPolicy

__all__ = [
    "CorruptDelta",
    "Link",
    "LinkError",
    "LocalRelay",
    "ModelSpec",
    "ParamSpec",
    "RayRelay",
    "Receiver",
    "ReceiverSpec",
    "Relay",
    "Sender",
    "Split",
    "SyncPolicy",
    "TrainerSpec",
    "TransferPlan",
    "adapter_spec",
    "apply",
    "build_plan",
    "config_spec",
    "encode",
    "load_into",
    "model_spec",
    "receiver_layout",
    "trainer_layout",
]
