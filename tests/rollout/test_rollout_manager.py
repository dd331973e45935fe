"""The worker registry and the rollout manager with fake in-process workers: heartbeats and the
stall timeout, an executor's emergency cut resumed elsewhere with its tokens, a worker that dies
or falls silent mid-turn, rebalancing from serving to dedicated, queueing under caps, a step that
times out (and the next one on the same workers), turns refused for what they are, and busy
executors."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
from fake_workers import TOKEN, FakeWorker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rose.contracts import WorkerKind
from rose.engine import SamplingParams
from rose.model import load_tokenizer
from rose.rl import Episode, make_env
from rose.rollout.manager import RolloutManager
from rose.rollout.registry import WorkerRegistry
from rose.rollout.routing import RoutingTable


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path):
    return load_tokenizer(tiny_qwen3)


def episodes(tokenizer, n: int, max_turns: int = 2) -> list[Episode]:
    return [Episode(make_env("frozenlake", max_turns=max_turns), tokenizer, seed=i, group_id=i // 2)
            for i in range(n)]


def run(workers: list[FakeWorker], eps: list[Episode], max_tokens: int = 6, stall_timeout_s: float = 2.0,
        rebalance: bool = True, timeout_s: float = 30.0, turn_retries: int = 2):
    registry = WorkerRegistry(stall_timeout_s)
    for w in workers:
        registry.add(w)
    params = SamplingParams(max_tokens=max_tokens)
    manager = RolloutManager(registry, params, tick_s=0.02, rebalance=rebalance, turn_retries=turn_retries)
    return asyncio.run(manager.run(eps, policy_version=0, timeout_s=timeout_s)), registry


def assert_released(registry: WorkerRegistry, workers: list[FakeWorker]) -> None:
    """Nothing of a finished step is left: no slot, turn in flight or queued, held slot or
    affinity in the routing table, and no call still running on a worker."""
    table = registry.table
    assert all(w.active == 0 and w.held == 0 for w in table.workers.values())
    assert not any(table.in_flight.values()) and not table.queue and not table.holder and not table.affinity
    assert all(w.running == 0 for w in workers)


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
    assert report.serving_token_share == 0.0
    assert all(w.active == 0 for w in registry.table.workers.values()) and not registry.table.queue


def test_aborted_turn_resumes_elsewhere_with_its_tokens(tokenizer) -> None:
    serving = FakeWorker("s", WorkerKind.SERVING, abort_after=2)  # cuts every turn after 2 tokens
    dedicated = FakeWorker("d", cap=1, delay_s=0.02)
    eps = episodes(tokenizer, 4, max_turns=1)
    report, _ = run([serving, dedicated], eps, rebalance=False)
    check_complete(report, eps)
    cut = [p for p in report.placements if p.outcome == "abort"]
    assert cut and all(p.worker_id == "s" and p.tokens == 2 for p in cut)
    assert report.handed_back_turns == len(cut)
    # Every continuation starts from the prompt plus the tokens already produced, on a smaller budget.
    calls = serving.calls + dedicated.calls
    first = {turn_id[:-2]: ids for turn_id, ids, _ in calls if turn_id.endswith(":0")}
    assert any(not turn_id.endswith(":0") for turn_id, _, _ in calls)
    for turn_id, ids, budget in calls:
        assert ids == first[turn_id.rsplit(":", 1)[0]] + [TOKEN] * (6 - budget)
    assert 0 < report.serving_token_share < 1


def test_a_worker_that_dies_mid_turn_loses_nothing(tokenizer) -> None:
    doomed, survivor = FakeWorker("doomed", cap=4, die_after=3), FakeWorker("ok", cap=4)
    eps = episodes(tokenizer, 8)
    report, registry = run([doomed, survivor], eps)
    check_complete(report, eps)
    lost = [p for p in report.placements if p.outcome == "lost"]
    assert lost and all(p.worker_id == "doomed" and p.tokens == 3 for p in lost[:1])
    assert registry.alive() == ["ok"]


def test_a_stream_cut_short_is_a_worker_failure_not_a_finished_turn(tokenizer) -> None:
    broken, survivor = FakeWorker("broken", cap=4, break_after=2), FakeWorker("ok", cap=4)
    eps = episodes(tokenizer, 4, max_turns=1)
    report, registry = run([broken, survivor], eps, stall_timeout_s=0.3)
    check_complete(report, eps)  # on 0dda912 such a turn counted as done with 2 of its 6 tokens
    assert {(p.outcome, p.tokens) for p in report.placements if p.worker_id == "broken"} == {("lost", 2)}
    assert_released(registry, [broken, survivor])


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
    moved = [p for p in report.placements if p.outcome == "moved"]
    assert moved and all(p.worker_id == "s" for p in moved)
    assert report.handed_back_turns == 0  # moved by the scheduler, not handed back by the executor


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
    for u in report.lost:
        assert u.reason.startswith("unfinished at the 1.0 s timeout: turn 0 (attempt ")  # the dead one's
        assert u.reason.endswith(") queued: no eligible worker had room")  # failed call may come first


def test_a_timed_out_step_keeps_what_finished_frees_every_slot_and_the_next_step_finishes(tokenizer) -> None:
    worker = FakeWorker("a", cap=3, stuck={"s0-0", "s0-1"})  # two turns never end: the step times out
    registry = WorkerRegistry(2.0)
    registry.add(worker)
    manager = RolloutManager(registry, SamplingParams(max_tokens=6), tick_s=0.02)

    async def two_steps():
        first = await manager.run(episodes(tokenizer, 5, max_turns=1), 0, prefix="s0-", timeout_s=2.0)
        assert_released(registry, [worker])
        worker.stuck = ()
        eps = episodes(tokenizer, 6, max_turns=1)
        return first, await manager.run(eps, 0, prefix="s1-", timeout_s=30.0), eps

    first, second, eps = asyncio.run(two_steps())
    assert len(first.trajectories) == 3 and first.failed == []
    assert sorted(u.trajectory_id for u in first.lost) == ["s0-0", "s0-1"] and first.lost_trajectories == 2
    for u in first.lost:
        assert u.reason == "unfinished at the 2.0 s timeout: turn 0 (attempt 0) running on a"
    check_complete(second, eps)  # on 0dda912 the stale slots kept every turn queued: all 6 lost
    assert_released(registry, [worker])


@pytest.mark.parametrize("retries", [0, 2])
def test_a_refused_turn_fails_its_trajectory_not_the_workers(tokenizer, retries: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    suspected: list[str] = []
    monkeypatch.setattr(RoutingTable, "suspect", lambda self, wid: suspected.append(wid))
    refused = {"t1", "t4"}
    workers = [FakeWorker("a", cap=2, refuse=refused), FakeWorker("b", cap=2, refuse=refused)]
    eps = episodes(tokenizer, 6)
    report, registry = run(workers, eps, turn_retries=retries, timeout_s=60.0)
    # On 0dda912: every refusal suspected its worker (72 calls in 2 s for 8 such trajectories on
    # two workers) and the step was lost at its timeout.
    assert suspected == [] and sorted(registry.alive()) == ["a", "b"]
    assert sorted(u.trajectory_id for u in report.failed) == ["t1", "t4"] and report.failed_trajectories == 2
    for u in report.failed:
        assert u.reason.startswith(f"turn 0 refused {retries + 1} times, the last by ")
        assert u.reason.endswith(": temperature must be >= 0, got -1.0") and u.turns == 0
    calls = [turn_id for w in workers for turn_id, _, _ in w.calls]
    assert sorted(c for c in calls if c.startswith(("t1:", "t4:"))) == sorted(
        f"{t}:0:{k}" for t in ("t1", "t4") for k in range(retries + 1))
    assert {p.outcome for p in report.placements} == {"done", "rejected"}
    assert report.lost_trajectories == 0 and len(report.trajectories) == 4 and report.seconds < 30
    assert_released(registry, workers)


def test_an_environment_error_fails_its_trajectory_alone(tokenizer) -> None:
    eps = episodes(tokenizer, 3, max_turns=1)

    def crash(text: str):
        raise RuntimeError("the environment crashed")

    eps[1].env.step = crash  # on 0dda912 the trajectory vanished into lost_trajectories, no reason given
    worker = FakeWorker("a")
    report, registry = run([worker], eps)
    assert [(u.trajectory_id, u.reason) for u in report.failed] == [
        ("t1", "RuntimeError: the environment crashed")]
    assert len(report.trajectories) == 2 and report.lost == []
    assert_released(registry, [worker])


def test_a_busy_executor_keeps_its_standing(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    suspected: list[str] = []
    monkeypatch.setattr(RoutingTable, "suspect", lambda self, wid: suspected.append(wid))
    busy = FakeWorker("s", WorkerKind.SERVING, cap=4, busy_calls=3)  # 429 to its first 3 turns
    dedicated = FakeWorker("d", cap=1, delay_s=0.01)
    eps = episodes(tokenizer, 4, max_turns=1)
    report, registry = run([busy, dedicated], eps, rebalance=False)
    check_complete(report, eps)
    assert [p.worker_id for p in report.placements if p.outcome == "busy"] == ["s"] * 3
    assert "lost" not in {p.outcome for p in report.placements}
    assert suspected == [] and sorted(registry.alive()) == ["d", "s"]
    assert_released(registry, [busy, dedicated])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_mix_of_faults_accounts_for_every_trajectory_and_frees_every_slot(tokenizer, data) -> None:
    n = data.draw(st.integers(1, 6), label="episodes")
    ids = [f"s0-{i}" for i in range(n)]
    subset = st.sets(st.sampled_from(ids), max_size=2)
    maybe = st.none() | st.integers(1, 4)
    spec = st.tuples(st.sampled_from(WorkerKind), st.integers(1, 3), subset, subset, st.integers(0, 2),
                     maybe, maybe)  # kind, cap, refuse, stuck, busy calls, cut after, die after
    workers = [FakeWorker(f"w{i}", kind, cap, refuse=refuse, stuck=stuck, busy_calls=busy, abort_after=cut,
                          die_after=die)
               for i, (kind, cap, refuse, stuck, busy, cut, die)
               in enumerate(data.draw(st.lists(spec, min_size=1, max_size=3), label="workers"))]
    registry = WorkerRegistry(2.0)
    for w in workers:
        registry.add(w)
    manager = RolloutManager(registry, SamplingParams(max_tokens=6), tick_s=0.02)

    async def faulty_then_healthy():
        eps = episodes(tokenizer, n)
        first = await manager.run(eps, 0, prefix="s0-", timeout_s=1.0)
        kept = {id(t) for t in first.trajectories}
        assert kept <= {id(e.trajectory) for e in eps if e.done} and len(kept) == len(first.trajectories)
        ended = [u.trajectory_id for u in first.failed + first.lost]
        assert len(set(ended)) == len(ended) and len(kept) + len(ended) == n
        assert_released(registry, workers)
        for w in workers:
            w.refuse = w.stuck = ()
            w.busy_calls, w.abort_after, w.die_after, w.dead = 0, None, None, False
        eps = episodes(tokenizer, n)
        return await manager.run(eps, 0, prefix="s1-", timeout_s=30.0), eps

    second, eps = asyncio.run(faulty_then_healthy())
    check_complete(second, eps)
    assert_released(registry, workers)


def test_two_managers_on_one_registry_each_drain_their_own_queued_turns(tokenizer) -> None:
    """A held-out evaluation's manager runs beside an asynchronous run's on the same workers: with
    every slot taken, each manager's queued turns wait for that manager's own drain (one used to
    route the other's, which then waited forever)."""
    worker = FakeWorker("d0", cap=2, delay_s=0.005)
    registry = WorkerRegistry(2.0)
    registry.add(worker)
    params = SamplingParams(max_tokens=6)

    async def both():
        stream_like = RolloutManager(registry, params, tick_s=0.02)
        evaluation = RolloutManager(registry, params, tick_s=0.02)
        return await asyncio.gather(stream_like.run(episodes(tokenizer, 8), 0, prefix="a", timeout_s=30),
                                    evaluation.run(episodes(tokenizer, 8), 0, prefix="e", timeout_s=30))

    for report in asyncio.run(both()):
        check_complete(report, episodes(tokenizer, 8))
    assert_released(registry, [worker])
