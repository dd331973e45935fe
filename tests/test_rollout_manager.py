"""The worker registry and the rollout manager with fake in-process workers: heartbeats and the
stall timeout, an executor's emergency cut resumed elsewhere with its tokens, a worker that dies
or falls silent mid-turn, rebalancing from serving to dedicated, and queueing under caps."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from rose.engine import SamplingParams
from rose.model import load_tokenizer
from rose.rl import Episode, make_env
from rose.rollout.manager import RolloutManager
from rose.rollout.registry import WorkerRegistry
from rose.rollout.routing import WorkerKind
from rose.rollout.workers import Heartbeat, TurnResult, extend

TOKEN = 50  # what fake workers generate


class FakeWorker:
    def __init__(self, worker_id: str, kind: WorkerKind = WorkerKind.DEDICATED, cap: int = 8, *,
                 abort_after: int | None = None, die_after: int | None = None, hang_after: int | None = None,
                 delay_s: float = 0.002) -> None:
        self.worker_id, self.kind, self.max_concurrency = worker_id, kind, cap
        self.abort_after, self.die_after, self.hang_after = abort_after, die_after, hang_after
        self.delay_s = delay_s
        self.calls: list[tuple[str, list[int], int]] = []
        self.aborted: set[str] = set()
        self.dead = self.hung = False
        self.policy_version = 0

    async def run_turn(self, turn_id: str, trajectory_id: str, token_ids: list[int], params: SamplingParams,
                       policy_version: int | None, result: TurnResult) -> TurnResult:
        self.calls.append((turn_id, list(token_ids), params.max_tokens))
        for i in range(params.max_tokens):
            if self.dead:
                raise ConnectionError(f"{self.worker_id} is gone")
            if i == self.abort_after or turn_id in self.aborted:
                result.finish_reason = "abort"  # an emergency cut: handed back with its tokens
                return result
            if i == self.die_after:
                self.dead = True
                raise ConnectionError(f"{self.worker_id} died")
            if i == self.hang_after:
                self.hung = True
                await asyncio.Event().wait()
            await asyncio.sleep(self.delay_s)
            last = i == params.max_tokens - 1
            extend(result, TurnResult([TOKEN], [-1.0], [self.policy_version], "length" if last else None))
        return result

    async def heartbeat(self) -> Heartbeat:
        if self.dead:
            raise ConnectionError(f"{self.worker_id} is gone")
        if self.hung:
            await asyncio.sleep(60)
        return Heartbeat(self.policy_version, free_slots=self.max_concurrency, slack_s=1.0)

    async def abort(self, turn_id: str) -> None:
        self.aborted.add(turn_id)

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path):
    return load_tokenizer(tiny_qwen3)


def episodes(tokenizer, n: int, max_turns: int = 2) -> list[Episode]:
    return [Episode(make_env("frozenlake", max_turns=max_turns), tokenizer, seed=i, group_id=i // 2)
            for i in range(n)]


def run(workers: list[FakeWorker], eps: list[Episode], max_tokens: int = 6, stall_timeout_s: float = 2.0,
        rebalance: bool = True, timeout_s: float = 30.0):
    registry = WorkerRegistry(stall_timeout_s)
    for w in workers:
        registry.add(w)
    params = SamplingParams(max_tokens=max_tokens)
    manager = RolloutManager(registry, params, tick_s=0.02, rebalance=rebalance)
    return asyncio.run(manager.run(eps, policy_version=0, timeout_s=timeout_s)), registry


def check_complete(report, eps: list[Episode], max_tokens: int = 6) -> None:
    assert report.lost_trajectories == 0 and len(report.trajectories) == len(eps)
    for traj in report.trajectories:
        assert traj.turns and all(t.output_ids == [TOKEN] * max_tokens for t in traj.turns)
        assert all(len(t.logprobs) == len(t.versions) == max_tokens for t in traj.turns)


def test_heartbeats_and_stall_timeout() -> None:
    now = [0.0]
    registry = WorkerRegistry(stall_timeout_s=2.0, clock=lambda: now[0])
    a, b = FakeWorker("a"), FakeWorker("b", WorkerKind.SERVING)
    registry.add(a)
    registry.add(b)
    with pytest.raises(ValueError, match="already registered"):
        registry.add(a)
    b.dead = True
    now[0] = 1.5
    asyncio.run(registry.poll())
    assert registry.table.workers["a"].last_heartbeat_s == 1.5 and registry.table.workers["a"].free_slots == 8
    now[0] = 2.5  # b silent for 2.5 s > 2 s, a for 1 s
    assert registry.reap() == [] and registry.alive() == ["a"]
    b.dead = False  # it answers again: registered again
    asyncio.run(registry.poll())
    assert sorted(registry.alive()) == ["a", "b"]
    with pytest.raises(ValueError, match="stall_timeout_s"):
        WorkerRegistry(0)


def test_all_turns_complete_on_dedicated_workers(tokenizer) -> None:
    workers = [FakeWorker("a", cap=2), FakeWorker("b", cap=2)]
    eps = episodes(tokenizer, 8)
    report, registry = run(workers, eps)
    check_complete(report, eps)
    assert {p.worker_id for p in report.placements} == {"a", "b"} and report.resumed_turns == 0
    assert report.serving_fraction == 0.0
    assert all(w.active == 0 for w in registry.table.workers.values()) and not registry.table.queue


def test_aborted_turn_resumes_elsewhere_with_its_tokens(tokenizer) -> None:
    serving = FakeWorker("s", WorkerKind.SERVING, abort_after=2)  # cuts every turn after 2 tokens
    dedicated = FakeWorker("d", cap=1, delay_s=0.02)
    eps = episodes(tokenizer, 4, max_turns=1)
    report, _ = run([serving, dedicated], eps, rebalance=False)
    check_complete(report, eps)
    cut = [p for p in report.placements if p.outcome == "abort"]
    assert cut and all(p.worker_id == "s" and p.tokens == 2 for p in cut)
    # Every continuation starts from the prompt plus the tokens already produced, on a smaller budget.
    calls = serving.calls + dedicated.calls
    first = {turn_id[:-2]: ids for turn_id, ids, _ in calls if turn_id.endswith(":0")}
    assert any(not turn_id.endswith(":0") for turn_id, _, _ in calls)
    for turn_id, ids, budget in calls:
        assert ids == first[turn_id.rsplit(":", 1)[0]] + [TOKEN] * (6 - budget)
    assert 0 < report.serving_fraction < 1


def test_a_worker_that_dies_mid_turn_loses_nothing(tokenizer) -> None:
    doomed, survivor = FakeWorker("doomed", cap=4, die_after=3), FakeWorker("ok", cap=4)
    eps = episodes(tokenizer, 8)
    report, registry = run([doomed, survivor], eps)
    check_complete(report, eps)
    lost = [p for p in report.placements if p.outcome == "lost"]
    assert lost and all(p.worker_id == "doomed" and p.tokens == 3 for p in lost[:1])
    assert registry.alive() == ["ok"]


def test_a_silent_worker_is_reaped_and_its_turns_resumed(tokenizer) -> None:
    silent, survivor = FakeWorker("silent", cap=4, hang_after=2), FakeWorker("ok", cap=4)
    eps = episodes(tokenizer, 4, max_turns=1)
    report, registry = run([silent, survivor], eps, stall_timeout_s=0.3)
    check_complete(report, eps)
    assert [p.tokens for p in report.placements if p.outcome == "lost"][:1] == [2]
    assert registry.alive() == ["ok"]


def test_rebalance_moves_serving_turns_to_idle_dedicated_workers(tokenizer) -> None:
    serving = FakeWorker("s", WorkerKind.SERVING, cap=8, delay_s=0.05)
    dedicated = FakeWorker("d", cap=8, delay_s=0.005)
    eps = episodes(tokenizer, 12, max_turns=1)
    report, _ = run([serving, dedicated], eps, max_tokens=8)
    check_complete(report, eps, max_tokens=8)
    moved = [p for p in report.placements if p.outcome == "abort"]
    assert moved and all(p.worker_id == "s" for p in moved)


def test_turns_queue_under_caps_and_time_out_without_workers(tokenizer) -> None:
    only = FakeWorker("a", cap=1)
    eps = episodes(tokenizer, 3, max_turns=1)
    report, _ = run([only], eps)
    check_complete(report, eps)
    spans = sorted((p.start_s, p.end_s) for p in report.placements)
    assert all(b[0] >= a[1] for a, b in itertools.pairwise(spans))  # cap 1: never two at once
    gone = FakeWorker("gone")
    gone.dead = True
    report, _ = run([gone], episodes(tokenizer, 2, max_turns=1), stall_timeout_s=0.1, timeout_s=1.0)
    assert report.lost_trajectories == 2 and report.trajectories == []
