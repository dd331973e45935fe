"""The agent-loop contract: a rollout is an agent, an async function of a `TurnHandle` and a task
that plays the task and returns its trajectory with its rewards.

`await handle.generate(prompt)` runs one turn across the workers (rose.rollout.manager): routed
by cache affinity to a dedicated worker or a serving device with room, resumed with the tokens it
already produced after an emergency cut or a lost worker, tried again when refused; it returns
the turn's tokens, with each token's logprob and policy version. Given a `Conversation` (the
messages so far, kept as tokens: rose.rl.conversation), the reply is kept in it as sampled, so
that token ids stay exact across turns; given token ids, the turn generates from them as they
are. What the agent adds after a reply (an environment's observation, a tool's result) is
context, never trained on.

`play_episode`, today's text-game episodes, is one such agent; `tool_episode` lets the policy
call tools (`rose.tools`: a sandboxed Python interpreter, a calculator) before it answers; a
user's own is named by `rollout.agent` as `package.module:function`, over the episodes the
config's environment makes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from rose.config import import_function
from rose.contracts import TurnOutput
from rose.rl import Conversation, Episode, Trajectory
from rose.tools.parsing import parse_tool_calls
from rose.tools.sandbox import run_tool

Task = TypeVar("Task")
# (turn index, prompt ids, max tokens) -> the finished turn
TurnRunner = Callable[[int, list[int], int], Awaitable[TurnOutput]]
# Rounds of tool calls answered before one answer; the reply after them goes to the environment as it is.
MAX_TOOL_ROUNDS = 3


class TurnHandle:
    """What an agent is given: `generate` runs one turn of its trajectory on the workers."""

    def __init__(self, run_turn: TurnRunner, max_tokens: int) -> None:
        self._run_turn, self.max_tokens = run_turn, max_tokens
        self.turns = 0  # turns generated so far

    async def generate(self, prompt: Conversation | Sequence[int],
                       max_tokens: int | None = None) -> TurnOutput:
        """One turn from `prompt` (a conversation's next prompt, or token ids), at most
        `max_tokens` (default: the run's `rollout.max_tokens`); a conversation keeps the reply."""
        ids = prompt.prompt_ids if isinstance(prompt, Conversation) else list(prompt)
        out = await self._run_turn(self.turns, ids, self.max_tokens if max_tokens is None else max_tokens)
        self.turns += 1
        if isinstance(prompt, Conversation):
            prompt.reply(out.token_ids, out.logprobs, out.versions)
        return out


Agent = Callable[[TurnHandle, Task], Awaitable[Trajectory]]


async def play_episode(handle: TurnHandle, episode: Episode) -> Trajectory:
    """A text game: each reply is the policy's move, the environment's answer the next prompt."""
    while not episode.done:
        out = await handle.generate(episode.prompt_ids)
        episode.record(out.token_ids, out.logprobs, out.versions)
    return episode.trajectory


async def tool_episode(handle: TurnHandle, episode: Episode) -> Trajectory:
    """An episode whose policy may call the episode's tools before it answers: a reply with tool
    calls (Hermes `<tool_call>` blocks) gets each call's result, or what is wrong with a malformed
    one, as `tool` messages and is generated again, up to `MAX_TOOL_ROUNDS` times per answer; a
    reply without calls is the answer the environment scores. A tool that fails or times out is
    an error observation, never the trajectory's failure."""
    conversation = episode.conversation
    names = {t["function"]["name"] for t in conversation.tools or []}
    rounds = 0
    while not episode.done:
        out = await handle.generate(episode.prompt_ids)
        # Special tokens kept: some tokenizers (ROSE's own) make <tool_call> one.
        parsed = parse_tool_calls(episode.tokenizer.decode(out.token_ids, skip_special_tokens=False), names)
        if rounds == MAX_TOOL_ROUNDS or not (parsed.calls or parsed.errors):
            episode.record(out.token_ids, out.logprobs, out.versions)
            rounds = 0
            continue
        conversation.reply(out.token_ids, out.logprobs, out.versions)
        results = [await asyncio.to_thread(run_tool, call.name, call.arguments) for call in parsed.calls]
        conversation.add(*({"role": "tool", "content": text}
                           for text in [*results, *(f"error: {e}" for e in parsed.errors)]))
        rounds += 1
    return episode.trajectory


def load_agent(path: str) -> Agent[Any]:
    """`rollout.agent`: an async function, imported; a ValueError naming what is wrong otherwise."""
    function = import_function(path, "rollout.agent")
    if not asyncio.iscoroutinefunction(function):
        raise ValueError(f"config: rollout.agent {path!r} is not an async function")
    return function
