"""reasoning-gym's verifiable tasks as environments (`make_env("reasoning-gym", task=...)`).

reasoning-gym (open-thought/reasoning-gym, Apache-2.0) generates problems procedurally from a
seed, with an answer checker per task (`dataset.score_answer`): nothing is downloaded, every
seed is a new problem. Each reset draws one problem of `task` (any of reasoning-gym's, with its
`config` options); the policy answers inside `<answer>...</answer>` (reasoning-gym's own
convention, `reasoning_gym.utils.extract_answer`), and the checker's score (0 to 1) is the
reward. A reply without the tags is read whole (`fallback="reply"`, reasoning-gym's own), or by
its last number (`fallback="last-number"`, lm-evaluation-harness's "flexible-extract" for GSM8K:
SmolLM2-135M-Instruct's "The function `2 * 3` is defined as 2 times 3, which equals 6." is
scored on the 6). A wrong answer gets "Not quite. Try again." while turns are left (`max_turns`,
default 1), so with tools (`rose.rollout.agent.tool_episode`) the policy can compute before it
answers.

Held-out problems: with `split`, a problem belongs to the evaluation split when a checksum of
its question text says so (rose.rl.envs.heldout), as generated maps do; with
`heldout="answer"`, a checksum of its answer: no held-out problem then shares its answer with a
trained one ("8 * 6" is not trained on when "6 * 8" is held out, as it may be by question).
"""

from __future__ import annotations

import random
import re
from typing import Any

from rose.rl.envs.base import StepResult, TextEnv, check_positive_int
from rose.rl.envs.heldout import check_split, draw

ANSWER_FORMAT = "Give your final answer inside <answer></answer>, for example <answer>42</answer>."
FALLBACKS = ("reply", "last-number")  # what a reply without the tags is scored on
HELDOUT_KEYS = ("question", "answer")  # what the held-out split's checksum is taken of
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # 14, -3, 1,000, 2.5


def untagged_answer(text: str, fallback: str) -> str:
    """The answer in a reply without <answer> tags: the reply (stripped) or its last number
    ("" when it has none; a thousands separator kept, as the checkers strip it)."""
    if fallback == "reply":
        return text.strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else ""


class ReasoningGymTask(TextEnv):
    name = "reasoning-gym"

    def __init__(self, task: str = "basic_arithmetic", max_turns: int = 1, split: str | None = None,
                 config: dict[str, Any] | None = None, fallback: str = "reply",
                 heldout: str = "question") -> None:
        """`task`: a reasoning-gym dataset name; `config`: its options (e.g. for
        basic_arithmetic `{"min_terms": 2, "max_terms": 2, "max_digits": 2}`); `fallback`: what
        a reply without the tags is scored on (FALLBACKS: the whole reply or its last number);
        `heldout`: what `split` holds out by (HELDOUT_KEYS: the question or the answer)."""
        try:
            import reasoning_gym
        except ImportError:
            raise ValueError("reasoning-gym: the reasoning-gym package is not installed (`make install` "
                             "installs it)") from None
        if task not in reasoning_gym.factory.DATASETS:
            known = ", ".join(sorted(reasoning_gym.factory.DATASETS)[:12])
            raise ValueError(f"reasoning-gym: no task {task!r}; tasks include {known}, ...")
        self.task, self.config = task, dict(config or {})
        if fallback not in FALLBACKS:
            raise ValueError(f"reasoning-gym: fallback must be one of {', '.join(FALLBACKS)}, "
                             f"got {fallback!r}")
        if heldout not in HELDOUT_KEYS:
            raise ValueError(f"reasoning-gym: heldout must be one of {', '.join(HELDOUT_KEYS)}, "
                             f"got {heldout!r}")
        self.fallback, self.heldout = fallback, heldout
        self.max_turns = check_positive_int(self.name, "max_turns", max_turns)
        self.split = check_split(self.name, split, generated=True)
        try:  # the options are checked here, once, not at the first reset
            reasoning_gym.create_dataset(task, size=1, seed=0, **self.config)
        except (TypeError, ValueError, AssertionError) as exc:
            raise ValueError(f"reasoning-gym: task {task!r} refuses config {self.config}: {exc}") from None
        self._rng = random.Random()
        self._dataset: Any = None
        self._entry: dict[str, Any] = {}
        self.turn, self.done = 0, True

    @property
    def system_prompt(self) -> str:
        return f"Solve the problem. {ANSWER_FORMAT}"

    @property
    def question(self) -> str:
        return str(self._entry.get("question", ""))

    def _problem(self, seed: int) -> tuple[str]:
        import reasoning_gym

        self._dataset = reasoning_gym.create_dataset(self.task, size=1, seed=seed, **self.config)
        self._entry = self._dataset[0]
        return (self.question,) if self.heldout == "question" else (str(self._entry.get("answer")),)

    def reset(self, seed: int | None = None) -> str:
        self._rng = random.Random(seed) if seed is not None else self._rng
        draw(self.name, self._problem, self._rng, self.split)
        self.turn, self.done = 0, False
        return self.question

    def step(self, text: str) -> StepResult:
        from reasoning_gym.utils import extract_answer

        if self.done:
            raise RuntimeError(f"{self.name}: step() after the episode ended; call reset() first")
        self.turn += 1
        answer = extract_answer(text, tag_name="answer")
        if answer is None:
            answer = untagged_answer(text, self.fallback)
        score = float(self._dataset.score_answer(answer=answer, entry=self._entry) or 0.0)
        success = score >= 1.0
        truncated = not success and self.turn >= self.max_turns
        self.done = success or truncated
        observation = "" if self.done else f"Not quite. Try again. {ANSWER_FORMAT}"
        info = {"success": success, "score": score, "answer": answer, "expected": self._entry.get("answer"),
                "turn": self.turn, "truncated": truncated}
        return StepResult(observation, score, self.done, info)
