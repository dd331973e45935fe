"""Trajectories, their flattening for the trainer, sharding, and episodes as token streams."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rose.engine import LLMEngine, SamplingParams
from rose.model import load_tokenizer
from rose.rl import Episode, Trajectory, TurnRecord, make_env, run_episodes, shard_by_group
from rose.rl.envs import FrozenLake


def test_turn_needs_one_logprob_and_version_per_token() -> None:
    with pytest.raises(ValueError, match="2 output tokens but 1 logprobs"):
        TurnRecord([1], [2, 3], [-0.5], [0, 0])


def test_flatten_masks_prompts_and_aligns_logprobs_and_versions() -> None:
    t = Trajectory("g", [TurnRecord([1, 2, 3], [4, 5], [-0.1, -0.2], [0, 0], reward=0.5),
                         TurnRecord([6], [7], [-0.3], [1], reward=1.0)], done=True, success=True)
    flat = t.flatten()
    assert flat.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert flat.loss_mask.tolist() == [False, False, False, True, True, False, True]
    assert flat.old_logprobs.tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, 0, -0.3])
    assert flat.versions.tolist() == [-1, -1, -1, 0, 0, -1, 1]
    assert (t.reward, t.num_generated_tokens, t.num_tokens) == (1.5, 3, 7)
    with pytest.raises(ValueError, match="no tokens"):
        Trajectory("empty").flatten()


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


def test_episode_tokens_follow_the_chat_template(tiny_qwen3: Path) -> None:
    tok = load_tokenizer(tiny_qwen3)
    env = FrozenLake()
    episode = Episode(env, tok, seed=3)
    assert episode.trajectory.group_id == ("frozenlake", 3)
    messages = [{"role": "system", "content": env.system_prompt},
                {"role": "user", "content": "PFFF\nFHFH\nFFFH\nHFFG\nYou are at row 0, column 0."}]
    assert episode.prompt_ids == tok.encode(tok.apply_chat_template(messages))
    # A reply closed by the end-of-message token, then one cut off without it.
    first = [*tok.encode("Down"), tok.eos_token_id]
    episode.record(first, [-1.0] * len(first), [0] * len(first))
    second = tok.encode("<action>Down</action>")
    result = episode.record(second, [-2.0] * len(second), [1] * len(second))
    messages += [{"role": "assistant", "content": "Down"},
                 {"role": "user", "content": "SFFF\nPHFH\nFFFH\nHFFG\nYou are at row 1, column 0."},
                 {"role": "assistant", "content": "<action>Down</action>"},
                 {"role": "user", "content": result.observation}]
    expected = tok.apply_chat_template(messages)
    assert tok.decode(episode.prompt_ids, skip_special_tokens=False) == expected
    turns = episode.trajectory.turns
    assert [t.text for t in turns] == ["Down", "<action>Down</action>"]
    assert turns[1].prompt_ids == tok.encode("\n<|im_start|>user\nSFFF\nPHFH\nFFFH\nHFFG\n"
                                             "You are at row 1, column 0.<|im_end|>\n<|im_start|>assistant\n")
    flat = episode.trajectory.flatten()
    assert flat.token_ids.tolist() == episode.prompt_ids[:len(flat.token_ids)]
    assert int(flat.loss_mask.sum()) == len(first) + len(second)


def test_episode_ends_with_the_env_and_at_the_context_limit(tiny_qwen3: Path) -> None:
    tok = load_tokenizer(tiny_qwen3)
    episode = Episode(make_env("frozenlake"), tok, seed=0, group_id="g")
    for action in ("Down", "Down", "Right", "Down", "Right", "Right"):
        ids = tok.encode(action)
        episode.record(ids, [0.0] * len(ids), [0] * len(ids))
    t = episode.trajectory
    assert episode.done and t.done and t.success and not t.truncated and t.reward == 1.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        episode.record([1], [0.0], [0])
    short = Episode(make_env("frozenlake"), tok, seed=0, max_context_tokens=len(episode.prompt_ids[:90]) + 40)
    ids = tok.encode("Up")
    short.record(ids, [0.0], [0])
    assert short.done and short.trajectory.truncated and not short.trajectory.done


def test_run_episodes_on_the_engine(tiny_qwen3: Path) -> None:
    tok = load_tokenizer(tiny_qwen3)
    engine = LLMEngine.from_pretrained(tiny_qwen3, kv_cache_bytes=4 * 1024**2)
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=5, stop_token_ids=tok.stop_token_ids)

    def play() -> list[Trajectory]:
        episodes = [Episode(make_env("frozenlake", max_turns=3), tok, seed=0) for _ in range(4)]
        return run_episodes(engine, episodes, params)

    trajectories = play()
    assert all(t.done and len(t.turns) == 3 for t in trajectories)  # random replies: invalid, 3 turns
    outputs = [tuple(t.turns[0].output_ids) for t in trajectories]
    assert len(set(outputs)) > 1  # the group's samples differ
    assert outputs == [tuple(t.turns[0].output_ids) for t in play()]  # and the seed repeats them
    turn = trajectories[0].turns[0]
    assert turn.versions == [0] * len(turn.output_ids) and all(lp < 0 for lp in turn.logprobs)
    # The engine's logprobs are the model's own: recompute them from the flattened sequence.
    flat = trajectories[0].flatten()
    with torch.no_grad():
        logp = engine.model(flat.token_ids[None, :-1]).float().log_softmax(-1)[0]
    recomputed = logp.gather(-1, flat.token_ids[1:, None])[:, 0][flat.loss_mask[1:]]
    assert recomputed.tolist() == pytest.approx(flat.old_logprobs[flat.loss_mask].tolist(), abs=1e-4)
