"""GRPO and DAPO pieces against numbers computed by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rose.rl import Objective, Trajectory, TurnRecord, group_advantages, informative_groups, overlong_penalty
from rose.rl.advantages import returns_to_go
from rose.rl.losses import aggregate, clipped_surrogate, k3_kl, truncated_is_weights


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
    # pi = 0.5, pi_ref = 0.25: 0.5 - ln 0.5 - 1 = 0.19314718. A reference far more likely than
    # the policy (log-ratio 30) is clamped: at most 10, as verl's low_var_kl.
    kl = k3_kl(torch.log(torch.tensor([0.5, 0.3, 1e-13])), torch.log(torch.tensor([0.25, 0.3, 1.0])))
    assert kl.tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0, 10.0], abs=1e-6)


def test_aggregation_by_hand() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert float(aggregate(values, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(values, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    # Dr. GRPO: each sequence's sum over a constant (4 here), not over its own length.
    assert float(aggregate(values, mask, "seq-mean-token-sum-norm", norm_tokens=4)) == pytest.approx(
        (6 / 4 + 4 / 4) / 2)
    # A slice of a larger batch divides by the whole batch's count.
    assert float(aggregate(values, mask, "token-mean", denominator=8)) == pytest.approx(10 / 8)
    with pytest.raises(ValueError, match="aggregation must be one of token-mean, seq-mean-token-mean"):
        aggregate(values, mask, "tokens")


def test_dual_clip_and_the_log_ratio_clamp_bound_off_policy_tokens() -> None:
    """Ratios far from 1, as stale or mismatched behaviour logprobs give."""
    old = torch.zeros(5)
    logp = torch.tensor([math.log(5.0), math.log(5.0), 30.0, 30.0, math.log(2.0)]).requires_grad_()
    adv = torch.tensor([-1.0, 1.0, -2.0, 1.0, -1.0])
    loss, clipped = clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    # r=5, A=-1: PPO max(5, 1.28) = 5, dual-clipped to 3. r=5, A=+1: clipped at 1.28.
    # r=e^20 (log-ratio 30 clamped to 20), A=-2: dual clip 3 x 2 = 6; A=+1: 1.28.
    # r=2, A=-1: PPO 2 < 3, unchanged, with its gradient.
    assert loss.tolist() == pytest.approx([3.0, -1.28, 6.0, -1.28, 2.0])
    assert clipped.tolist() == [True, True, True, True, False]
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 2.0])  # d(-r A)/d logp = -r A
    # Without the dual clip (c = inf) a negative-advantage token's loss grows with its ratio.
    plain, _ = clipped_surrogate(logp.detach()[:1], old[:1], adv[:1], 0.2, 0.28, clip_ratio_c=math.inf)
    assert plain.tolist() == pytest.approx([5.0])


def test_truncated_importance_weights_by_hand() -> None:
    old = torch.log(torch.tensor([0.6, 0.2, 0.5]))
    behaviour = torch.log(torch.tensor([0.2, 0.4, 0.5]))
    # pi_old / pi_behaviour = 3 (capped at 2), 0.5, 1.
    assert truncated_is_weights(old, behaviour, cap=2.0).tolist() == pytest.approx([2.0, 0.5, 1.0])


def test_objective_loss_off_policy_with_importance_weights_by_hand() -> None:
    objective = Objective(clip_low=0.2, clip_high=0.2, aggregation="token-mean", tis_cap=2.0)
    logp = torch.log(torch.tensor([[0.3, 0.5, 0.1]]))
    old = torch.log(torch.tensor([[0.2, 0.5, 0.4]]))  # the trainer's own, recomputed
    behaviour = torch.log(torch.tensor([[0.05, 1.0, 0.4]]))  # the engine's: weights 2 (4 capped), 0.5, 1
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, sums = objective.loss(logp, old, adv, mask, behaviour_logprobs=behaviour)
    # Ratios 1.5 (A=+1: clipped to 1.2), 1 (A=-1: 1), 0.25 (A=-1: max(0.25, 0.8) = 0.8).
    expected = (2.0 * -1.2 + 0.5 * 1.0 + 1.0 * 0.8) / 3
    assert float(loss) == pytest.approx(expected)
    assert float(sums["is"]) == pytest.approx(3.5) and float(sums["clipped"]) == 2


def _trajectory(group: str, reward: float, generated: int, success: bool = False) -> Trajectory:
    turn = TurnRecord([1, 2], list(range(3, 3 + generated)), [0.0] * generated, [0] * generated, reward)
    return Trajectory(group, [turn], done=True, success=success)


def test_grpo_prepare_keeps_everything_and_normalises_per_group() -> None:
    batch = [_trajectory("a", 1, 2, True), _trajectory("a", 0, 2), _trajectory("b", 1, 3, True),
             _trajectory("b", 1, 3, True)]
    prepared = Objective.grpo().prepare(batch)
    assert len(prepared.trajectories) == 4
    assert [a for (a,) in prepared.advantages] == pytest.approx([0.70710678, -0.70710678, 0, 0], abs=2e-6)
    assert prepared.stats == {"trajectories": 4, "reward_sum": 3, "successes": 3, "groups": 2,
                              "groups_kept": 2}


def test_dapo_prepare_shapes_overlong_per_response_and_drops_groups_without_outcome_signal() -> None:
    objective = Objective.dapo(overlong_max_tokens=10, overlong_cache_tokens=4)
    # Group a: outcomes 1, 1; only the overlong shaping differs (8 tokens: -0.5): no outcome
    # signal, dropped. Group b: outcomes 0, 0: dropped. Group c: outcomes 1 (its response of 8
    # tokens shaped to 0.5) and 0: kept, normalised on the shaped rewards.
    batch = [_trajectory("a", 1, 2), _trajectory("a", 1, 8), _trajectory("b", 0, 2), _trajectory("b", 0, 2),
             _trajectory("c", 1, 8), _trajectory("c", 0, 2)]
    prepared = objective.prepare(batch)
    assert [t.group_id for t in prepared.trajectories] == ["c", "c"]
    assert [a for (a,) in prepared.advantages] == pytest.approx([0.70710678, -0.70710678], abs=2e-6)
    assert prepared.stats["groups_kept"] == 1
    # Per response, averaged over the turns: turns of 8 and 2 tokens cost (-0.5 + 0) / 2, where
    # their sum (10 tokens) would cost -1.
    two_turns = Trajectory("d", [TurnRecord([1], [3] * 8, [0.0] * 8, [0] * 8, 1.0),
                                 TurnRecord([1], [3] * 2, [0.0] * 2, [0] * 2, 0.0)], done=True)
    shaped = Objective.grpo(overlong_max_tokens=10, overlong_cache_tokens=4, scale_advantages=False).prepare(
        [two_turns, _trajectory("d", 0, 2)])
    assert [a for a, _ in shaped.advantages[:1]] == pytest.approx([(0.75 - 0.0) / 2])


def test_a_long_success_never_scores_below_a_short_failure() -> None:
    # Every one of a success's 6 turns overlong (-1 each) costs it -1 in all, not -6.
    overlong = TurnRecord([1], [3] * 11, [0.0] * 11, [0] * 11, 0.0)
    success = Trajectory("g", [*[overlong] * 5, dataclasses.replace(overlong, reward=1.0)], done=True)
    failure = _trajectory("g", 0, 2)
    prepared = Objective.dapo(overlong_max_tokens=10, overlong_cache_tokens=4).prepare([success, failure])
    assert prepared.advantages[0][0] >= prepared.advantages[1][0]


def test_returns_to_go_by_hand() -> None:
    assert returns_to_go([1.0, 0.0, 2.0], 0.5) == pytest.approx([1 + 0.5 * (0 + 0.5 * 2), 0.5 * 2, 2])
    assert returns_to_go([], 0.9) == []


def test_step_advantages_compare_turns_from_the_same_state() -> None:
    """GiGPO by hand: two episodes of one group start in state [1] (turn 0). Episode x moves to
    state [7] (+0.5) and then falls (-0.5); episode y stays in state [8] (+0) and then moves to
    state [7] (+0.5), where it also falls (-0.5). Both return 0, so GRPO's episode advantages are 0;
    the step level still tells the turns apart."""
    def turn(prompt: list[int], reward: float) -> TurnRecord:
        return TurnRecord(prompt, [3], [0.0], [0], reward)

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
    objective = Objective(clip_low=0.2, clip_high=0.28, kl_coef=0.5, aggregation="token-mean")
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

    assert settings(grpo) == (0.2, 0.2, "seq-mean-token-mean", False)
    assert settings(dapo) == (0.2, 0.28, "token-mean", True)
    dr = Objective.dr_grpo()
    assert (dr.scale_advantages, dr.aggregation) == (False, "seq-mean-token-sum-norm")
    assert Objective.named("dr_grpo", norm_tokens=64).norm_tokens == 64
    with pytest.raises(ValueError, match="objective must be one of grpo, dr_grpo, dapo"):
        Objective.named("ppo")
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
    (dict(clip_ratio_c=1.0), "clip_ratio_c must be > 1"),
    (dict(tis_cap=-1.0), "tis_cap must be a finite number >= 0"),
    (dict(max_version_lag=-1), "max_version_lag must be an integer >= 0"),
    (dict(norm_tokens=0), "norm_tokens must be an integer >= 1"),
    (dict(recompute_old_logprobs=1), "recompute_old_logprobs must be true or false"),
])
def test_objective_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Objective(**kwargs)
