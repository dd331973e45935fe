"""The rollout of one RL step as one pluggable function (`rollout.function` in the config).

A rollout function takes a `RolloutContext` and returns the step's `RolloutReport`; the runtime
calls it between two weight versions, with the workers alive and the serving devices' budgets
renewed, and trains on the trajectories it returns. The default, `multi_turn_rollout`, plays
the config's environment episodes turn by turn across the workers (`RolloutManager`). A user's
own rollout is one function named as `package.module:function`, as slime's
`--rollout-function-path` is. With `rollout.shards` > 1 the function runs on every shard of the
control plane (rose.runtime.shards), each playing its share of the step: the groups `ctx.mine`
names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from rose.config import import_function
from rose.engine import SamplingParams
from rose.model.tokenizer import Tokenizer
from rose.rl import Episode, Trajectory, informative_groups, make_env
from rose.rollout.agent import load_agent
from rose.rollout.manager import RolloutManager, RolloutReport
from rose.rollout.registry import WorkerRegistry
from rose.rollout.stream import RolloutStream
from rose.runtime.config import Config, extra_groups, policy_adapter, sampling_rounds
from rose.tools.sandbox import TOOLS


@dataclasses.dataclass(frozen=True)
class RolloutContext:
    """What a rollout function may use: the run's config, the step, the policy version every
    turn needs, the tokenizer, and the workers (alive, on that version) to route turns to."""

    config: Config
    step: int
    version: int
    tokenizer: Tokenizer
    registry: WorkerRegistry
    shard: int = 0  # which of the control plane's `shards` runs this rollout
    shards: int = 1

    def mine(self, n: int) -> range:
        """Which of `n` groups (or held-out episodes) this shard plays: every `shards`-th."""
        return range(self.shard, n, self.shards)

    def prefix(self, kind: str) -> str:
        """A trajectory id's start, unique across the shards (`kind`: what the rollout is, and when)."""
        return kind if self.shards == 1 else f"{kind}k{self.shard}."


RolloutFunction = Callable[[RolloutContext], Awaitable[RolloutReport]]


def load_rollout_function(path: str) -> RolloutFunction:
    """`rollout.function`, imported; a ValueError naming what is wrong otherwise."""
    return import_function(path, "rollout.function")


ROUND_SEED_STRIDE = 2**40  # a later sampling round's seeds lie far from any step's first round
EVAL_SEED = 2**50  # the held-out episodes' seeds: far from every training seed (the layouts differ anyway)


def env_kwargs(config: Config, split: str) -> dict[str, Any]:
    """`env.options`, drawing layouts from `split` ("train" or "eval") when evaluation is on."""
    return {**config.env.options, "split": split} if config.eval.every else dict(config.env.options)


def _manager(ctx: RolloutContext, temperature: float, seed: int) -> RolloutManager:
    """A manager of the run's turns: its sampling at `temperature`, on the policy's adapter if any."""
    params = SamplingParams(max_tokens=ctx.config.rollout.max_tokens, temperature=temperature,
                            stop_token_ids=tuple(ctx.tokenizer.stop_token_ids), logprobs_at_temperature=True)
    return RolloutManager(ctx.registry, params, seed=seed, adapter=policy_adapter(ctx.config))


def episodes(ctx: RolloutContext, sampling_round: int = 0) -> list[Episode]:
    """The step's episodes: `rollout.groups` environment seeds, `rollout.group_size` each (a
    later sampling round draws new seeds); on a shard, its groups of them."""
    first = ctx.step * ctx.config.rollout.groups + sampling_round * ROUND_SEED_STRIDE
    return [e for g in ctx.mine(ctx.config.rollout.groups)
            for e in group(ctx, first + g, (ctx.step, sampling_round, g))]


def group(ctx: RolloutContext, k: int, group_id: Hashable) -> list[Episode]:
    """One group: `rollout.group_size` episodes of the k-th environment seed of the run."""
    c, seed = ctx.config, ctx.config.train.seed * 100003 + k
    return [Episode(make_env(c.env.name, **env_kwargs(c, "train")), ctx.tokenizer, seed=seed,
                    group_id=group_id, max_context_tokens=c.rollout.max_context_tokens, tools=_tools(c))
            for _ in range(c.rollout.group_size)]


def _tools(config: Config) -> list[dict[str, Any]] | None:
    return [TOOLS[name] for name in config.rollout.tools] or None


