"""Asynchronous RL's rollouts: groups of tasks played without pause across RL steps.

A `RolloutStream` keeps groups in play while the trainer trains; each step takes the first
`batch` groups that finish (whole groups; with a `keep` filter, DAPO's dynamic sampling, only
those that pass count), and every group still in play carries over to a later step with the
tokens it has, each tagged with the policy version that sampled it, instead of being thrown
away or played again (the trainer weighs its older tokens by importance sampling, or masks those
more than `max_staleness` versions old); a finished group none of whose tokens is that recent
expires unused.

Which groups may start is `groups_to_start`, a pure decision the simulator can share: a group
is meant for the step after those already started for, a step's worth being `batch + extra`
groups (the extra ones are the over-sampling: a step closes when `batch` have finished), and a
group meant for step `s` starts only once the trainer's weights are version `s - max_staleness`
or later. So no group starts more than `max_staleness` versions before the step meant to train
on it; one that finishes later than its step (a slow group, carried over) keeps its older
tokens. Queued turns of older groups start first, so the step to be taken fills before later
ones start. A run of a known length starts no group meant for a step after its last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from rose.rl import Trajectory
from rose.rollout.agent import Agent
from rose.rollout.manager import Play, RolloutManager, RolloutReport, Unfinished


def groups_to_start(taken_steps: int, in_play: int, version: int, batch: int, extra: int,
                    max_staleness: int, steps: int | None = None) -> int:
    """How many more groups may start now: `in_play` groups started and not yet taken,
    `taken_steps` steps' batches taken so far, the trainer's weights at `version`, `steps` the
    steps the run will take (None: no end)."""
    per_step = batch + extra
    started = 0
    while True:
        meant_for = taken_steps + (in_play + started) // per_step
        if (meant_for > version + max_staleness or in_play + started >= (max_staleness + 1) * per_step
                or (steps is not None and meant_for >= steps)):
            return started
        started += 1


@dataclasses.dataclass
class _Group:
    plays: list[tuple[str, Play]]  # (trajectory id, its play)
    started_version: int


class RolloutStream:
    """Groups from `new_group(k)` (the k-th group's tasks) played by `agent` on `manager`'s
    workers; `version()` is the trainer's current weights' version."""

    def __init__(self, manager: RolloutManager, agent: Agent[Any], new_group: Callable[[int], Sequence[Any]],
                 version: Callable[[], int], batch: int, extra: int, max_staleness: int,
                 keep: Callable[[list[Trajectory]], bool] = lambda group: True, max_dropped: int = 0,
                 prefix: str = "a", steps: int | None = None) -> None:
        """`keep` passes the groups a step may train on; once a step has dropped `max_dropped`
        groups it takes the next ones whatever `keep` says (as the synchronous dynamic sampling
        plays a bounded number of rounds), so that a step whose groups keep agreeing ends.
        `steps`: how many steps will be taken (None: no end)."""
        if batch < 1 or extra < 0 or max_staleness < 1:
            raise ValueError(f"a rollout stream needs batch >= 1, extra >= 0 and max_staleness >= 1, got "
                             f"{batch}, {extra}, {max_staleness}")
        self.manager, self.agent, self.new_group, self.version = manager, agent, new_group, version
        self.batch, self.extra, self.max_staleness, self.keep = batch, extra, max_staleness, keep
        self.max_dropped = max_dropped
        self.prefix, self.steps = prefix, steps
        self.taken_steps = 0
        self.started = 0          # groups started so far: the next one's index
        self.dropped = 0          # finished groups `keep` refused (no signal)
        self.expired = 0          # finished groups with no token within max_staleness versions
        self._taking = 0          # groups the step being taken has so far: still its, not in play
        self._in_play: list[_Group] = []
        self._finished: asyncio.Queue[_Group] = asyncio.Queue()
        self._watchers: set[asyncio.Task[None]] = set()  # one per group in play, until it finishes
        self._ticker = manager.tick()

    @property
    def in_play(self) -> int:
        """Groups started and not yet taken (playing, or finished and waiting for a step)."""
        return len(self._in_play) + self._finished.qsize()

    def refill(self) -> None:
        """Start the groups the staleness window allows now (after a step is taken, after the
        weights moved on)."""
        version = self.version()
        for _ in range(groups_to_start(self.taken_steps, self.in_play + self._taking, version, self.batch,
                                       self.extra, self.max_staleness, self.steps)):
            k = self.started
            ids = [(f"{self.prefix}{k}-{i}", task) for i, task in enumerate(self.new_group(k))]
            # Older groups' turns first: the step to be taken fills before later ones start.
            group = _Group([(tid, self.manager.play(tid, task, version, self.agent, priority=k))
                            for tid, task in ids], version)
            self._in_play.append(group)
            watcher = asyncio.create_task(self._await(group))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)
            self.started += 1

    async def _await(self, group: _Group) -> None:
        await asyncio.gather(*(p.task for _, p in group.plays), return_exceptions=True)
        if group in self._in_play:  # not cancelled by `close`
            self._in_play.remove(group)
            self._finished.put_nowait(group)

    async def take(self, timeout_s: float | None = None) -> RolloutReport:
        """The next step's batch: the first `batch` finished groups `keep` passes, in the order
        they finished. Waits at most `timeout_s` for them; the step then has fewer (none are lost:
        the groups still in play carry over). The report's placements are the attempts that
        ended since the last step's take, timed from this take's start (earlier ones negative:
        they ran while the trainer trained)."""
        start = self.manager.elapsed()
        self.refill()
        report = RolloutReport([], [], 0.0)
        dropped = 0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._taking < self.batch:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                group = await asyncio.wait_for(self._finished.get(), left)
            except TimeoutError:
                break
            trajectories, failed = [], []
            for tid, play in group.plays:
                got = play.task.result()
                (failed.append(Unfinished(tid, play.turns, got)) if isinstance(got, str)
                 else trajectories.append(got))
            newest = max((v for t in trajectories for turn in t.turns for v in turn.versions),
                         default=group.started_version)
            if newest < self.version() - self.max_staleness:
                # Carried over too long: every token would be masked.
                self.expired += 1
                self.refill()
                continue
            report.failed += failed
            if dropped >= self.max_dropped or self.keep(trajectories):
                report.trajectories += trajectories
                self._taking += 1
            else:
                self.dropped, dropped = self.dropped + 1, dropped + 1
                self.refill()  # another group in its place
        self.taken_steps, self._taking = self.taken_steps + 1, 0
        now = self.manager.elapsed()
        report.placements, report.seconds = self.manager.take_placements(start), now - start
        self.refill()
        return report

    def counts(self) -> dict[str, int]:
        """Groups started, taken by steps, refused by `keep`, expired, and in play now."""
        return {"started": self.started, "taken": self.started - self.in_play - self.dropped - self.expired,
                "dropped": self.dropped, "expired": self.expired, "in_play": self.in_play}

    async def close(self) -> list[Unfinished]:
        """Stop every group in play; the trajectories that were still playing, with their turns."""
        unfinished = [Unfinished(tid, play.turns, "in play when the run ended")
                      for group in self._in_play for tid, play in group.plays if not play.task.done()]
        plays = [p.task for group in self._in_play for _, p in group.plays]
        self._in_play.clear()
        await self.manager.stop([self._ticker, *plays, *self._watchers])
        return unfinished
