"""GRPO and DAPO pieces against numbers computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rose.rl import Objective, Trajectory, Turn, group_advantages, informative_groups, overlong_penalty
from rose.rl.advantages import returns_to_go
from rose.rl.losses import aggregate, clipped_surrogate, k3_kl


def test_group_advantages_by_hand() -> None:
    # Group a: rewards 1, 2, 3 -> mean 2, unbiased std 1 -> -1, 0, 1.
    # Group b: 1, 0 -> mean 0.5, std sqrt(0.5) -> +-0.5 / 0.70710678 = +-0.70710678.
    # Group c: one sample -> 0. Group d: all equal -> 0 / (0 + eps) = 0.
    adv = group_advantages([1, 1, 2, 0, 3, 5, 4, 4], ["a", "b", "a", "b", "a", "c", "d", "d"], eps=1e-6)
    expected = [-1, 0.70710678, 0, -0.70710678, 1, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected, abs=2e-6)
    assert adv.dtype == torch.float32


def test_group_advantages_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="one reward per group id"):
        group_advantages([1.0, 2.0], ["a"])


def test_unscaled_advantages_are_centred_rewards() -> None:
    """Dr. GRPO: a group of successes where one replied invalidly once (1.5 vs 1.4) gets small
    advantages, where GRPO's std makes them as large as a success against a failure."""
    rewards, groups = [1.5, 1.5, 1.5, 1.4, 1.5, 0.0], ["a", "a", "a", "a", "b", "b"]
    assert group_advantages(rewards, groups, scale=False).tolist() == pytest.approx(
        [0.025, 0.025, 0.025, -0.075, 0.75, -0.75])
    assert group_advantages(rewards, groups)[3] == pytest.approx(-1.5, abs=1e-4)  # -0.075 / 0.05
    prepared = Objective.grpo(scale_advantages=False).prepare(
        [_trajectory(g, r, 1) for r, g in zip(rewards, groups, strict=True)])
    assert [a for (a,) in prepared.advantages] == pytest.approx([0.025, 0.025, 0.025, -0.075, 0.75, -0.75])


def test_informative_groups_drops_equal_reward_groups() -> None:
    keep = informative_groups([1, 1, 0, 1, 0.5, 0.5], ["a", "a", "b", "b", "c", "c"])
    assert keep.tolist() == [False, False, True, True, False, False]


def test_overlong_penalty_by_hand() -> None:
    # L_max 10, L_cache 4: no penalty up to 6, (6 - L) / 4 up to 10, -1 beyond.
    assert overlong_penalty([5, 6, 8, 10, 11], 10, 4).tolist() == pytest.approx([0, 0, -0.5, -1, -1])
    with pytest.raises(ValueError, match="cache_tokens < max_tokens"):
        overlong_penalty([1], 4, 4)


def test_clipped_surrogate_by_hand() -> None:
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 0.5, 1.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped = clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # r=1.5, A=+1: min(1.5, 1.28) = 1.28.   r=0.5, A=+1: min(0.5, 0.8) = 0.5.
    # r=0.5, A=-1: min(-0.5, -0.8) = -0.8.  r=1.5, A=-1: min(-1.5, -1.28) = -1.5.
    assert loss.tolist() == pytest.approx([-1.28, -0.5, 0.8, 1.5])
    assert clipped.tolist() == [True, False, True, False]


def test_clipped_surrogate_gradient_is_zero_where_clipped() -> None:
    logp = torch.log(torch.tensor([1.5, 1.1])).requires_grad_()
    loss, _ = clipped_surrogate(logp, torch.zeros(2), torch.ones(2), 0.2, 0.2)
    loss.sum().backward()
    # Clipped: no gradient. Unclipped: d(-r * A)/d logp = -r = -1.1.
    assert logp.grad.tolist() == pytest.approx([0.0, -1.1])


def test_k3_kl_by_hand() -> None:
    # pi = 0.5, pi_ref = 0.25: 0.5 - ln 0.5 - 1 = 0.19314718.
    kl = k3_kl(torch.log(torch.tensor([0.5, 0.3])), torch.log(torch.tensor([0.25, 0.3])))
    assert kl.tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-7)


def test_aggregation_by_hand() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert float(aggregate(values, mask, "token")) == pytest.approx(10 / 4)
    assert float(aggregate(values, mask, "sequence")) == pytest.approx((2 + 4) / 2)
    # A slice of a larger batch divides by the whole batch's count.
    assert float(aggregate(values, mask, "token", denominator=8)) == pytest.approx(10 / 8)
    with pytest.raises(ValueError, match="aggregation must be one of sequence, token"):
        aggregate(values, mask, "tokens")


def _trajectory(group: str, reward: float, generated: int, success: bool = False) -> Trajectory:
    turn = Turn([1, 2], list(range(3, 3 + generated)), [0.0] * generated, [0] * generated, reward)
    return Trajectory(group, [turn], done=True, success=success)


def test_grpo_prepare_keeps_everything_and_normalises_per_group() -> None:
    batch = [_trajectory("a", 1, 2, True), _trajectory("a", 0, 2), _trajectory("b", 1, 3, True),
             _trajectory("b", 1, 3, True)]
    prepared = Objective.grpo().prepare(batch)
    assert len(prepared.trajectories) == 4
    assert [a for (a,) in prepared.advantages] == pytest.approx([0.70710678, -0.70710678, 0, 0], abs=2e-6)
    assert prepared.stats == {"trajectories": 4, "reward_sum": 3, "successes": 3, "groups": 2,
                              "groups_kept": 2}


