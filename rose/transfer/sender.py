"""The trainer side: one `Sender` per trainer rank and receiver group.

`publish(version)` sends this rank's owned slices of the new policy weights to every member of
the group through the relay: a sparse delta against the baseline for members that hold it,
a full copy for the others (see `SyncPolicy`). Rank 0 decides and announces; the other ranks
read its announcement, so all ranks encode the same plan. Encoding runs in the caller's thread
while a pusher thread moves finished buckets over the (emulated) link into the relay, so
encode and transfer overlap bucket by bucket. A lost bucket is pushed again under the same
key (payloads are idempotent).

The baseline is a copy of this rank's shards as of the last published version, on their device:
the codec finds the changes where the weights live (numba on CPU, torch ops on an accelerator,
whose payload bodies reach the relay through pinned host memory). Encoding a delta advances the
baseline in place, in the same pass that finds the changes.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from rose.transfer import codec
from rose.transfer.layouts import ModelSpec, TrainerSpec, box_shape, local_slices, trainer_layout
from rose.transfer.link import Link, LinkError
from rose.transfer.plan import DEFAULT_BUCKET_BYTES, Bucket, member_plan
from rose.transfer.relay import Relay
from rose.transfer.versions import (
    Announcement,
    MemberState,
    SyncPolicy,
    announce_key,
    bucket_key,
    latest_key,
    member_prefix,
    sync_prefix,
)


@dataclasses.dataclass
class SendReport:
    sync: int
    version: int
    delta_for: int  # receivers
    full_for: int
    buckets: int = 0  # pushed, delta and full together
    payload_bytes: int = 0  # put on the link, retries not counted
    raw_bytes: int = 0  # raw weight bytes those payloads stand for
    changed: int = 0  # elements whose bits changed, over the delta-encoded fragments
    compared: int = 0  # elements of the delta-encoded fragments
    retries: int = 0
    seconds: float = 0.0


class Sender:
    """Publishes trainer rank `rank`'s owned shards (`tensors`, live views) to receiver group `group`."""

    def __init__(self, relay: Relay, spec: ModelSpec, tensors: Mapping[str, torch.Tensor], *,
                 trainer: TrainerSpec | None = None, rank: int = 0, group: str = "default",
                 policy: SyncPolicy | None = None, link: Link | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, zstd_level: int | None = None,
                 retries: int = 3, keep_syncs: int = 2, timeout: float = 60.0) -> None:
        self.relay, self.spec, self.group, self.rank = relay, spec, group, rank
        self.trainer = trainer or TrainerSpec()
        self.policy = policy or SyncPolicy()
        self.link, self.bucket_bytes, self.zstd_level = link, bucket_bytes, zstd_level
        self.retries, self.keep_syncs, self.timeout = retries, keep_syncs, timeout
        self._owned = trainer_layout(spec, self.trainer).rank_boxes(rank)
        _check_tensors(spec, self._owned, tensors, f"trainer rank {rank}")
        self.tensors = dict(tensors)
        # This rank's shards as of `baseline_version`; pages are first touched by the first full sync.
        self.baseline = {n: torch.empty(t.shape, dtype=t.dtype, device=t.device)
                         for n, t in self.tensors.items()}
        self.baseline_version: int | None = None
        self._last_full: int | None = None
        self._last_published: int | None = None
        self._repeat = 0
        self._history: collections.deque[tuple[int, int, int]] = collections.deque()  # (sync, version, k)
        self._pusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rose-push-{rank}")

    def publish(self, version: int, *, full: bool = False) -> SendReport:
        """Send `version` (the weights in `tensors` now) to the group; `full` forces full copies.

        Every rank calls this with the same sequence of versions; the tensors must not change
        until it returns. Publishing the current version again serves members that fell behind.
        """
        start = time.perf_counter()
        k = self._repeat + 1 if version == self._last_published else 0  # nth publish of this version
        self._last_published, self._repeat = version, k
        ann = self._announce(version, k, full) if self.rank == 0 else self._read_announcement(version, k)
        if ann.model != self.spec.fingerprint():
            raise ValueError(f"announcement is for model {ann.model}, "
                             f"this sender holds {self.spec.fingerprint()}")
        plan = member_plan(self.spec, ann.trainer, ann.members, ann.bucket_bytes)
        report = SendReport(ann.sync, version, len(ann.delta_for), len(ann.full_for))
        pending: collections.deque[Future[int]] = collections.deque()
        delta_for, full_for = set(ann.delta_for), set(ann.full_for)
        try:
            for bucket in plan.for_sender(self.rank):
                want_delta = not delta_for.isdisjoint(bucket.receivers)
                want_full = not full_for.isdisjoint(bucket.receivers)
                for kind in ("delta",) * want_delta + ("full",) * want_full:
                    # The delta encode advances the baseline; a full-only bucket copies it instead.
                    encoded = self._encode(bucket, kind, copy_baseline=not want_delta, report=report)
                    parts = [part for e in encoded for part in (e.header, e.body)]
                    nbytes = sum(e.nbytes for e in encoded)
                    report.buckets += 1
                    report.payload_bytes += nbytes
                    report.raw_bytes += bucket.nbytes
                    while len(pending) >= 2:  # bounded look-ahead: encode one bucket while one moves
                        report.retries += pending.popleft().result()
                    key = bucket_key(self.group, ann.sync, kind, bucket.key)
                    pending.append(self._pusher.submit(self._push, key, parts, nbytes))
            while pending:
                report.retries += pending.popleft().result()
        except BaseException:
            # The baseline may be half advanced: only full copies are safe until the next success.
            self.baseline_version = None
            for f in pending:
                f.cancel()
            raise
        self.baseline_version = version
        if ann.base is None and ann.full_for:
            self._last_full = version
        self._forget_old_syncs()
        report.seconds = time.perf_counter() - start
        return report

    def close(self) -> None:
        self._pusher.shutdown(wait=True)

    # ------------------------------------------------------------------------------ internals

    def _announce(self, version: int, k: int, full: bool) -> Announcement:
        states = [s for s in self.relay.scan(member_prefix(self.group)).values()
                  if isinstance(s, MemberState)]
        decision = self.policy.decide(version, self.baseline_version, self._last_full,
                                      {s.spec.id: s.version for s in states}, force_full=full)
        try:
            sync = self.relay.get(latest_key(self.group), timeout=0) + 1
        except TimeoutError:
            sync = 1
        ann = Announcement(sync, version, decision.base, decision.delta_for, decision.full_for,
                           tuple(sorted((s.spec for s in states), key=lambda s: s.id)), self.trainer,
                           self.bucket_bytes, self.spec.fingerprint())
        self.relay.put(announce_key(self.group, sync), ann)
        self.relay.put(_version_key(self.group, version, k), sync)
        self.relay.put(latest_key(self.group), sync)
        self._history.append((sync, version, k))
        return ann

    def _forget_old_syncs(self) -> None:
        while len(self._history) > self.keep_syncs:  # nobody should still pull these
            old, old_version, old_k = self._history.popleft()
            self.relay.delete(sync_prefix(self.group, old))
            self.relay.delete(_version_key(self.group, old_version, old_k))

    def _read_announcement(self, version: int, k: int) -> Announcement:
        sync = self.relay.get(_version_key(self.group, version, k), self.timeout)
        return self.relay.get(announce_key(self.group, sync), self.timeout)

    def _encode(self, bucket: Bucket, kind: str, copy_baseline: bool,
                report: SendReport) -> list[codec.Encoded]:
        out = []
        for frag in bucket.fragments:
            where = local_slices(frag.box, self._owned[frag.param])
            new, base = self.tensors[frag.param][where], self.baseline[frag.param][where]
            if kind == "delta":
                enc = codec.encode_delta(base, new, zstd_level=self.zstd_level)
                report.changed += enc.changed
                report.compared += new.numel()
            else:
                enc = codec.encode_full(new)
                if copy_baseline:
                    codec.copy_bits(base, new)
            out.append(enc)
        return out

    def _push(self, key: str, parts: list[bytes | np.ndarray], nbytes: int) -> int:
        """Move one bucket over the link into the relay; returns how many retries it took."""
        for attempt in range(self.retries + 1):
            try:
                if self.link is not None:
                    self.link.transmit(key, nbytes)
                self.relay.put(key, parts)
                return attempt
            except LinkError:
                if attempt == self.retries:
                    raise
        raise AssertionError("unreachable")


def _version_key(group: str, version: int, k: int) -> str:
    return f"{group}/versions/{version}.{k}"


def _check_tensors(spec: ModelSpec, boxes: Mapping, tensors: Mapping[str, torch.Tensor], who: str) -> None:
    """Shards must match the layout exactly: a clear error beats a silent mis-transfer."""
    missing = sorted(set(boxes) - set(tensors))
    extra = sorted(set(tensors) - set(boxes))
    if missing or extra:
        raise ValueError(f"{who}: tensors do not match its layout; "
                         f"missing {missing[:3]}, unexpected {extra[:3]}")
    dtypes = {p.name: p.dtype for p in spec.params}
    for name, t in tensors.items():
        if tuple(t.shape) != box_shape(boxes[name]):
            raise ValueError(f"{who}: {name} has shape {tuple(t.shape)}, "
                             f"its shard is {box_shape(boxes[name])}")
        if t.dtype != dtypes[name]:
            raise ValueError(f"{who}: {name} is {t.dtype}, the transfer dtype is {dtypes[name]}")
