"""Continuous batching: which sequences run this iteration, and how many tokens each.

Every iteration: running sequences first (in priority order: decodes take one token, unfinished
prefills a chunk), then waiting ones in order while the token budget, the sequence cap and the
pages allow. When pages run out the lowest-priority, latest-arrived running sequence is preempted
by recomputation: its pages are freed and it waits again with every token it has. A waiting
sequence that needs more pages than its owner may hold at all (its budget shrank after it was
admitted) is dropped from the queue and returned as `unfit` rather than blocking the queue.

An engine may also carry guest sequences (`Sequence.guest`: a co-serving device's rollout turns
riding the serving model). They are scheduled after the engine's own, running and waiting, in
what those leave of the iteration's tokens, at most `guest_budget` of them; they draw pages from
a block manager of their own in the same pool (its budget for that owner caps them), have their
own `max_num_seqs`, and never preempt the engine's own sequences.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable

from rose.engine.block_manager import BlockManager
from rose.engine.sequence import Sequence, Status


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int = 512  # longest prefill chunk of one sequence in one iteration

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"scheduler {name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass
class Batch:
    """This iteration's work: `num_tokens[i]` tokens of `seqs[i]`."""

    seqs: list[Sequence]
    num_tokens: list[int]
    preempted: list[Sequence]
    unfit: list[Sequence] = dataclasses.field(default_factory=list)  # taken out of the queue


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig | None = None,
                 guest_blocks: BlockManager | None = None) -> None:
        self.blocks = blocks
        self.guest_blocks = guest_blocks  # the guest sequences' pages (None: no guests)
        self.config = config or SchedulerConfig()
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []

    def blocks_of(self, seq: Sequence) -> BlockManager:
        if not seq.guest:
            return self.blocks
        assert self.guest_blocks is not None, "a guest sequence on a scheduler without guests"
        return self.guest_blocks

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and give back its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks_of(seq).free(seq)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks_of(seq).free(seq)
        seq.kv_version = None  # recomputed from scratch when it runs again
        seq.num_preemptions += 1
        self.add(seq)

    def schedule(self, token_budget: int | None = None, admit: bool = True,
                 guest_budget: int | None = None) -> Batch:
        """This iteration's batch; `token_budget` lowers the configured one (the co-serving
        executor grants a rollout engine only what the serving SLOs leave), `guest_budget` caps
        the guests' share of what the engine's own requests leave (the same grant, where
        rollouts are guests of the serving engine); `admit=False` runs only what is already
        running."""
        budget = self.config.max_num_batched_tokens
        if token_budget is not None:
            budget = min(budget, token_budget)
        batch = Batch([], [], [])
        chosen: dict[Sequence, int] = {}
        left = self._fill(False, budget, admit, chosen, batch)
        if self.guest_blocks is not None:
            self._fill(True, left if guest_budget is None else min(left, guest_budget), admit, chosen, batch)
        batch.seqs, batch.num_tokens = list(chosen), list(chosen.values())
        return batch

    def _fill(self, guest: bool, budget: int, admit: bool, chosen: dict[Sequence, int], batch: Batch) -> int:
        """Choose the tokens of one class (guests or not) within `budget`; the tokens left."""

        def make_room(seq: Sequence, n: int, may_preempt: Callable[[Sequence], bool]) -> bool:
            """Preempt the latest running sequences that `may_preempt` allows until `seq` gets
            its pages (the candidates are only sorted when pages actually run out)."""
            nonlocal budget
            victims = None
            while not self.blocks_of(seq).ensure_slots(seq, n):
                if victims is None:
                    # A guest never displaces the engine's own sequences.
                    victims = sorted((s for s in self.running if may_preempt(s) and (s.guest or not guest)),
                                     key=lambda s: s.sort_key)
                if not victims:
                    return False
                victim = victims.pop()
                budget += chosen.pop(victim, 0)
                self.preempt(victim)
                batch.preempted.append(victim)
            return True

        # Decodes before prefill chunks: a decode holds pages already and finishing it frees them.
        for seq in sorted((s for s in self.running if s.guest is guest),
                          key=lambda s: (s.num_uncomputed > 1, s.sort_key)):
            if seq.status is not Status.RUNNING:
                continue  # preempted for an earlier one in this loop
            n = min(seq.num_uncomputed, self.config.chunk_size, budget)
            if n == 0:
                continue
            if make_room(seq, n, lambda s, key=seq.sort_key: s.sort_key > key):
                chosen[seq] = n
                budget -= n
            else:
                self.preempt(seq)
                batch.preempted.append(seq)

        running = sum(1 for s in self.running if s.guest is guest)
        blocks = self.guest_blocks if guest else self.blocks
        assert blocks is not None
        for seq in [s for s in self.waiting if s.guest is guest] if admit else []:
            if budget <= 0 or running >= self.config.max_num_seqs:
                break
            if blocks.pages_for(len(seq.token_ids)) > blocks.max_pages:
                self.waiting.remove(seq)
                batch.unfit.append(seq)  # could only wait forever and block the rest
                continue
            blocks.match_prefix(seq)
            n = min(seq.num_uncomputed, self.config.chunk_size, budget)
            # A waiting sequence may only displace running ones of a lower priority class.
            if not make_room(seq, n, lambda s, prio=seq.priority: s.priority > prio):
                blocks.free(seq)
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            running += 1
            chosen[seq] = n
            budget -= n
        return budget