def test_dapo_prepare_shapes_overlong_and_drops_flat_groups() -> None:
    objective = Objective.dapo(overlong_max_tokens=10, overlong_cache_tokens=4)
    # Group a: rewards 1, 1 but 8 generated tokens -> 1 - 0.5: differ, so kept.
    batch = [_trajectory("a", 1, 2), _trajectory("a", 1, 8), _trajectory("b", 0, 2), _trajectory("b", 0, 2)]
    prepared = objective.prepare(batch)
    assert [t.group_id for t in prepared.trajectories] == ["a", "a"]
    assert [a for (a,) in prepared.advantages] == pytest.approx([0.70710678, -0.70710678], abs=2e-6)
    assert prepared.stats["groups_kept"] == 1


def test_returns_to_go_by_hand() -> None:
    assert returns_to_go([1.0, 0.0, 2.0], 0.5) == pytest.approx([1 + 0.5 * (0 + 0.5 * 2), 0.5 * 2, 2])
    assert returns_to_go([], 0.9) == []


def test_step_advantages_compare_turns_from_the_same_state() -> None:
    """GiGPO by hand: two episodes of one group start in state [1] (turn 0). Episode x moves to
    state [7] (+0.5) and then falls (-0.5); episode y stays in state [8] (+0) and then moves to
    state [7] (+0.5), where it also falls (-0.5). Both return 0, so GRPO's episode advantages are 0;
    the step level still tells the turns apart."""
    def turn(prompt: list[int], reward: float) -> Turn:
        return Turn(prompt, [3], [0.0], [0], reward)

    x = Trajectory("g", [turn([1], 0.5), turn([7], -0.5)], done=True)
    y = Trajectory("g", [turn([1], 0.0), turn([8], 0.5), turn([7], -0.5)], done=True)
    plain = Objective.grpo().prepare([x, y])
    assert plain.advantages == [[0.0, 0.0], [0.0, 0.0, 0.0]]
    prepared = Objective.grpo(step_advantage_weight=1.0, discount=1.0).prepare([x, y])
    # Returns-to-go: x (0, -0.5), y (0, 0, -0.5). Anchor [1]: x 0 vs y 0 -> 0, 0. Anchor [7]:
    # x -0.5 vs y -0.5 -> 0, 0. Anchor [8]: y alone -> 0. Now with discount 0.5: x (0.25, -0.5),
    # y (0.125, 0.25, -0.5): anchor [1] holds 0.25 and 0.125 -> +-0.70710678 (two samples).
    assert prepared.advantages == [[0.0, 0.0], [0.0, 0.0, 0.0]]
    prepared = Objective.grpo(step_advantage_weight=2.0, discount=0.5).prepare([x, y])
    assert prepared.advantages[0] == pytest.approx([2 * 0.70710678, 0.0], abs=1e-4)
    assert prepared.advantages[1] == pytest.approx([-2 * 0.70710678, 0.0, 0.0], abs=1e-4)
    with pytest.raises(ValueError, match="discount must be in"):
        Objective.grpo(discount=1.5)
    with pytest.raises(ValueError, match="step_advantage_weight must be a finite number"):
        Objective.grpo(step_advantage_weight=-1)


def test_objective_loss_with_kl_and_token_aggregation() -> None:
    objective = Objective(clip_low=0.2, clip_high=0.28, kl_coef=0.5, aggregation="token")
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    ref = torch.log(torch.tensor([[1.5, 1.0, 0.5]]))
    mask = torch.tensor([[True, True, False]])
    loss, sums = objective.loss(logp, torch.zeros(1, 3), torch.ones(1, 1), mask, ref)
    kl_second = 2.0 - math.log(2.0) - 1  # pi_ref / pi = 2
    assert float(sums["kl"]) == pytest.approx(kl_second)
    assert float(sums["clipped"]) == 1
    assert float(loss) == pytest.approx((-1.28 - 0.5 + 0.5 * kl_second) / 2)
    with pytest.raises(ValueError, match="reference policy"):
        objective.loss(logp, torch.zeros(1, 3), torch.ones(1, 1), mask)


def test_presets_follow_the_papers() -> None:
    grpo, dapo = Objective.grpo(), Objective.dapo()
    def settings(o: Objective) -> tuple:
        return o.clip_low, o.clip_high, o.aggregation, o.dynamic_sampling

    assert settings(grpo) == (0.2, 0.2, "sequence", False)
    assert settings(dapo) == (0.2, 0.28, "token", True)
    assert (dapo.overlong_max_tokens, dapo.overlong_cache_tokens, dapo.kl_coef) == (20480, 4096, 0.0)
    assert Objective.grpo(kl_coef=0.04).kl_coef == 0.04


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(clip_low=1.0), "clip_low must be < 1"),
    (dict(clip_high=-0.1), "clip_high must be a finite number >= 0"),
    (dict(kl_coef=float("nan")), "kl_coef"),
    (dict(aggregation="mean"), "aggregation must be one of"),
    (dict(dynamic_sampling="yes"), "dynamic_sampling must be true or false"),
    (dict(scale_advantages=0), "scale_advantages must be true or false"),
    (dict(overlong_max_tokens=100, overlong_cache_tokens=200), "cache_tokens < max_tokens"),
])
def test_objective_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Objective(**kwargs)
