"""Asynchronous RL's rollout stream (rose.rollout.stream): the staleness window that decides which
groups start, and the stream on fake workers: a step takes the first groups that finish, the rest
play on into later steps with their tokens and versions, DAPO's filter refills, and closing the
stream frees every slot."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fake_workers import TOKEN, FakeWorker
from hypothesis import given
from hypothesis import strategies as st

from rose.engine import SamplingParams
from rose.model import load_tokenizer
from rose.rl import Episode, make_env
from rose.rollout.agent import play_episode
from rose.rollout.manager import RolloutManager
from rose.rollout.registry import WorkerRegistry
from rose.rollout.stream import RolloutStream, groups_to_start


def test_the_window_starts_k_plus_one_steps_of_groups_then_waits_for_the_weights() -> None:
    # Steps of 4 groups and 1 extra, staleness 1: at version 0, the groups meant for steps 0 and 1.
    assert groups_to_start(0, 0, 0, 4, 1, 1) == 10
    # Step 0 took 4; the 6 in play are meant for step 1 (and 1 for step 2, which needs version 1).
    assert groups_to_start(1, 6, 0, 4, 1, 1) == 0
    # Version 1 (step 0 trained): up to step 2's.
    assert groups_to_start(1, 6, 1, 4, 1, 1) == 4
    # Staleness 2: three steps' worth at once.
    assert groups_to_start(0, 0, 0, 4, 1, 2) == 15
    # A run of one step starts no group for a second.
    assert groups_to_start(0, 0, 0, 4, 1, 1, steps=1) == 5


@given(taken=st.integers(0, 20), in_play=st.integers(0, 60), lag=st.integers(0, 3),
       batch=st.integers(1, 8), extra=st.integers(0, 4), k=st.integers(1, 3),
       steps=st.none() | st.integers(1, 30))
def test_no_group_starts_more_than_k_versions_before_its_step(taken: int, in_play: int, lag: int, batch: int,
                                                              extra: int, k: int, steps: int | None) -> None:
    version = max(0, taken - lag)  # the trainer trails the steps taken by at most a step or so
    n = groups_to_start(taken, in_play, version, batch, extra, k, steps)
    per_step = batch + extra
    for i in range(n):
        meant_for = taken + (in_play + i) // per_step
        assert meant_for - version <= k and (steps is None or meant_for < steps)
    assert in_play + n <= max(in_play, (k + 1) * per_step)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path):
    return load_tokenizer(tiny_qwen3)


def _stream(tokenizer, workers: list[FakeWorker], version: list[int], batch: int = 2, extra: int = 1,
            keep=lambda group: True, max_dropped: int = 100) -> tuple[RolloutStream, WorkerRegistry]:
    registry = WorkerRegistry(2.0)
    for w in workers:
        registry.add(w)
    manager = RolloutManager(registry, SamplingParams(max_tokens=4), tick_s=0.02)

    def new_group(k: int) -> list[Episode]:
        return [Episode(make_env("frozenlake", max_turns=2), tokenizer, seed=k, group_id=k) for _ in range(2)]

    stream = RolloutStream(manager, play_episode, new_group, lambda: version[0], batch, extra, 1, keep,
                           max_dropped)
    return stream, registry


def test_steps_take_finished_groups_and_the_rest_carry_over_with_their_versions(tokenizer) -> None:
    worker = FakeWorker("d0", cap=64, delay_s=0.005)
    version = [0]

    async def scenario() -> None:
        stream, registry = _stream(tokenizer, [worker], version)
        first = await stream.take(timeout_s=30)
        # Two whole groups of two trajectories; six groups were started (two steps' worth, and
        # an extra each): the other four play on.
        assert len(first.trajectories) == 4 and len({t.group_id for t in first.trajectories}) == 2
        assert stream.counts() == {"started": 6, "taken": 2, "dropped": 0, "expired": 0, "in_play": 4}
        assert first.placements and first.seconds > 0
        # The trainer trains meanwhile; version 1 arrives, the workers sample with it from now.
        await asyncio.sleep(0.05)
        worker.policy_version = version[0] = 1
        stream.refill()
        second = await stream.take(timeout_s=30)
        assert len(second.trajectories) == 4
        assert not {t.group_id for t in first.trajectories} & {t.group_id for t in second.trajectories}
        # Carried-over groups keep the tokens of version 0 they had; none is older than 1 version.
        versions = {v for t in second.trajectories for turn in t.turns for v in turn.versions}
        assert versions <= {0, 1}
        assert all(turn.output_ids == [TOKEN] * 4 for t in second.trajectories for turn in t.turns)
        unfinished = await stream.close()
        assert all(u.reason == "in play when the run ended" for u in unfinished)
        table = registry.table
        assert not any(table.in_flight.values()) and not table.queue
        assert worker.running == 0

    asyncio.run(scenario())


def test_groups_the_filter_drops_are_replaced_by_new_ones(tokenizer) -> None:
    worker = FakeWorker("d0", cap=64)
    version = [0]

    async def scenario() -> None:
        # Every other group carries no signal (DAPO's filter): a step still takes two kept ones.
        stream, _ = _stream(tokenizer, [worker], version, batch=2, extra=0,
                            keep=lambda group: group[0].group_id % 2 == 0)
        report = await stream.take(timeout_s=30)
        assert sorted({t.group_id for t in report.trajectories}) == [0, 2]
        assert stream.dropped >= 1 and stream.started >= 4
        await stream.close()

    asyncio.run(scenario())


def test_a_step_whose_groups_keep_agreeing_ends_after_its_bound(tokenizer) -> None:
    worker = FakeWorker("d0", cap=64)
    version = [0]

    async def scenario() -> None:
        # No group carries a signal: after 3 dropped, the step takes the next two as they are.
        stream, _ = _stream(tokenizer, [worker], version, batch=2, extra=0, keep=lambda group: False,
                            max_dropped=3)
        report = await stream.take(timeout_s=30)
        assert len({t.group_id for t in report.trajectories}) == 2 and stream.dropped == 3
        await stream.close()

    asyncio.run(scenario())


def test_a_group_that_never_finishes_holds_up_no_step_and_a_step_times_out(tokenizer) -> None:
    worker = FakeWorker("d0", cap=64, stuck={"a1-0"})  # group 1 never finishes
    version = [0]

    async def scenario() -> None:
        stream, registry = _stream(tokenizer, [worker], version, batch=2, extra=0)
        report = await stream.take(timeout_s=30)
        assert {t.group_id for t in report.trajectories} == {0, 2}  # group 1 is still in play
        assert not report.lost
        # Step 1 wants two more; only group 3 can finish before the version moves on.
        report = await stream.take(timeout_s=3.0)  # group 1 never ends: the step times out
        assert {t.group_id for t in report.trajectories} == {3}
        unfinished = await stream.close()
        assert "a1-0" in {u.trajectory_id for u in unfinished}
        assert not any(registry.table.in_flight.values()) and worker.running == 0

    asyncio.run(scenario())


def test_a_group_expires_only_when_none_of_its_tokens_is_recent_enough(tokenizer) -> None:
    worker = FakeWorker("d0", cap=64, delay_s=0.005)
    version = [0]

    async def scenario() -> None:
        stream, _ = _stream(tokenizer, [worker], version, batch=2, extra=1)
        await stream.take(timeout_s=30)
        # One version on: the groups carried over (all of version 0) are within staleness 1.
        version[0] = 1
        report = await stream.take(timeout_s=30)
        assert len({t.group_id for t in report.trajectories}) == 2 and stream.expired == 0
        # Three versions on, with the workers still on version 0: whatever finished is all too
        # old, and the new groups (version 3) wait for a worker that has it.
        version[0] = 3
        report = await stream.take(timeout_s=1.0)
        assert not report.trajectories and stream.expired >= 1
        worker.policy_version = 3
        stream.refill()
        report = await stream.take(timeout_s=30)
        assert {v for t in report.trajectories for turn in t.turns for v in turn.versions} == {3}
        await stream.close()

    asyncio.run(scenario())
