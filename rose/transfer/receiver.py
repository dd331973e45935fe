"""The rollout side: one `Receiver` per rollout process (one TP/PP rank of one replica).

A receiver keeps a mirror of its shard of every parameter (in the transfer dtype) on its
`device` (payloads are checked on the host, then applied there), joins its group by writing a
`MemberState` to the relay, and on `sync()` pulls the buckets of the next announced sync that
hold its slices (prefetching the next bucket while applying one), applies them to the mirror
and verifies every fragment's checksum. Only when all of them check out does it hand the
changed tensors to `on_apply(named_tensors, version)` -- the shape of `LLMEngine.load_weights`
-- and acknowledge the version. Any failure (checksum mismatch, a
bucket that never arrives) leaves the engine on its old version and asks for a full sync.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import nn

from rose.contracts import WeightUpdate
from rose.transfer import codec
from rose.transfer.layouts import ModelSpec, ReceiverSpec, box_shape, local_slices, receiver_layout
from rose.transfer.plan import Bucket, member_plan
from rose.transfer.relay import Relay
from rose.transfer.versions import (
    Announcement,
    MemberState,
    announce_key,
    bucket_key,
    latest_key,
    member_prefix,
)


@dataclasses.dataclass
class ReceiveReport:
    sync: int
    version: int | None  # None: the sync failed, a full sync is needed
    kind: str  # "delta", "full", "none" (already current) or "failed"
    buckets: int = 0
    payload_bytes: int = 0
    changed: int = 0
    seconds: float = 0.0
    error: str = ""


def load_into(module: nn.Module) -> WeightUpdate:
    """An `on_apply` that copies named tensors into `module`'s parameters (casting to their dtype).

    What an unsharded engine's `load_weights` does; handy for tests and single-process runs.
    """
    params = dict(module.named_parameters())

    def on_apply(named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        with torch.no_grad():
            for name, t in named_tensors:
                params[name].copy_(t)
        module.policy_version = version

    return on_apply


class Receiver:
    def __init__(self, relay: Relay, spec: ModelSpec, me: ReceiverSpec,
                 on_apply: WeightUpdate | None = None, *, group: str = "default", timeout: float = 60.0,
                 prefetch: int = 2, device: torch.device | str = "cpu") -> None:
        self.relay, self.spec, self.me, self.group = relay, spec, me, group
        self.on_apply, self.timeout, self.prefetch = on_apply, timeout, prefetch
        self._boxes = receiver_layout(spec, me.tp, me.pp).rank_boxes(me.rank)
        dtypes = {p.name: p.dtype for p in spec.params}
        self.tensors = {name: torch.zeros(box_shape(box), dtype=dtypes[name], device=device)
                        for name, box in self._boxes.items()}
        self.version: int | None = None
        self.last: ReceiveReport | None = None
        self._seen = 0
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rose-pull-{me.id}")

    @property
    def id(self) -> str:
        return self.me.id

    def digests(self) -> dict[str, int]:
        """xxh3 of each held tensor: compare with the trainer's (`codec.tensor_hash`) to audit a replica."""
        return {name: codec.tensor_hash(t) for name, t in self.tensors.items()}

    def join(self) -> None:
        """Become a member: the next sync announced after this includes us."""
        self._seen = self._latest()
        self._report_state()

    def leave(self) -> None:
        self.relay.delete(member_prefix(self.group) + self.id)
        self._fetcher.shutdown(wait=False)

    def sync(self, timeout: float | None = None) -> int | None:
        """Wait for the next sync and apply it: the version now held, or None if the sync failed
        (the next one brings a full copy). TimeoutError if nothing is announced within `timeout`."""
        ann = self._next_announcement(timeout)
        self._seen = ann.sync
        start = time.perf_counter()
        if self.id in ann.delta_for and self.version == ann.base:
            kind = "delta"
        elif self.id in ann.full_for:
            kind = "full"
        elif self.version == ann.version or self.me not in ann.members:
            self.last = ReceiveReport(ann.sync, self.version, "none")
            return self.version
        else:  # the sender believed a state we no longer hold: report it, get a full copy next
            return self._fail(ann, "announcement does not match this receiver's version", start)
        report = ReceiveReport(ann.sync, ann.version, kind)
        changed: collections.Counter[str] = collections.Counter()
        try:
            for bucket, parts in self._pull(ann.sync, kind, self._plan(ann)):
                payloads = _payloads(bucket, parts)
                for frag, (header, body) in zip(bucket.fragments, payloads, strict=True):
                    view = self.tensors[frag.param][local_slices(frag.box, self._boxes[frag.param])]
                    try:
                        changed[frag.param] += codec.apply_into(view, header, body)
                    except codec.CorruptDelta as exc:  # name the tensor: the codec only sees a view
                        where = f"{frag.param} {frag.box} in bucket {bucket.key}"
                        raise codec.CorruptDelta(f"{where}: {exc}") from exc
                report.buckets += 1
                report.payload_bytes += sum(len(h) + b.nbytes for h, b in payloads)
        except (codec.CorruptDelta, TimeoutError) as exc:
            return self._fail(ann, str(exc), start)
        if self.on_apply is not None:  # everything after a full sync, else what changed
            named = [(n, t) for n, t in self.tensors.items() if kind == "full" or changed[n]]
            self.on_apply(named, ann.version)
        self.version = ann.version
        report.changed = sum(changed.values())
        report.seconds = time.perf_counter() - start
        self.last = report
        self._report_state()
        return self.version

    # ------------------------------------------------------------------------------ internals

    def _pull(self, sync: int, kind: str, buckets: list[Bucket]) -> Iterator[tuple[Bucket, list[Any]]]:
        """Buckets in plan order, fetched up to `prefetch` ahead while the caller applies."""
        pending: collections.deque[tuple[Bucket, Future[Any]]] = collections.deque()
        todo = iter(buckets)

        def fetch(n: int) -> None:
            for b in itertools.islice(todo, n):
                key = bucket_key(self.group, sync, kind, b.key)
                pending.append((b, self._fetcher.submit(self.relay.get, key, self.timeout)))

        fetch(self.prefetch)
        try:
            while pending:
                bucket, fut = pending.popleft()
                fetch(1)
                yield bucket, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()

    def _plan(self, ann: Announcement) -> list[Bucket]:
        """This receiver's buckets of `ann`, refusing an announcement made for another model."""
        if ann.model != self.spec.fingerprint():
            raise codec.CorruptDelta(f"sync {ann.sync} is for model {ann.model}, "
                                     f"this receiver holds {self.spec.fingerprint()}")
        try:
            return member_plan(self.spec, ann.trainer, ann.members, ann.bucket_bytes).for_receiver(self.id)
        except ValueError as exc:
            raise codec.CorruptDelta(f"sync {ann.sync}: announcement has no valid plan: {exc}") from exc

    def _fail(self, ann: Announcement, error: str, start: float) -> None:
        # The mirror may be half-updated: only a full sync can vouch for it again.
        self.version = None
        self.last = ReceiveReport(ann.sync, None, "failed", seconds=time.perf_counter() - start, error=error)
        self._report_state()
        return None

    def _next_announcement(self, timeout: float | None) -> Announcement:
        # Jump straight to the newest sync if we fell behind (older ones may be gone).
        n = max(self._seen + 1, self._latest())
        return self.relay.get(announce_key(self.group, n), timeout)

    def _latest(self) -> int:
        try:
            return self.relay.get(latest_key(self.group), timeout=0)
        except TimeoutError:
            return 0

    def _report_state(self) -> None:
        """Tell the sender our version, visibly before we return: a sender announcing after
        `join` or `sync` returns must see it (else it leaves a new member out of the sync, or
        sends a full copy where a delta would do)."""
        self.relay.put(member_prefix(self.group) + self.id, MemberState(self.me, self.version))
        self.relay.flush()


def _payloads(bucket: Bucket, parts: Any) -> list[tuple[bytes, np.ndarray]]:
    """A bucket read from the relay as (header, body) pairs, one per fragment of the plan."""
    if not isinstance(parts, list) or len(parts) != 2 * len(bucket.fragments):
        got = f"{len(parts) // 2} payloads" if isinstance(parts, list) else f"a {type(parts).__name__}"
        raise codec.CorruptDelta(f"bucket {bucket.key} holds {got}, the plan expects {len(bucket.fragments)}")
    pairs = list(zip(parts[::2], parts[1::2], strict=True))
    for header, body in pairs:
        if not (isinstance(header, bytes) and isinstance(body, np.ndarray) and body.dtype == np.uint8
                and body.ndim == 1):
            what = f"{body.dtype} {body.shape}" if isinstance(body, np.ndarray) else type(body).__name__
            raise codec.CorruptDelta(f"bucket {bucket.key} holds a {type(header).__name__} header and a "
                                     f"{what} body, expected bytes and a flat uint8 array")
    return pairs
