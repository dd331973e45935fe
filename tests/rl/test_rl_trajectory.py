"""Trajectories, their flattening for the trainer, and sharding."""

from __future__ import annotations

import pytest

from rose.rl import Trajectory, TurnRecord, shard_by_group


def test_turn_needs_one_logprob_and_version_per_token() -> None:
    with pytest.raises(ValueError, match="2 output tokens but 1 logprobs"):
        TurnRecord([1], [2, 3], [-0.5], [0, 0])


def test_flatten_masks_prompts_and_aligns_logprobs_and_versions() -> None:
    t = Trajectory("g", [TurnRecord([1, 2, 3], [4, 5], [-0.1, -0.2], [0, 0], reward=0.5),
                         TurnRecord([6], [7], [-0.3], [1], reward=1.0)], done=True, success=True)
    [flat] = t.flatten()
    assert flat.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert flat.loss_mask.tolist() == [False, False, False, True, True, False, True]
    assert flat.old_logprobs.tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, 0, -0.3])
    assert flat.versions.tolist() == [-1, -1, -1, 0, 0, -1, 1]
    assert flat.turns.tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert (t.reward, t.num_generated_tokens, t.num_tokens) == (1.5, 3, 7)
    with pytest.raises(ValueError, match="no tokens"):
        Trajectory("empty").flatten()


def test_a_turn_that_starts_a_new_sequence_flattens_on_its_own() -> None:
    """Turn 1's prompt is a whole new rendering (its template rewrote turn 0): two sequences, the
    second holding turns 1 and 2, which continues it."""
    t = Trajectory("g", [TurnRecord([1, 2], [3], [-0.1], [0]),
                         TurnRecord([1, 4], [5], [-0.2], [0], new_sequence=True),
                         TurnRecord([6], [7, 8], [-0.3, -0.4], [1, 1])])
    assert [len(run) for run in t.segments()] == [1, 2]
    first, second = t.flatten()
    assert (first.token_ids.tolist(), first.loss_mask.tolist(), first.turns.tolist()) == (
        [1, 2, 3], [False, False, True], [0, 0, 0])
    assert second.token_ids.tolist() == [1, 4, 5, 6, 7, 8]
    assert second.loss_mask.tolist() == [False, False, True, False, True, True]
    assert second.old_logprobs.tolist() == pytest.approx([0, 0, -0.2, 0, -0.3, -0.4])
    assert second.turns.tolist() == [1, 1, 1, 2, 2, 2]


def _traj(group: str, tokens: int) -> Trajectory:
    return Trajectory(group, [TurnRecord([0] * (tokens - 1), [1], [0.0], [0])])


def test_shard_by_group_keeps_groups_whole_and_balances_tokens() -> None:
    batch = [_traj("a", 10), _traj("b", 30), _traj("a", 10), _traj("c", 15), _traj("d", 14)]
    shards = shard_by_group(batch, 2)
    groups = [{t.group_id for t in s} for s in shards]
    # Largest first onto the lighter rank: b (30) -> 0, a (20) -> 1, c (15) -> 1, d (14) -> 0.
    assert groups == [{"b", "d"}, {"a", "c"}]
    assert shard_by_group(batch, 1) == [sorted(batch, key=lambda t: t.group_id != "b")]
    assert shard_by_group(batch, 8)[7] == []
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        shard_by_group(batch, 0)
