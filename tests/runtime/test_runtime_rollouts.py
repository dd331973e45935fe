"""The step's rollout is one function named in the config (rose.runtime.rollouts): the cluster
calls the configured one with the step's context, and a name that cannot be a rollout function
is refused before anything starts."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from rose.model import load_tokenizer
from rose.rl import Trajectory, TurnRecord
from rose.rollout.manager import RolloutManager, RolloutReport
from rose.rollout.registry import WorkerRegistry
from rose.runtime.cluster import Cluster
from rose.runtime.config import Mode, load_config
from rose.runtime.rollouts import (
    RolloutContext,
    heldout_rollout,
    informative,
    multi_turn_rollout,
    stream_rollouts,
)

CALLS: list[tuple[int, int, str]] = []
NOT_A_FUNCTION = 42


async def recording_rollout(ctx: RolloutContext) -> RolloutReport:
    CALLS.append((ctx.step, ctx.version, ctx.config.rollout.function))
    return RolloutReport([], [], 0.0)


def test_the_configured_rollout_function_runs_the_step(tmp_path: Path) -> None:
    name = f"{__name__}:recording_rollout"
    cluster = Cluster(load_config(None, [f"rollout.function={name}", f"train.out_dir={tmp_path}"]),
                      Mode.FIXED, tmp_path)
    cluster.tokenizer = None  # start() loads it; this rollout does not use it
    try:
        report = cluster.rollout(3)
    finally:
        cluster.loop.close()
    assert [(3, 0, name)] == CALLS and report.trajectories == []


@pytest.mark.parametrize(("function", "error"), [
    ("rose.runtime.rollouts", "must be 'package.module:function'"),
    ("no_such_module:rollout", "cannot be imported: No module named 'no_such_module'"),
    ("rose.runtime.rollouts:no_such_function", "cannot be imported"),
    (f"{__name__}:NOT_A_FUNCTION", "is not a function"),
])
def test_a_bad_rollout_function_is_refused_with_its_name(function: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)) as info:
        load_config(None, [f"rollout.function={function}"])
    assert str(info.value).startswith("config: rollout.function") and repr(function) in str(info.value)


def _trajectories(rewards: dict[str, list[float]]) -> list[Trajectory]:
    return [Trajectory(group, [TurnRecord([1], [2], [0.0], [0], reward)], done=True)
            for group, rs in rewards.items() for reward in rs]


def test_informative_groups_are_those_whose_outcomes_differ() -> None:
    assert informative(_trajectories({"a": [1, 0], "b": [1, 1], "c": [0, 0.5]})) == ["a", "c"]
    assert informative([]) == []


def _scripted_rounds(monkeypatch: pytest.MonkeyPatch, rounds: dict[str, dict[str, list[float]]]) -> list[str]:
    """Each sampling round (by its trajectory prefix) returns the groups given, with the rewards
    given; the list of the prefixes played."""
    played: list[str] = []

    async def run(self: RolloutManager, episodes: list, version: int, prefix: str = "t",
                  timeout_s: float | None = None, agent: object = None) -> RolloutReport:
        played.append(prefix)
        return RolloutReport(_trajectories(rounds[prefix]), [], 1.0)

    monkeypatch.setattr(RolloutManager, "run", run)
    return played


def test_dynamic_sampling_refills_the_batch_with_informative_groups(tiny_qwen3: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 0 holds one informative group of the two wanted; round 1 adds the first informative
    one it finds, and no third round is played."""
    played = _scripted_rounds(monkeypatch, {"s0-": {"a": [1, 0], "b": [1, 1]},
                                            "s0r1-": {"c": [0, 1], "d": [1, 0], "e": [0, 0]}})
    config = load_config(None, ["rollout.groups=2", "rollout.max_sampling_rounds=3",
                                f"train.out_dir={tmp_path}"])
    ctx = RolloutContext(config, 0, 0, load_tokenizer(tiny_qwen3), WorkerRegistry())
    report = asyncio.run(multi_turn_rollout(ctx))
    assert played == ["s0-", "s0r1-"]
    assert [t.group_id for t in report.trajectories] == ["a", "a", "b", "b", "c", "c"]
    assert report.seconds == 2.0


