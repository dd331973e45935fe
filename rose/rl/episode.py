"""Episodes: an environment played as a conversation kept as tokens (`Conversation`), turn by turn.

An `Episode` is one trajectory in progress: the environment's system prompt and first observation
open the conversation; `record(output)` keeps the reply as sampled, hands its text to the
environment, and adds the environment's answer as the next user message (context, never trained
on). rose.rl.conversation says how the tokens stay exact across turns.

`run_episodes` is the plain synchronous rollout on one engine; the elastic rollout manager
drives the same `Episode` objects (`rose.rollout.agent.play_episode`), routing each turn to a
worker.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable, Sequence
from typing import Any

from rose.engine import LLMEngine, SamplingParams
from rose.model import Tokenizer
from rose.rl.conversation import Conversation
from rose.rl.envs.base import StepResult, TextEnv
from rose.rl.trajectory import Trajectory


class Episode:
    def __init__(self, env: TextEnv, tokenizer: Tokenizer, seed: int | None = None,
                 group_id: Hashable | None = None, max_context_tokens: int | None = None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        """Reset `env` with `seed`. `group_id` (default `(env name, seed)`) groups the samples
        GRPO compares. The episode is cut (truncated) once the next prompt would reach
        `max_context_tokens`. `tools` (OpenAI function schemas) are offered in every prompt:
        an agent (`rose.rollout.agent.tool_episode`) runs the calls."""
        self.env, self.tokenizer = env, tokenizer
        messages = [{"role": "system", "content": env.system_prompt},
                    {"role": "user", "content": env.reset(seed)}]
        group = group_id if group_id is not None else (env.name, seed)
        self.conversation = Conversation(tokenizer, messages, group, max_context_tokens, tools, env=env.name,
                                         seed=seed)

    @property
    def trajectory(self) -> Trajectory:
        return self.conversation.trajectory

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.conversation.messages

    @property
    def done(self) -> bool:
        return self.conversation.done

    @property
    def prompt_ids(self) -> list[int]:
        """The tokens the next turn generates from."""
        return self.conversation.prompt_ids

    def record(self, output_ids: Sequence[int], logprobs: Sequence[float],
               versions: Sequence[int]) -> StepResult:
        """Play one generated reply (with each token's logprob and policy version)."""
        if self.done:
            raise RuntimeError("episode: record() after the episode ended")
        turn = self.conversation.reply(output_ids, logprobs, versions)
        result = self.env.step(turn.text)
        turn.reward, turn.observation, turn.info = result.reward, result.observation, result.info
        if result.done:
            info = result.info
            self.conversation.end(bool(info.get("success", False)), bool(info.get("truncated", False)))
        else:
            self.conversation.add({"role": "user", "content": result.observation})
        return result


def run_episodes(engine: LLMEngine, episodes: Sequence[Episode], params: SamplingParams) -> list[Trajectory]:
    """Play every episode to its end on `engine`, one turn of each unfinished episode per
    round. With `params.seed` set, each request gets its own seed drawn from it, so that the
    samples of one group still differ."""
    seeds = random.Random(params.seed)
    while active := [e for e in episodes if not e.done]:
        per_request = [params if params.seed is None
                       else dataclasses.replace(params, seed=seeds.getrandbits(62)) for _ in active]
        outputs = engine.generate([e.prompt_ids for e in active], per_request)
        for episode, out in zip(active, outputs, strict=True):
            episode.record(out.token_ids, out.logprobs, out.versions)
    return [e.trajectory for e in episodes]
