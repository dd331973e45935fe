"""`rose bench coserve-vllm`'s driver loop and its native modes (the vLLM modes need vLLM:
tests/coserve/test_coserve_vllm.py; the benchmark's figures are in docs/vllm.md)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from rose.bench.coserve_vllm import drive, run_mode
from rose.cli import main
from rose.contracts import SamplingParams
from rose.engine import RequestOutput


@dataclasses.dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    made: int = 0


class FakeBackend:
    """One token per request per step, each step `step_s` long; records what it was given."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.step_s = step_s
        self.requests: dict[str, _Request] = {}
        self.turns: list[tuple[str, float, list[int]]] = []  # (id, when, prompt)
        self.arrived: Callable[[], bool] | None = None

    def add_serving(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        self.requests[request_id] = _Request(token_ids, params.max_tokens)

    def add_turn(self, token_ids: list[int], params: SamplingParams, request_id: str) -> None:
        self.turns.append((request_id, time.monotonic(), list(token_ids)))
        self.requests[request_id] = _Request(list(token_ids), params.max_tokens)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        outs = []
        for rid, r in list(self.requests.items()):
            r.made += 1
            done = r.made == r.max_tokens
            if done:
                del self.requests[rid]
            outs.append(RequestOutput(rid, [r.made], [0.0], [0], len(r.prompt), r.made, done,
                                      "length" if done else None, 0, 0.0, None, None))
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def on_arrival(self, arrived: Callable[[], bool]) -> None:
        self.arrived = arrived


def test_drive_times_each_serving_request_from_its_arrival_and_keeps_the_backlog_going() -> None:
    backend = FakeBackend()
    arrivals = np.array([0.0, 0.05, 0.3, 0.31])
    prompts, outputs = np.array([20, 30, 40, 50]), np.array([5, 8, 3, 64])
    start = time.monotonic()
    results, rollout_tokens, wall = drive(backend, start, arrivals, prompts, outputs, 0.5, trajectories=2)

    assert [r.scheduled_s for r in results] == arrivals.tolist()
    assert [r.output_tokens for r in results] == outputs.tolist()
    for r, n in zip(results, outputs, strict=True):
        # One token per 2 ms step: the first within a few steps of arrival, the rest one a step.
        assert 0 < r.ttft_s < 0.1
        assert r.latency_s - r.ttft_s >= (n - 1) * backend.step_s
    assert wall >= 0.5
    # Each trajectory's turns: 64 tokens each; the next prompt is the last one, its 64 tokens and a
    # 32-token observation. No turn starts after the window; tokens are counted within it.
    by_traj: dict[str, list[list[int]]] = {}
    for rid, when, prompt in backend.turns:
        assert when - start < 0.5 + 0.05
        by_traj.setdefault(rid.split("-")[0], []).append(prompt)
    assert sorted(by_traj) == ["t0", "t1"]
    for prompts_ in by_traj.values():
        assert len(prompts_[0]) == 128
        for before, after in itertools.pairwise(prompts_):
            assert after[:len(before)] == before and after[len(before):][:64] == list(range(1, 65))
            assert len(after) == len(before) + 64 + 32
    finished_turns = sum(len(p) - 1 for p in by_traj.values())
    assert rollout_tokens >= 64 * finished_turns
    # The native executor is told when a request is due: nothing is due once all were added.
    assert backend.arrived is not None and not backend.arrived()


def test_native_modes_run_the_trace_and_the_backlog(tiny_qwen2: Path) -> None:
    job = {"model": str(tiny_qwen2), "duration": 6.0, "rate": 2.0, "start": 600.0, "trajectories": 4,
           "slo": {"ttft_ms": 1e6, "tpot_ms": 1e6}}
    alone = run_mode({**job, "mode": "native_alone"})
    rose = run_mode({**job, "mode": "native_rose"})
    assert alone["requests"] == rose["requests"] > 0
    assert alone["completed"] == rose["completed"] == alone["requests"]
    assert alone["rollout_tokens"] == 0 and rose["rollout_tokens"] > 0
    assert rose["slo_attainment"] == 1.0


def test_unknown_modes_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "coserve-vllm", "--modes", "vllm_dual_slo,rose"]) == 2
    assert "--modes: unknown rose; expected some of native_alone" in capsys.readouterr().err
