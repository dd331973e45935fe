"""Which objective the trainer optimises: GRPO or DAPO settings over the pure functions of
`advantages.py` and `losses.py`.

`Objective.grpo()` is DeepSeekMath's GRPO: symmetric clip 0.2, sequence-level averaging
(`seq-mean-token-mean`), an optional k3 KL penalty (the paper used beta = 0.04; the default here
is 0, as in most recent recipes, which saves the reference model). `Objective.dr_grpo()` is Liu
et al.'s Dr. GRPO: GRPO without the std division and without the per-sequence 1/|o_i|
(`seq-mean-token-sum-norm`). `Objective.dapo()` is Yu et al.'s DAPO: clip-higher (eps_low 0.2,
eps_high 0.28), dynamic sampling, token-level averaging (`token-mean`), the soft overlong penalty
per response, averaged over a trajectory's turns (the paper's L_max 20480 with a 4096-token
cache; `rose train` sets them from rollout.max_tokens) and no KL.

Every objective guards off-policy tokens (losses.py): the log-ratio clamp and dual clip always;
with `recompute_old_logprobs` the trainer recomputes the old policy's logprobs and weights each
token by the truncated importance ratio to the behaviour policy that sampled it (`tis_cap`);
`max_version_lag` drops tokens sampled more than that many versions ago.

Either takes GiGPO's step-level credit for multi-turn episodes (Feng et al. 2025, arXiv
2505.10978) with `step_advantage_weight` > 0: a turn's advantage is its episode's GRPO advantage
plus that weight times the advantage of its discounted return-to-go among the turns of its group
that started from the same state (the same new prompt tokens: the same observation). An episode
where a good move is followed by a fall then still credits the move, where GRPO alone blames
every turn for the fall.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from rose.rl import losses
from rose.rl.advantages import group_advantages, informative_groups, overlong_penalty, returns_to_go
from rose.rl.trajectory import Trajectory

OBJECTIVES = ("grpo", "dr_grpo", "dapo")


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The trajectories that train, one advantage per turn each, and sums over the whole batch
    (sums, so that data-parallel ranks can add theirs up)."""

    trajectories: list[Trajectory]
    advantages: list[list[float]]
    stats: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Objective:
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual clip: a negative-advantage token's loss is at most c |A|
    kl_coef: float = 0.0
    aggregation: str = "seq-mean-token-mean"
    norm_tokens: int = 1024  # seq-mean-token-sum-norm's constant (Dr. GRPO: the generation budget)
    dynamic_sampling: bool = False
    overlong_max_tokens: int | None = None  # per response (turn); None: no overlong penalty
    overlong_cache_tokens: int = 0
    recompute_old_logprobs: bool = False  # the trainer's own old logprobs, and truncated IS
    tis_cap: float = 2.0  # truncated importance sampling's cap (with recompute_old_logprobs)
    max_version_lag: int | None = None  # tokens sampled more versions ago than this do not train
    advantage_eps: float = 1e-6
    scale_advantages: bool = True  # divide by the group's std (GRPO); False: Dr. GRPO
    step_advantage_weight: float = 0.0  # GiGPO's omega; 0: every turn gets the episode's advantage
    discount: float = 0.95  # of the returns-to-go that step-level advantages compare (GiGPO's gamma)

    def __post_init__(self) -> None:
        for name in ("clip_low", "clip_high", "kl_coef", "advantage_eps", "step_advantage_weight",
                     "discount", "tis_cap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"objective: {name} must be a finite number >= 0, got {value!r}")
        if self.discount > 1:
            raise ValueError(f"objective: discount must be in [0, 1], got {self.discount}")
        if self.clip_low >= 1:
            raise ValueError(f"objective: clip_low must be < 1 (the ratio's floor is 1 - clip_low), "
                             f"got {self.clip_low}")
        if not self.clip_ratio_c > 1:  # NaN fails too; inf turns the dual clip off
            raise ValueError(f"objective: clip_ratio_c must be > 1 (dual clip), got {self.clip_ratio_c}")
        losses.check_aggregation(self.aggregation)
        for name, value in (("norm_tokens", self.norm_tokens), ("max_version_lag", self.max_version_lag)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0
                                      or (name == "norm_tokens" and value < 1)):
                raise ValueError(f"objective: {name} must be an integer >= {int(name == 'norm_tokens')}, "
                                 f"got {value!r}")
        for name in ("dynamic_sampling", "scale_advantages", "recompute_old_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"objective: {name} must be true or false, got {getattr(self, name)!r}")
        if self.overlong_max_tokens is not None:
            overlong_penalty([], self.overlong_max_tokens, self.overlong_cache_tokens)  # validates

    @classmethod
    def grpo(cls, **overrides: Any) -> Objective:
        return cls(**overrides)

    @classmethod
    def dr_grpo(cls, **overrides: Any) -> Objective:
        settings: dict[str, Any] = dict(scale_advantages=False, aggregation="seq-mean-token-sum-norm")
        return cls(**{**settings, **overrides})

    @classmethod
    def dapo(cls, **overrides: Any) -> Objective:
        settings: dict[str, Any] = dict(clip_low=0.2, clip_high=0.28, aggregation="token-mean",
                                        dynamic_sampling=True, overlong_max_tokens=20480,
                                        overlong_cache_tokens=4096)
        return cls(**{**settings, **overrides})

    @classmethod
    def named(cls, name: str, **overrides: Any) -> Objective:
        """One of `OBJECTIVES`, with `overrides`."""
        if name not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {name!r}")
        return getattr(cls, name)(**overrides)

    def prepare(self, trajectories: Sequence[Trajectory]) -> Prepared:
        """Shape the rewards, drop uninformative groups (if dynamic sampling), and normalise
        the rest per group. Whole groups must be present."""
        trajectories = list(trajectories)
        groups = [t.group_id for t in trajectories]
        # Per-trajectory figures, on the CPU (the trainer's batch goes to the device later).
        outcome = torch.tensor([t.reward for t in trajectories], dtype=torch.float64, device="cpu")
        rewards = outcome.clone()
        if self.overlong_max_tokens is not None:  # each response (turn) on its own length
            for i, t in enumerate(trajectories):
                lengths = [len(turn.output_ids) for turn in t.turns]
                # Averaged over the turns: a sum would grow with the episode's length, so that a
                # long success could score below a short failure.
                if lengths:
                    rewards[i] += float(overlong_penalty(lengths, self.overlong_max_tokens,
                                                         self.overlong_cache_tokens).mean())
        # Dynamic sampling judges the outcome: a group that differs only by shaping has no signal.
        keep = (informative_groups(outcome, groups) if self.dynamic_sampling
                else torch.ones(len(trajectories), dtype=torch.bool, device="cpu"))
        kept = [t for t, k in zip(trajectories, keep.tolist(), strict=True) if k]
        episode = group_advantages(rewards[keep], [t.group_id for t in kept], self.advantage_eps,
                                   self.scale_advantages).tolist()
        advantages = [[a] * len(t.turns) for t, a in zip(kept, episode, strict=True)]
        if self.step_advantage_weight > 0:
            returns = [r for t in kept for r in returns_to_go([u.reward for u in t.turns], self.discount)]
            anchors = [(t.group_id, tuple(turn.prompt_ids)) for t in kept for turn in t.turns]
            step = iter(group_advantages(returns, anchors, self.advantage_eps,
                                         self.scale_advantages).tolist())
            w = self.step_advantage_weight
            advantages = [[a + w * next(step) for a in turns] for turns in advantages]
        stats = {
            "trajectories": float(len(trajectories)),
            "reward_sum": sum(t.reward for t in trajectories),
            "successes": float(sum(t.success for t in trajectories)),
            "groups": float(len(set(groups))),
            "groups_kept": float(len({t.group_id for t in kept})),
        }
        return Prepared(kept, advantages, stats)

    def loss(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
             denominator: int | None = None, behaviour_logprobs: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The scalar loss over `[B, T]` tensors (advantages broadcast from `[B, 1]`) and
        un-normalised sums for metrics: `clipped` tokens, `kl` and the importance weights `is`
        (summed over masked tokens). `behaviour_logprobs` (the sampling engine's, when
        `old_logprobs` were recomputed by the trainer) weight each token by the truncated
        importance ratio."""
        per_token, clipped = losses.clipped_surrogate(logprobs, old_logprobs, advantages, self.clip_low,
                                                      self.clip_high, self.clip_ratio_c)
        sums = {"clipped": (clipped & mask).sum().float()}
        if behaviour_logprobs is not None:
            weights = losses.truncated_is_weights(old_logprobs, behaviour_logprobs, self.tis_cap)
            per_token = per_token * weights
            sums["is"] = (weights * mask).sum()
        if self.kl_coef > 0:
            if ref_logprobs is None:
                raise ValueError("objective: kl_coef > 0 needs the reference policy's logprobs")
            kl = losses.k3_kl(logprobs, ref_logprobs)
            per_token = per_token + self.kl_coef * kl
            sums["kl"] = (kl.detach() * mask).sum()
        return losses.aggregate(per_token, mask, self.aggregation, denominator, self.norm_tokens), sums
