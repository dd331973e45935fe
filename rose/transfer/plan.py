"""The routing plan: which slice each trainer rank sends, to whom, in which bucket.

A pure function of the model spec, the trainer layout, the receivers' layouts and the bucket
size, so every sender and every receiver computes the same plan on its own and nothing but
the membership list has to be exchanged.

For each parameter, each trainer rank's owned box is cut at every boundary of every receiver
box that overlaps it. Each resulting cell lies wholly inside or wholly outside each receiver
box, so a cell is a *fragment* sent once (to the relay) and pulled by exactly the receivers
that contain it: a sender sends only what it owns (no all-gather), a receiver pulls only its
own slices, and two replicas that need the same slice share one copy on the link. Fragments
with the same set of receivers are packed, in order, into buckets of at most `bucket_bytes`
of raw weights (large fragments are first cut along dim 0), so a receiver pulls whole buckets
that hold nothing it does not need.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping

from rose.transfer.layouts import (
    Box,
    Layout,
    ModelSpec,
    ParamSpec,
    ReceiverSpec,
    TrainerSpec,
    box_numel,
    receiver_layout,
    trainer_layout,
)

DEFAULT_BUCKET_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Fragment:
    """A box of one parameter, owned by trainer rank `sender`, needed by `receivers`."""

    param: str
    box: Box
    sender: int
    receivers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Fragments from one sender, all for the same receivers; `key` names it on the relay."""

    key: str
    sender: int
    receivers: tuple[str, ...]
    fragments: tuple[Fragment, ...]
    nbytes: int  # raw weight bytes covered


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    buckets: tuple[Bucket, ...]

    def for_sender(self, rank: int) -> list[Bucket]:
        return [b for b in self.buckets if b.sender == rank]

    def for_receiver(self, receiver: str) -> list[Bucket]:
        return [b for b in self.buckets if receiver in b.receivers]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def build_plan(spec: ModelSpec, senders: Layout, receivers: Mapping[str, Mapping[str, Box]],
               bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> TransferPlan:
    """The plan from trainer layout `senders` (owned boxes) to `receivers` (id -> held boxes)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    ids = sorted(receivers)
    itemsize = {p.name: p.dtype.itemsize for p in spec.params}
    per_sender: dict[int, dict[tuple[str, ...], list[Fragment]]] = {}
    for p in spec.params:
        wanted = [(rid, receivers[rid][p.name]) for rid in ids if p.name in receivers[rid]]
        for rank, owned in enumerate(senders.boxes[p.name]):
            if owned is None or not wanted:
                continue
            for frag in _fragments(p, rank, owned, wanted, bucket_bytes):
                per_sender.setdefault(rank, {}).setdefault(frag.receivers, []).append(frag)
    order = {p.name: i for i, p in enumerate(spec.params)}
    buckets = []
    for rank in sorted(per_sender):
        packs = [(group, packed) for group, frags in per_sender[rank].items()
                 for packed in _pack(frags, itemsize, bucket_bytes)]
        # In model order across receiver sets, so that every receiver gets work early.
        packs.sort(key=lambda gp: (order[gp[1][0].param], gp[1][0].box))
        for n, (group, packed) in enumerate(packs):
            size = sum(box_numel(f.box) * itemsize[f.param] for f in packed)
            buckets.append(Bucket(f"s{rank}/b{n}", rank, group, tuple(packed), size))
    return TransferPlan(tuple(buckets))


def _fragments(p: ParamSpec, rank: int, owned: Box, wanted: list[tuple[str, Box]],
               bucket_bytes: int) -> list[Fragment]:
    overlapping = [(rid, box) for rid, box in wanted if _intersects(box, owned)]
    cuts = []
    for d, (lo, hi) in enumerate(owned):
        points = {lo, hi}
        for _, box in overlapping:
            points.update(min(max(x, lo), hi) for x in box[d])
        cuts.append(sorted(points))
    out = []
    for cell in itertools.product(*[list(itertools.pairwise(c)) for c in cuts]):
        needers = tuple(rid for rid, box in overlapping if _contains(box, cell))
        if needers and box_numel(cell) > 0:
            out += [Fragment(p.name, piece, rank, needers) for piece in _split_rows(cell, p, bucket_bytes)]
    return out


def _split_rows(cell: Box, p: ParamSpec, bucket_bytes: int) -> list[Box]:
    """Cut a cell larger than a bucket into runs of dim-0 rows (at least one row each)."""
    if not cell:
        return [cell]
    row_bytes = math.prod(hi - lo for lo, hi in cell[1:]) * p.dtype.itemsize
    step = max(1, bucket_bytes // max(row_bytes, 1))
    (lo, hi), rest = cell[0], cell[1:]
    return [((a, min(a + step, hi)), *rest) for a in range(lo, hi, step)]


def _pack(frags: list[Fragment], itemsize: Mapping[str, int], bucket_bytes: int) -> list[list[Fragment]]:
    out: list[list[Fragment]] = []
    size = 0
    for f in frags:
        n = box_numel(f.box) * itemsize[f.param]
        if not out or size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(f)
        size += n
    return out


def _intersects(a: Box, b: Box) -> bool:
    return all(max(alo, blo) < min(ahi, bhi) for (alo, ahi), (blo, bhi) in zip(a, b, strict=True))


def _contains(outer: Box, inner: Box) -> bool:
    return all(olo <= ilo and ihi <= ohi for (olo, ohi), (ilo, ihi) in zip(outer, inner, strict=True))


@functools.lru_cache(maxsize=16)
def member_plan(spec: ModelSpec, trainer: TrainerSpec, members: tuple[ReceiverSpec, ...],
                bucket_bytes: int) -> TransferPlan:
    """The plan for a membership list (as announced), cached: senders and receivers reuse it."""
    layouts: dict[tuple[int, int], Layout] = {}
    receivers = {}
    for m in members:
        if (m.tp, m.pp) not in layouts:
            layouts[m.tp, m.pp] = receiver_layout(spec, m.tp, m.pp)
        receivers[m.id] = layouts[m.tp, m.pp].rank_boxes(m.rank)
    return build_plan(spec, trainer_layout(spec, trainer), receivers, bucket_bytes)
