"""Policy versions: who gets a delta, who a full sync, and the records senders and receivers share.

Pure decisions and plain records, no I/O. The relay keys live here too, so the sync protocol
reads in one place:

    {group}/members/{receiver id}   MemberState: the receiver's spec and the version it holds
    {group}/latest                  the number of the newest sync
    {group}/sync/{n}/announce       Announcement: version, base, who gets a delta or a full copy
    {group}/sync/{n}/{kind}/{key}   one bucket of payloads (kind "delta" or "full")

A *group* is a set of receivers synced together from one baseline (for example the dedicated
rollout pool, or the replicas on borrowed serving devices): each group has its own sender
state, baseline and version history, so a slower group never forces full syncs on a faster one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from rose.transfer.layouts import ReceiverSpec, TrainerSpec


@dataclasses.dataclass(frozen=True)
class MemberState:
    """What a receiver tells the sender: who it is and which version its tensors hold.

    `version` is None for a new or restarted receiver, or one whose last sync failed (a
    checksum mismatch, a lost bucket): it needs a full sync.
    """

    spec: ReceiverSpec
    version: int | None


@dataclasses.dataclass(frozen=True)
class Decision:
    base: int | None  # the version deltas are relative to
    delta_for: tuple[str, ...]
    full_for: tuple[str, ...]
    periodic: bool  # a scheduled full sync of everyone


@dataclasses.dataclass(frozen=True)
class SyncPolicy:
    """When to send a full sync instead of a delta.

    A receiver gets a delta only if it holds exactly the sender's baseline version; everyone
    else (new, late, restarted, failed) gets a full copy. Every `full_every` versions everyone
    gets a full copy (0 turns that off), which bounds how long an undetected divergence could
    live and resets the baseline.
    """

    full_every: int = 10

    def __post_init__(self) -> None:
        if self.full_every < 0:
            raise ValueError(f"full_every must be >= 0, got {self.full_every}")

    def decide(self, version: int, baseline: int | None, last_full: int | None,
               members: Mapping[str, int | None], force_full: bool = False) -> Decision:
        """Decide for `version`, given the baseline version and each member's held version."""
        ids = sorted(members)
        periodic = bool(self.full_every and baseline is not None and last_full is not None
                        and version - last_full >= self.full_every)
        if force_full or periodic or baseline is None:
            return Decision(None, (), tuple(ids), periodic)
        delta = tuple(r for r in ids if members[r] == baseline and version != baseline)
        # Members already at `version` (a repeated publish) need nothing.
        full = tuple(r for r in ids if members[r] not in (baseline, version))
        return Decision(baseline, delta, full, False)


@dataclasses.dataclass(frozen=True)
class Announcement:
    """Everything a receiver needs to pull sync `sync`: the plan's inputs and its own role."""

    sync: int
    version: int
    base: int | None
    delta_for: tuple[str, ...]
    full_for: tuple[str, ...]
    members: tuple[ReceiverSpec, ...]
    trainer: TrainerSpec
    bucket_bytes: int
    model: str  # ModelSpec fingerprint


def member_prefix(group: str) -> str:
    return f"{group}/members/"


def latest_key(group: str) -> str:
    return f"{group}/latest"


def sync_prefix(group: str, sync: int) -> str:
    return f"{group}/sync/{sync}/"


def announce_key(group: str, sync: int) -> str:
    return sync_prefix(group, sync) + "announce"


def bucket_key(group: str, sync: int, kind: str, bucket: str) -> str:
    return sync_prefix(group, sync) + f"{kind}/{bucket}"