def test_dapo_refills_its_batch_by_default(tiny_qwen3: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With train.objective dapo and no rollout.max_sampling_rounds, rounds go on until the
    batch holds `rollout.groups` informative groups; with grpo, one round."""
    played = _scripted_rounds(monkeypatch, {"s0-": {"a": [1, 1]}, "s0r1-": {"b": [0, 0]},
                                            "s0r2-": {"c": [0, 1]}})
    for objective, expected in (("dapo", ["s0-", "s0r1-", "s0r2-"]), ("grpo", ["s0-"])):
        played.clear()
        config = load_config(None, ["rollout.groups=1", f"train.objective={objective}",
                                    f"train.out_dir={tmp_path}"])
        ctx = RolloutContext(config, 0, 0, load_tokenizer(tiny_qwen3), WorkerRegistry())
        report = asyncio.run(multi_turn_rollout(ctx))
        assert played == expected
        assert {t.group_id for t in report.trajectories} == ({"a", "c"} if objective == "dapo" else {"a"})


@pytest.mark.parametrize(("objective", "max_dropped"), [("grpo", 0), ("dapo", 7 * 2)])
def test_the_stream_draws_a_synchronous_runs_seeds_in_order_from_its_step(
        objective: str, max_dropped: int, tiny_qwen3: Path, tmp_path: Path) -> None:
    """Asynchronous RL's k-th group is a synchronous run's k-th seed: from step 3 (a resumed run)
    with 2 groups a step, the first group is seed 6's; DAPO's filter and its bound are set."""
    config = load_config(None, ["rollout.groups=2", "rollout.group_size=3", "train.max_staleness=1",
                                f"train.objective={objective}", f"train.out_dir={tmp_path}"])
    ctx = RolloutContext(config, 3, 3, load_tokenizer(tiny_qwen3), WorkerRegistry())

    async def check() -> None:
        stream = stream_rollouts(ctx, lambda: 3)
        first = stream.new_group(0)
        assert [e.trajectory.seed for e in first] == [config.train.seed * 100003 + 6] * 3
        assert {e.trajectory.group_id for e in first} == {("a", 6)}
        assert (stream.batch, stream.extra, stream.max_dropped) == (2, 1, max_dropped)
        await stream.close()

    asyncio.run(check())


def test_heldout_rollout_plays_the_same_heldout_maps(tiny_qwen3: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With eval.every on, the step's episodes draw training maps and the evaluation the same
    eval.episodes held-out maps at every step, at the rollouts' temperature unless
    eval.temperature says otherwise."""
    played: list[tuple[str, list, float]] = []

    async def run(self: RolloutManager, episodes: list, version: int, prefix: str = "t",
                  timeout_s: float | None = None, agent: object = None) -> RolloutReport:
        played.append((prefix, episodes, self.params.temperature))
        return RolloutReport([], [], 1.0)

    monkeypatch.setattr(RolloutManager, "run", run)
    config = load_config(None, ["eval.every=2", "eval.episodes=5", "env.options.random_map=true",
                                "rollout.groups=3", "rollout.temperature=0.7", f"train.out_dir={tmp_path}"])
    tok = load_tokenizer(tiny_qwen3)
    for step in (0, 2):
        asyncio.run(heldout_rollout(RolloutContext(config, step, 0, tok, WorkerRegistry())))
    asyncio.run(multi_turn_rollout(RolloutContext(config, 0, 0, tok, WorkerRegistry())))
    config.eval.temperature = 0.0
    asyncio.run(heldout_rollout(RolloutContext(config, 4, 0, tok, WorkerRegistry())))
    (first, held_out, t_eval), (_, again, _), (rollout, trained, t_train), (_, _, greedy) = played
    assert (first, rollout, t_eval, t_train, greedy) == ("e0-", "s0-", 0.7, 0.7, 0.0)
    assert len(held_out) == 5 and len(trained) == 24
    assert [e.env.desc for e in held_out] == [e.env.desc for e in again]
    assert {e.env.split for e in held_out} == {"eval"} and {e.env.split for e in trained} == {"train"}
    assert not {e.env.desc for e in held_out} & {e.env.desc for e in trained}
