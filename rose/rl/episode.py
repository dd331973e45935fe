"""Episodes: an environment's conversation kept as tokens, turn by turn.

An `Episode` is one trajectory in progress. Each turn's prompt is the chat template's rendering
of the conversation so far, with the generation prompt, as an inference server renders it;
`record(output)` hands the reply to the environment and appends the turn. The reply's tokens stay
as sampled: the template gets the reply as text, but the policy continues from and trains on the
tokens it drew (re-encoding decoded text could tokenize differently and break the logprobs'
alignment).

When the new rendering extends the previous turn's context (that turn's rendering and the reply,
as text), only the new text is encoded and appended to it: `prompt_ids` grows, so an engine's
prefix cache, or the scheduler's cache affinity, reuses every earlier turn. ChatML does this. A
template that rewrites earlier turns does not (Qwen3's drops the reasoning of the replies before
the last user message): that turn's prompt is the whole new rendering and it starts a new training
sequence (`TurnRecord.new_sequence`), as PRIME-RL's interleaved rollouts start a new sample where the
prefix breaks and ROLL's step-wise environment manager trains each turn as its own: every
sampled token is trained in the context the policy sampled it in.

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


class Episode:
    def __init__(self, env: TextEnv, tokenizer: Tokenizer, seed: int | None = None,
                 group_id: Hashable | None = None, max_context_tokens: int | None = None) -> None:
        """Reset `env` with `seed`. `group_id` (default `(env name, seed)`) groups the samples
        GRPO compares. The episode is cut (truncated) once the next prompt would reach
        `max_context_tokens`."""
        self.env, self.tokenizer = env, tokenizer
        self.max_context_tokens = max_context_tokens
        self.messages = [{"role": "system", "content": env.system_prompt},
                         {"role": "user", "content": env.reset(seed)}]
        self._context: list[int] = []  # the current sequence's tokens before the pending prompt
        self._text = ""  # the current sequence as text: its renderings' new text and the replies
        self.trajectory = Trajectory(group_id if group_id is not None else (env.name, seed),
                                     env=env.name, seed=seed)
        self._render()

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
        output_ids = list(output_ids)
        text = self.tokenizer.decode(output_ids)
        result = self.env.step(text)
        self.trajectory.turns.append(TurnRecord(self._pending, output_ids, list(logprobs), list(versions),
                                                result.reward, text, result.observation, result.info,
                                                new_sequence=self._new_sequence))
        self._context += self._pending + output_ids
        # The reply as the policy wrote it, special tokens too (Qwen3's template looks for
        # </think>); the end-of-message token is the template's to add.
        reply = self.tokenizer.decode(output_ids, skip_special_tokens=False)
        self._text += reply
        if result.done:
            self.trajectory.done = True
            self.trajectory.success = bool(result.info.get("success", False))
            self.trajectory.truncated = bool(result.info.get("truncated", False))
            self._pending = []
        else:
            self.messages += [{"role": "assistant", "content": reply.removesuffix(self.tokenizer.eos_token)},
                              {"role": "user", "content": result.observation}]
            self._render()
        return result

    def _render(self) -> None:
        """The next prompt: the conversation's rendering past the current sequence's text, or,
        where the rendering does not extend it, all of it, starting a new sequence."""
        rendered = self.tokenizer.apply_chat_template(self.messages)
        self._new_sequence = not rendered.startswith(self._text)
        if self._new_sequence:
            self._context, self._text = [], ""
        self._pending = self.tokenizer.encode(rendered[len(self._text):])
        self._text = rendered
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
