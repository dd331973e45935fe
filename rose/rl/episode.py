"""Episodes: an environment's conversation kept as tokens, turn by turn.

An `Episode` is one trajectory in progress. `prompt_ids` is what the policy generates from next
(the whole conversation so far, so that an engine's prefix cache, or the scheduler's cache
affinity, reuses every earlier turn); `record(output)` hands the reply to the environment and
appends the turn. Only new tokens are ever appended: the reply's own tokens stay as generated
(re-encoding decoded text could tokenize differently and break the logprobs' alignment), and the
next observation is encoded on its own, wrapped the way the tokenizer's chat template closes an
assistant message and opens the next user turn.

`run_episodes` is the plain synchronous rollout on one engine; the elastic rollout manager
drives the same `Episode` objects, routing each turn to a worker.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable, Sequence

from rose.engine import LLMEngine, SamplingParams
from rose.model import Tokenizer
from rose.rl.envs.base import StepResult, TextEnv
from rose.rl.trajectory import Trajectory, TurnRecord

_MARK = "\x00ROSE-MARK\x00"  # a placeholder no chat template would produce on its own


def _observation_wrapper(tokenizer: Tokenizer) -> tuple[str, str]:
    """The text before and after a user message that follows an assistant reply, ending with
    the next assistant header, as the chat template renders it."""
    head = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
    closed = tokenizer.apply_chat_template(head, add_generation_prompt=False)
    opened = tokenizer.apply_chat_template([*head, {"role": "user", "content": _MARK}],
                                           add_generation_prompt=True)
    start = closed.index(_MARK) + len(_MARK)
    if opened[:start] != closed[:start] or opened.count(_MARK) != 2:
        raise ValueError("the tokenizer's chat template does not render a conversation as a prefix of its "
                         "continuation; multi-turn episodes need one that does (ChatML does)")
    before, after = opened[start:].split(_MARK)
    return before, after


class Episode:
    def __init__(self, env: TextEnv, tokenizer: Tokenizer, seed: int | None = None,
                 group_id: Hashable | None = None, max_context_tokens: int | None = None) -> None:
        """Reset `env` with `seed`. `group_id` (default `(env name, seed)`) groups the samples
        GRPO compares. The episode is cut (truncated) once the next prompt would reach
        `max_context_tokens`."""
        self.env, self.tokenizer = env, tokenizer
        self.max_context_tokens = max_context_tokens
        self._before, self._after = _observation_wrapper(tokenizer)
        first = [{"role": "system", "content": env.system_prompt},
                 {"role": "user", "content": env.reset(seed)}]
        self._pending = tokenizer.encode(tokenizer.apply_chat_template(first))
        self._context: list[int] = []
        self.trajectory = Trajectory(group_id if group_id is not None else (env.name, seed),
                                     env=env.name, seed=seed)
        self._check_context()

    @property
    def done(self) -> bool:
        return self.trajectory.done or self.trajectory.truncated

    @property
    def prompt_ids(self) -> list[int]:
        """The tokens the next turn generates from."""
        return self._context + self._pending

    def record(self, output_ids: Sequence[int], logprobs: Sequence[float],
               versions: Sequence[int]) -> StepResult:
        """Play one generated reply (with each token's logprob and policy version)."""
        if self.done:
            raise RuntimeError("episode: record() after the episode ended")
        text = self.tokenizer.decode(list(output_ids))
        result = self.env.step(text)
        self.trajectory.turns.append(TurnRecord(self._pending, list(output_ids), list(logprobs),
                                                list(versions), result.reward, text, result.observation,
                                                result.info))
        self._context += self._pending + list(output_ids)
        if result.done:
            self.trajectory.done = True
            self.trajectory.success = bool(result.info.get("success", False))
            self.trajectory.truncated = bool(result.info.get("truncated", False))
            self._pending = []
        else:
            closed = bool(output_ids) and output_ids[-1] == self.tokenizer.eos_token_id
            before = self._before.removeprefix(self.tokenizer.eos_token) if closed else self._before
            self._pending = self.tokenizer.encode(before + result.observation + self._after)
            self._check_context()
        return result

    def _check_context(self) -> None:
        if self.max_context_tokens is not None and len(self.prompt_ids) >= self.max_context_tokens:
            self.trajectory.truncated = True


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