def informative(trajectories: list[Trajectory]) -> list[Hashable]:
    """The groups whose outcome returns differ (the others give no gradient), in order."""
    groups = [t.group_id for t in trajectories]
    keep = informative_groups([t.reward for t in trajectories], groups).tolist() if groups else []
    return list(dict.fromkeys(g for g, k in zip(groups, keep, strict=True) if k))


async def multi_turn_rollout(ctx: RolloutContext) -> RolloutReport:
    """Every episode played to its end, each turn routed on its own (the default). With
    `rollout.max_sampling_rounds` > 1 (DAPO's dynamic sampling, section 3.2) more groups are
    sampled while fewer than `rollout.groups` groups have outcomes that differ; a later round's
    informative groups join the batch up to that count (by default with `train.objective` dapo:
    `sampling_rounds`)."""
    r, seed = ctx.config.rollout, ctx.config.train.seed * 7919 + ctx.step
    manager, agent = _manager(ctx, r.temperature, seed), load_agent(r.agent)
    report = await manager.run(episodes(ctx), ctx.version, prefix=ctx.prefix(f"s{ctx.step}-"),
                               timeout_s=r.timeout_s, agent=agent)
    for sampling_round in range(1, sampling_rounds(ctx.config)):
        missing = len(ctx.mine(r.groups)) - len(informative(report.trajectories))
        if missing <= 0:
            break
        more = await manager.run(episodes(ctx, sampling_round), ctx.version,
                                 prefix=ctx.prefix(f"s{ctx.step}r{sampling_round}-"), timeout_s=r.timeout_s,
                                 agent=agent)
        wanted = set(informative(more.trajectories)[:missing])
        report = report.extend(more, keep=lambda t, wanted=wanted: t.group_id in wanted)
    return report


def stream_rollouts(ctx: RolloutContext, version: Callable[[], int], first_step: int | None = None,
                    skip: int = 0) -> RolloutStream:
    """Asynchronous RL's rollouts from step `ctx.step` on: the run's groups, the k-th from its
    k-th seed (the seeds a synchronous run's steps draw, in the same order), played without
    pause across steps (`RolloutStream`); with dynamic sampling (DAPO) only groups whose
    outcomes differ fill a step, up to `sampling_rounds` steps' worth of groups played for it.
    `version()` is the trainer's. On a shard: every `shards`-th of those groups, its share of
    each step's batch, from its `skip`-th group on of a stream first started at `first_step`
    (a shard started again plays again the groups its predecessor had in play)."""
    c, r = ctx.config, ctx.config.rollout
    manager = _manager(ctx, r.temperature, c.train.seed * 7919 + ctx.step)
    keep = (lambda trajectories: bool(informative(trajectories))) if c.train.objective == "dapo" \
        else (lambda trajectories: True)
    # A resumed run goes on with the seeds after its steps'.
    first = (ctx.step if first_step is None else first_step) * r.groups

    def new_group(j: int) -> list[Episode]:
        k = first + (skip + j) * ctx.shards + ctx.shard
        return group(ctx, k, ("a", k))

    batch, extra = len(ctx.mine(r.groups)), len(ctx.mine(extra_groups(c)))
    prefix = ctx.prefix("a") + (f"{skip}+" if skip else "")  # a successor's ids differ from its predecessor's
    return RolloutStream(manager, load_agent(r.agent), new_group, version, batch, extra,
                         c.train.max_staleness, keep, (sampling_rounds(c) - 1) * batch, prefix=prefix,
                         steps=c.train.steps - ctx.step)


async def heldout_rollout(ctx: RolloutContext) -> RolloutReport:
    """`eval.episodes` episodes on held-out layouts, one per seed from `EVAL_SEED` (the same
    layouts at every evaluation), sampled at `eval.temperature` (None: the rollouts'); never
    trained on. On a shard, its share of them."""
    c = ctx.config
    held_out = [Episode(make_env(c.env.name, **env_kwargs(c, "eval")), ctx.tokenizer, seed=EVAL_SEED + i,
                        group_id=("eval", i), max_context_tokens=c.rollout.max_context_tokens,
                        tools=_tools(c)) for i in ctx.mine(c.eval.episodes)]
    if not held_out:  # a shard past the episodes' count
        return RolloutReport([], [], 0.0)
    temperature = c.rollout.temperature if c.eval.temperature is None else c.eval.temperature
    manager = _manager(ctx, temperature, c.train.seed)
    return await manager.run(held_out, ctx.version, prefix=ctx.prefix(f"e{ctx.step}-"),
                             timeout_s=c.rollout.timeout_s, agent=load_agent(c.rollout.agent))
