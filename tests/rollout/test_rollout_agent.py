"""The agent-loop contract (rose.rollout.agent) through the rollout manager, with scripted
in-process workers: a user's agent builds a conversation over several turns with a tool's
result between them, and trains on exactly the tokens it sampled, the tool's output masked; a
turn cut on a serving device reaches the agent whole; `tool_episode` runs good and malformed
calls and scores the answer; a bad agent fails its trajectory, not the step."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from rose.contracts import Heartbeat, Turn, TurnOutput, WorkerKind
from rose.engine import SamplingParams
from rose.model import load_tokenizer
from rose.rl import Conversation, Episode, StepResult, TextEnv, Trajectory, make_env
from rose.rollout.agent import MAX_TOOL_ROUNDS, TurnHandle, load_agent, tool_episode
from rose.rollout.manager import RolloutManager, RolloutReport
from rose.rollout.registry import WorkerRegistry
from rose.runtime.config import load_config
from rose.tools.sandbox import TOOLS

Script = Callable[[str, list[int]], list[int]]  # (turn id, prompt) -> the reply's tokens


class ScriptedWorker:
    """Replies what `script` says, a token at a time; `abort_after`: a first attempt is handed
    back (an emergency cut) after that many tokens."""

    def __init__(self, worker_id: str, script: Script, kind: WorkerKind = WorkerKind.DEDICATED,
                 abort_after: int | None = None, cap: int = 8) -> None:
        self.worker_id, self.kind, self.script, self.abort_after = worker_id, kind, script, abort_after
        self.max_concurrency, self.policy_version = cap, 0
        self.calls: list[tuple[str, list[int]]] = []

    async def run_turn(self, turn: Turn, result: TurnOutput) -> TurnOutput:
        self.calls.append((turn.turn_id, list(turn.token_ids)))
        reply = self.script(turn.turn_id, list(turn.token_ids))[:turn.params.max_tokens]
        for i, token in enumerate(reply):
            if i == self.abort_after and turn.turn_id.endswith(":0"):
                result.finish_reason = "abort"
                return result
            await asyncio.sleep(0.001)
            last = i == len(reply) - 1
            result.extend(TurnOutput([token], [-0.5], [self.policy_version], "stop" if last else None))
        return result

    async def heartbeat(self) -> Heartbeat:
        return Heartbeat(self.policy_version, free_slots=self.max_concurrency)

    async def abort(self, turn_id: str) -> None:
        pass

    async def close(self) -> None:
        pass


def run(workers: list[ScriptedWorker], tasks: list, agent, max_tokens: int = 64) -> RolloutReport:
    registry = WorkerRegistry(2.0)
    for w in workers:
        registry.add(w)
    manager = RolloutManager(registry, SamplingParams(max_tokens=max_tokens), tick_s=0.02, rebalance=False)
    return asyncio.run(manager.run(tasks, policy_version=0, timeout_s=30.0, agent=agent))


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path):
    return load_tokenizer(tiny_qwen3)


def spelled(tokenizer, text: str) -> list[int]:
    """`text` a character at a time: a tokenization BPE would not give (its merges join them)."""
    return [t for ch in text for t in tokenizer.encode(ch)]


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


def test_an_agents_tokens_stay_exact_across_turns_and_tool_output_is_masked(tokenizer) -> None:
    first, answer = spelled(tokenizer, CALL), spelled(tokenizer, "It is 42.")
    assert tokenizer.encode(tokenizer.decode(answer)) != answer  # re-encoding would change them

    async def calculator_agent(handle: TurnHandle, conversation: Conversation) -> Trajectory:
        await handle.generate(conversation)
        conversation.add({"role": "tool", "content": "42"})
        out = await handle.generate(conversation)
        conversation.trajectory.turns[-1].reward = float("42" in tokenizer.decode(out.token_ids))
        conversation.end(success=True)
        return conversation.trajectory

    def script(turn_id: str, prompt: list[int]) -> list[int]:
        return (first if turn_id.endswith(":0:0") else answer) + [tokenizer.eos_token_id]

    worker = ScriptedWorker("a", script)
    start = Conversation(tokenizer, [{"role": "user", "content": "What is 6 x 7?"}], group_id="g",
                         tools=[TOOLS["calculator"]])
    report = run([worker], [start], calculator_agent, max_tokens=200)
    [trajectory] = report.trajectories
    assert trajectory.success and trajectory.reward == 1.0 and report.failed == report.lost == []
    t0, t1 = trajectory.turns
    eos = tokenizer.eos_token_id
    assert t0.output_ids == [*first, eos] and t1.output_ids == [*answer, eos]
    # The second turn generated from the first's prompt and reply as sampled, then the tool's result.
    [(_, prompt0), (_, prompt1)] = worker.calls
    assert prompt0 == t0.prompt_ids and prompt1 == t0.prompt_ids + t0.output_ids + t1.prompt_ids
    tool_turn = tokenizer.decode(t1.prompt_ids, skip_special_tokens=False)
    assert "<tool_response>\n42\n</tool_response>" in tool_turn
    assert "calculator" in tokenizer.decode(t0.prompt_ids)  # the schema, in the system message
    [sequence] = trajectory.flatten()
    assert sequence.token_ids.tolist() == prompt1 + t1.output_ids
    mask = [False] * len(t0.prompt_ids) + [True] * len(t0.output_ids) + [False] * len(t1.prompt_ids) + \
        [True] * len(t1.output_ids)
    assert sequence.loss_mask.tolist() == mask  # only sampled tokens are trained; the tool's are context


def continuing(reply: list[int]) -> Script:
    """A script that generates `reply`, continuing it where the prompt already ends with a part."""
    def script(_: str, prompt: list[int]) -> list[int]:
        done = max(k for k in range(len(reply) + 1) if k == 0 or prompt[-k:] == reply[:k])
        return reply[done:]
    return script


def test_a_turn_cut_on_a_serving_device_reaches_the_agent_whole(tokenizer) -> None:
    """Two conversations, a dedicated worker with room for one: the other's turn goes to the
    serving device, which hands it back after 2 tokens; it resumes from them and the agent gets
    the whole reply in one `generate`."""
    reply = [*spelled(tokenizer, "Right"), tokenizer.eos_token_id]
    dedicated = ScriptedWorker("d", continuing(reply), cap=1)
    serving = ScriptedWorker("s", continuing(reply), WorkerKind.SERVING, abort_after=2)
    got: list[list[int]] = []

    async def one_turn(handle: TurnHandle, conversation: Conversation) -> Trajectory:
        got.append((await handle.generate(conversation)).token_ids)
        conversation.end()
        return conversation.trajectory

    starts = [Conversation(tokenizer, [{"role": "user", "content": "Move."}], group_id="g") for _ in range(2)]
    report = run([dedicated, serving], starts, one_turn)
    assert got == [reply, reply] and [t.turns[0].output_ids for t in report.trajectories] == [reply, reply]
    assert report.handed_back_turns == 1 and report.lost == report.failed == []
    cut_at = starts[0].trajectory.turns[0].prompt_ids + reply[:2]
    resumed = [prompt for _, prompt in dedicated.calls + serving.calls[1:]]
    assert cut_at in resumed  # it resumed from the tokens handed back


class Arithmetic(TextEnv):
    """One question; the reply that contains the answer scores 1."""

    name = "arithmetic-test"
    system_prompt = "Answer the question. You may use the calculator."

    def reset(self, seed: int | None = None) -> str:
        return "What is 6 * 7?"

    def step(self, text: str) -> StepResult:
        right = "42" in text
        return StepResult("", float(right), True, {"success": right})


def test_tool_episode_runs_each_call_and_scores_the_answer(tokenizer) -> None:
    """Turn 0 calls the calculator, turn 1 sends a malformed call, turn 2 answers: the tool's
    result and the malformed call's error come back as tool messages (context only), the answer
    is scored by the environment."""
    replies = [CALL, "<tool_call>{not json</tool_call>", "It is 42."]

    def script(turn_id: str, _: list[int]) -> list[int]:
        return [*spelled(tokenizer, replies[int(turn_id.split(":")[1])]), tokenizer.eos_token_id]

    episode = Episode(Arithmetic(), tokenizer, seed=0, tools=[TOOLS["calculator"]])
    report = run([ScriptedWorker("a", script)], [episode], tool_episode, max_tokens=200)
    [trajectory] = report.trajectories
    assert trajectory.success and [t.reward for t in trajectory.turns] == [0.0, 0.0, 1.0]
    prompts = [tokenizer.decode(t.prompt_ids, skip_special_tokens=False) for t in trajectory.turns]
    assert "<tool_response>\n42\n</tool_response>" in prompts[1]
    assert "error: the tool call is not valid JSON" in prompts[2]


def test_tool_rounds_are_capped_then_the_reply_is_the_answer(tokenizer) -> None:
    calls = [*spelled(tokenizer, CALL), tokenizer.eos_token_id]
    episode = Episode(Arithmetic(), tokenizer, seed=0, tools=[TOOLS["calculator"]])
    report = run([ScriptedWorker("a", lambda _, __: calls)], [episode], tool_episode, max_tokens=200)
    [trajectory] = report.trajectories
    assert len(trajectory.turns) == MAX_TOOL_ROUNDS + 1 and trajectory.done and not trajectory.success


def test_an_agent_that_returns_no_trajectory_fails_its_own(tokenizer) -> None:
    async def careless(handle: TurnHandle, conversation: Conversation) -> Trajectory:
        await handle.generate(conversation)
        return None  # type: ignore[return-value]

    start = Conversation(tokenizer, [{"role": "user", "content": "Hi"}], group_id="g")
    report = run([ScriptedWorker("a", continuing([tokenizer.eos_token_id]))], [start], careless)
    [failed] = report.failed
    assert (failed.turns, failed.reason) == (1, "the agent returned NoneType, not a Trajectory")


def not_async(handle: TurnHandle, episode: Episode) -> Trajectory:
    return episode.trajectory


@pytest.mark.parametrize(("agent", "error"), [
    ("rose.rollout.agent", "rollout.agent must be 'package.module:function'"),
    ("rose.rollout.agent:nope", "rollout.agent 'rose.rollout.agent:nope' cannot be imported"),
    (f"{__name__}:not_async", "is not an async function"),
])
def test_a_bad_agent_is_refused_naming_the_key(agent: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        load_agent(agent)
    with pytest.raises(ValueError, match=re.escape(error)):
        load_config(None, [f"rollout.agent={agent}"])


def test_the_tools_are_named_from_the_sandbox() -> None:
    with pytest.raises(ValueError, match=r"rollout\.tools: 'shell' is not a tool; the tools are python"):
        load_config(None, ["rollout.tools=[shell]"])
    config = load_config(None, ["rollout.agent=rose.rollout.agent:tool_episode", "rollout.tools=[python]"])
    assert config.rollout.tools == ["python"]


def test_a_reasoning_gym_task_played_with_the_calculator(tokenizer) -> None:
    """reasoning-gym's arithmetic through `tool_episode`: the policy computes the question with
    the calculator (run in the sandbox), then answers in the task's tags; its checker scores it."""
    pytest.importorskip("reasoning_gym")
    env = make_env("reasoning-gym", task="basic_arithmetic",
                   config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    episode = Episode(env, tokenizer, seed=7, tools=[TOOLS["calculator"]])
    expression = re.sub(r"[^0-9+\-*/() .]", "", env.question).strip().rstrip(".")  # "Calculate -61 * 14."
    expected = env._entry["answer"]

    def script(turn_id: str, prompt: list[int]) -> list[int]:
        if turn_id.split(":")[1] == "0":
            arguments = json.dumps({"expression": expression})
            call = f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'
            return [*spelled(tokenizer, call), tokenizer.eos_token_id]
        result = tokenizer.decode(prompt, skip_special_tokens=False).rsplit("<tool_response>\n", 1)[1]
        return [*spelled(tokenizer, f"<answer>{result.split(chr(10))[0]}</answer>"), tokenizer.eos_token_id]

    report = run([ScriptedWorker("a", script)], [episode], tool_episode, max_tokens=300)
    [trajectory] = report.trajectories
    assert trajectory.success and trajectory.reward == 1.0 and len(trajectory.turns) == 2
    assert trajectory.turns[1].info["answer"] == expected
