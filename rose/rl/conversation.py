"""A conversation kept as tokens: what an agent's turns build, exactly as the policy saw them.

Each turn's prompt is the chat template's rendering of the conversation so far, with the
generation prompt, as an inference server renders it (with `tools`, in the template's own tool
format, or Qwen's Hermes format where the template has none). A reply is kept as the tokens the
policy sampled: the template gets it as text, but the policy continues from and trains on the
tokens it drew (re-encoding decoded text could tokenize differently and break the logprobs'
alignment). What comes after a reply (an environment's observation, a tool's result) is
rendered and encoded into the next turn's prompt: context, never trained on (mask 0).

When the new rendering extends the previous turn's context (that turn's rendering and the reply,
as text), only the new text is encoded and appended to it: `prompt_ids` grows, so an engine's
prefix cache, or the scheduler's cache affinity, reuses every earlier turn. ChatML does this. A
template that rewrites earlier turns does not (Qwen3's drops the reasoning of the replies before
the last user message): that turn's prompt is the whole new rendering and it starts a new
training sequence (`TurnRecord.new_sequence`), as PRIME-RL's interleaved rollouts start a new
sample where the prefix breaks and ROLL's step-wise environment manager trains each turn as its
own: every sampled token is trained in the context the policy sampled it in.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from rose.model import Tokenizer
from rose.rl.trajectory import Trajectory, TurnRecord


class Conversation:
    def __init__(self, tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], group_id: Hashable,
                 max_context_tokens: int | None = None, tools: list[dict[str, Any]] | None = None,
                 env: str = "", seed: int | None = None) -> None:
        """`messages` (OpenAI-shaped: role and content) open the conversation; `group_id` groups
        the samples GRPO compares; `tools` (OpenAI function schemas) are rendered into every
        prompt. The conversation is cut (truncated) once the next prompt would reach
        `max_context_tokens`."""
        self.tokenizer, self.max_context_tokens, self.tools = tokenizer, max_context_tokens, tools
        self.messages = list(messages)
        self.trajectory = Trajectory(group_id, env=env, seed=seed)
        self._context: list[int] = []  # the current sequence's tokens before the pending prompt
        self._text = ""  # the current sequence as text: its renderings' new text and the replies
        self._pending: list[int] = []
        self._new_sequence = False
        self._render()

    @property
    def done(self) -> bool:
        return self.trajectory.done or self.trajectory.truncated

    @property
    def prompt_ids(self) -> list[int]:
        """The tokens the next turn generates from."""
        return self._context + self._pending

    def reply(self, output_ids: Sequence[int], logprobs: Sequence[float],
              versions: Sequence[int]) -> TurnRecord:
        """Keep a generated reply (with each token's logprob and policy version) as sampled: a new
        turn of the trajectory, its `text` the reply without special tokens; its reward, and what
        answers it (`add`), are the caller's."""
        if self.done:
            raise RuntimeError("conversation: reply() after it ended")
        output_ids = list(output_ids)
        turn = TurnRecord(self._pending, output_ids, list(logprobs), list(versions),
                          text=self.tokenizer.decode(output_ids), new_sequence=self._new_sequence)
        self.trajectory.turns.append(turn)
        self._context += self._pending + output_ids
        self._pending = []
        # The reply as the policy wrote it, special tokens too (Qwen3's template looks for
        # </think>); the end-of-message token is the template's to add.
        reply = self.tokenizer.decode(output_ids, skip_special_tokens=False)
        self._text += reply
        self.messages.append({"role": "assistant", "content": reply.removesuffix(self.tokenizer.eos_token)})
        return turn

    def add(self, *messages: dict[str, Any]) -> None:
        """What answers the last reply (an observation as a user message, a tool's result as a
        `tool` message): rendered into the next prompt, context only."""
        if self.done:
            raise RuntimeError("conversation: add() after it ended")
        self.messages += messages
        self._render()

    def end(self, success: bool = False, truncated: bool = False) -> None:
        """The episode is over (no more turns)."""
        t = self.trajectory
        t.done, t.success, t.truncated = True, success, truncated

    def _render(self) -> None:
        """The next prompt: the conversation's rendering past the current sequence's text, or,
        where the rendering does not extend it, all of it, starting a new sequence."""
        rendered = self.tokenizer.apply_chat_template(self.messages, tools=self.tools)
        self._new_sequence = not rendered.startswith(self._text)
        if self._new_sequence:
            self._context, self._text = [], ""
        self._pending = self.tokenizer.encode(rendered[len(self._text):])
        self._text = rendered
        if self.max_context_tokens is not None and len(self.prompt_ids) >= self.max_context_tokens:
            self.trajectory.truncated = True
