"""RL workloads: environments' turn structure, per-step demand variation, DAPO resampling.

An environment profile says how long prompts, observations and responses are and how many
turns an episode lasts. These are workload *assumptions* (stated with their reasoning), not
measurements of the paper's runs, which it does not publish at this granularity.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class EnvProfile:
    name: str
    prompt_tokens: int       # system prompt + task + first observation
    obs_tokens: int          # observation (and its template) appended before each later turn
    response_median: float   # generated tokens a turn (lognormal median)
    response_sigma: float    # lognormal shape: the long tail of reasoning lengths
    max_response: int        # per-turn max_tokens, the cap that bounds the tail
    end_prob: float          # chance the episode ends after a turn (goal, hole, task done)
    max_turns: int
    env_step_s: float        # one environment step, wall time
    note: str


ENVS: dict[str, EnvProfile] = {
    # FrozenLake-like (RAGEN / ROLL agentic examples): a rules prompt with the rendered grid, a
    # short grid observation per turn, a thinking model reasoning a few hundred tokens before
    # each move, episodes of a handful of moves capped at 10; the env step is microseconds of
    # Python plus the agent framework's bookkeeping.
    "frozenlake": EnvProfile("frozenlake", prompt_tokens=400, obs_tokens=80, response_median=350,
                             response_sigma=0.7, max_response=2048, end_prob=0.2, max_turns=10,
                             env_step_s=0.01,
                             note="short turns: small grid observations, up to 10 moves"),
    # ALFWorld-like (ReAct agents on TextWorld): a long task prompt with few-shot examples and
    # admissible commands, ~100-token observations, a thought + action per turn, episodes of
    # up to 30 steps (ALFWorld allows 50; agents finish or fail well before), a TextWorld step
    # of a few hundred milliseconds.
    "alfworld": EnvProfile("alfworld", prompt_tokens=1500, obs_tokens=120, response_median=200,
                           response_sigma=0.6, max_response=1024, end_prob=0.07, max_turns=30,
                           env_step_s=0.3,
                           note="long turns: growing context to ~10k tokens, up to 30 steps"),
    # `rose bench train`'s rollout, measured (`python -m rose.bench.calibrate`): the tiny random
    # policy on FrozenLake 4x4 with the embedded default's options rarely names a valid move, so
    # nearly every episode runs its 8 turns (5% end earlier: end_prob 0.0073 gives that with the
    # cap); replies take their 24-token cap (median 24, a few stop early); the chat-templated
    # first prompt is 111 tokens, each later observation 44. The step: recording a reply
    # (0.09 ms) plus dispatching the next turn to a worker (a Ray call, ~1 ms).
    "frozenlake-tiny": EnvProfile("frozenlake-tiny", prompt_tokens=111, obs_tokens=44, response_median=24,
                                  response_sigma=0.05, max_response=24, end_prob=0.0073, max_turns=8,
                                  env_step_s=0.0011,
                                  note="rose bench train's rollout: 8 turns of 24 tokens, measured"),
    # `rose bench coserve`'s rollout backlog (rose.bench.coserve and .burst): a 128-token first
    # prompt, turns of exactly 64 tokens (ignore_eos), a 32-token observation after each, the next
    # turn sent at once; a trajectory starts afresh once its context passes 1,500 tokens (after
    # 14 turns).
    "coserve-backlog": EnvProfile("coserve-backlog", prompt_tokens=128, obs_tokens=32, response_median=64,
                                  response_sigma=0.0, max_response=64, end_prob=1e-9, max_turns=14,
                                  env_step_s=0.0, note="rose bench coserve's backlog: 64-token turns"),
}

# Demand varies up to 5.7x between training steps (ROSE paper, Figure 1d: the trajectories DAPO
# generates per step). A lognormal multiplier with sigma s has an expected max/min over 20 steps of
# exp(3.73 s) (3.73: the expected range of 20 standard normals, so the largest lies 3.73 / 2
# above their mean); s = ln(5.7) / 3.73 makes that 5.7x.
MAX_OF_20 = 3.73 / 2
DEMAND_SIGMA = math.log(5.7) / (2 * MAX_OF_20)


@dataclasses.dataclass(frozen=True)
class RoundDemand:
    """One rollout round: every trajectory's turns, as a [trajectories, max_turns] array of
    response lengths (0 past its last turn)."""

    env: EnvProfile
    response: np.ndarray
    turns: np.ndarray
    groups: int

    @property
    def trajectories(self) -> int:
        return len(self.turns)

    @property
    def generated_tokens(self) -> int:
        return int(self.response.sum())

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over every turn, each turn's whole context counted (the first prompt, the
        responses and observations before it): what an engine counts as prompt tokens, cached or
        not."""
        # Turn t's context: the prompt, t observations and the responses before it; a response is
        # in the context of each later turn of its trajectory (the sums are integers: exact).
        n, later = self.turns, self.turns[:, None] - 1 - np.arange(self.response.shape[1])
        fixed = n * self.env.prompt_tokens + n * (n - 1) // 2 * self.env.obs_tokens
        return int(fixed.sum() + (self.response * later).sum())

    def context_tokens(self) -> np.ndarray:
        """Each trajectory's final context (what the trainer runs over)."""
        return self.env.prompt_tokens + self.response.sum(axis=1) + (self.turns - 1) * self.env.obs_tokens


def step_multipliers(steps: int, sigma: float, seed: int) -> np.ndarray:
    """Per-step demand multipliers, lognormal, median 1: the response length scale under GRPO,
    DAPO's resampling (`dapo_resampling`) under DAPO."""
    return np.exp(sigma * np.random.default_rng(seed).standard_normal(steps))


def sample_round(env: EnvProfile, groups: int, group_size: int, multiplier: float,
                 rng: np.random.Generator) -> RoundDemand:
    n = groups * group_size
    turns = np.minimum(rng.geometric(env.end_prob, size=n), env.max_turns)
    resp = rng.lognormal(math.log(env.response_median * multiplier), env.response_sigma,
                         size=(n, env.max_turns))
    # In place: a round's arrays are millions of entries (each new one costs its pages).
    np.clip(np.rint(resp, out=resp), 1, env.max_response, out=resp)
    resp = resp.astype(np.int64)
    resp *= np.arange(env.max_turns)[None, :] < turns[:, None]
    return RoundDemand(env, resp, turns, groups)


def dapo_resampling(multipliers: np.ndarray, sigma: float) -> np.ndarray:
    """Trajectories DAPO generates per step, over the batch it trains on: the step's demand
    multiplier (the paper's 5.7x is DAPO's trajectory count, so under DAPO it scales how many
    groups are sampled, not their lengths), scaled so that the run's expected lightest step of 20
    generates just the batch, the least resampling consistent with that spread; never below 1.
    How often groups all agree (hence how much DAPO resamples) is not in the sources at hand."""
    return np.maximum(1.0, multipliers * math.exp(sigma * MAX_OF_20))


def groups_sampled(groups: int, valid_fraction: float, rng: np.random.Generator) -> int:
    """Groups DAPO samples to fill a batch of `groups` valid ones (whose rewards disagree), each
    valid with probability `valid_fraction`: the batch plus the failures before that many
    successes. ROLL, which the paper builds on, streams them: its generate scheduler
    (`roll/distributed/scheduler/generate_scheduler.py`) starts another prompt whenever one is
    filtered out, until the batch is full (verl's recipe instead generates synchronous batches
    of 3x the prompts)."""
    return groups + int(rng.negative_binomial(groups, valid_fraction))
