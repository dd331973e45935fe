"""Per-turn routing (`rose.rollout.routing`): affinity, least-loaded dedicated, serving executors,
queue; rebalancing by measured decode rates."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rose.rollout.routing import (
    RoutedTurn,
    RouteReason,
    RoutingTable,
    WorkerKind,
    WorkerState,
    choose_worker,
    resume,
    spread,
)

D, S = WorkerKind.DEDICATED, WorkerKind.SERVING


def table(affinity: bool = True) -> RoutingTable:
    t = RoutingTable(stall_timeout_s=2.0, affinity=affinity)
    t.register(WorkerState("d0", D, max_concurrency=2))
    t.register(WorkerState("d1", D, max_concurrency=4))
    t.register(WorkerState("s0", S, max_concurrency=8, free_slots=1))
    t.register(WorkerState("s1", S, max_concurrency=8, free_slots=3))
    return t


def turn(tid: str, k: int = 0) -> RoutedTurn:
    return RoutedTurn(tid, k, prompt_tokens=100, max_tokens=50)


def test_order_dedicated_first_then_serving_then_queue():
    t = table()
    reasons = [t.route(turn(f"t{i}"), 0.0) for i in range(11)]
    # Least loaded by occupied/cap: d0 (0/2), d1 (0/4) -> d0 first, then d1 (0/4 < 1/2) ...
    assert [r.worker_id for r in reasons[:6]] == ["d0", "d1", "d1", "d0", "d1", "d1"]
    assert all(r.reason is RouteReason.LEAST_LOADED for r in reasons[:6])
    # ... then, dedicated workers full, the executor with the most free slots.
    assert [r.worker_id for r in reasons[6:10]] == ["s1", "s1", "s0", "s1"]
    assert all(r.reason is RouteReason.SERVING for r in reasons[6:10])
    assert reasons[10].reason is RouteReason.QUEUED and len(t.queue) == 1


def test_affinity_wins_when_the_previous_worker_has_room():
    t = table()
    first = t.route(turn("a", 0), 0.0)
    t.complete(first.worker_id, "a")
    t.heartbeat(first.worker_id, 0.1, free_slots=1)
    again = t.route(turn("a", 1), 0.1)
    assert again.worker_id == first.worker_id and again.cache_hit


def test_no_affinity_ablation_ignores_the_previous_worker():
    t = table(affinity=False)
    t.workers["s0"].free_slots = 0
    t.workers["s1"].free_slots = 0
    first = t.route(turn("a", 0), 0.0)
    assert first.worker_id == "d0"
    t.complete("d0", "a")
    t.route(turn("b", 0), 0.0)                 # d0 now 1/2, d1 0/4
    again = t.route(turn("a", 1), 0.0)
    assert again.worker_id == "d1" and not again.cache_hit


def test_serving_executor_without_free_slots_is_not_eligible():
    assert choose_worker(turn("x"), [WorkerState("s", S, 8, free_slots=0)], None, 0.0).worker_id is None
    assert choose_worker(turn("x"), [WorkerState("s", S, 8, free_slots=5)], None, 0.0).worker_id == "s"


def test_stale_policy_version_and_stalled_worker_are_skipped():
    workers = [WorkerState("old", D, 4, policy_version=1),
               WorkerState("silent", D, 4, last_heartbeat_s=-3.0, policy_version=2),
               WorkerState("ok", D, 4, policy_version=2)]
    t = RoutedTurn("x", 0, 10, 10, policy_version=2)
    assert choose_worker(t, workers, workers[0], 0.0).worker_id == "ok"


def test_drain_routes_queued_turns_fifo_when_room_frees():
    t = RoutingTable()
    t.register(WorkerState("d", D, 1))
    t.route(turn("a"), 0.0)
    assert t.route(turn("b"), 0.0).reason is RouteReason.QUEUED
    t.route(turn("c"), 0.0)
    t.complete("d", "a")
    placed = t.drain(0.0)
    assert [p[0].trajectory_id for p in placed] == ["b"]
    assert [q.trajectory_id for q in t.queue] == ["c"]


def test_queued_turns_start_by_priority_then_first_come():
    """An asynchronous run's older groups first (lower priority), so the step it takes next fills
    before later steps' groups start; a turn that still finds no room keeps its place."""
    t = RoutingTable()
    t.register(WorkerState("d", D, 1))
    t.route(turn("a"), 0.0)
    for tid, priority in (("late", 2), ("b", 1), ("late2", 2), ("c", 1), ("first", 0)):
        assert t.route(RoutedTurn(tid, 0, 10, 10, priority=priority), 0.0).reason is RouteReason.QUEUED
    assert [q.trajectory_id for q in t.queue] == ["first", "b", "c", "late", "late2"]
    assert t.drain(0.0) == [] and t.queue[0].trajectory_id == "first"
    order = []
    while t.queue:
        t.complete("d", order[-1] if order else "a")
        order += [p[0].trajectory_id for p in t.drain(0.0)]
    assert order == ["first", "b", "c", "late", "late2"]


def test_a_paused_worker_gets_no_turn_and_no_move_until_it_resumes():
    t = table()
    t.set_paused("d0", True)
    t.set_paused("d1", True)
    assert [t.route(turn(f"t{i}"), 0.0).worker_id for i in range(3)] == ["s1", "s1", "s0"]
    t.workers["s1"].seq_rate, t.workers["d0"].seq_rate = 10.0, 100.0
    assert t.rebalance(0.0) == []                # d0 decodes faster, but its device is the trainer's
    t.set_paused("d0", False)
    assert [(src, dst) for _, src, dst in t.rebalance(0.0)][:1] == [("s1", "d0")]
    assert t.route(turn("t9"), 0.0).worker_id == "d0"


def test_held_slots_count_trajectories_not_turns():
    """With `hold_slots` a trajectory keeps its slot between turns: a queued trajectory starts when
    one ends (or moves away), not at a turn boundary; without, it takes the freed slot at once."""
    for hold in (False, True):
        t = RoutingTable(hold_slots=hold)
        t.register(WorkerState("d", D, 1))
        t.route(turn("a", 0), 0.0)
        assert t.route(turn("b", 0), 0.0).reason is RouteReason.QUEUED
        t.complete("d", "a")                                 # a's environment steps
        assert [p[0].trajectory_id for p in t.drain(0.0)] == ([] if hold else ["b"])
        if not hold:
            continue
        assert t.workers["d"].held == 1 and t.workers["d"].room() == 0
        assert t.route(turn("a", 1), 0.1).reason is RouteReason.AFFINITY   # its own slot back
        t.complete("d", "a")
        t.finish_trajectory("a")
        assert t.workers["d"].held == 0
        assert [p[0].trajectory_id for p in t.drain(0.2)] == ["b"]


def test_held_slot_is_released_when_the_trajectory_moves_or_its_worker_goes():
    t = RoutingTable(hold_slots=True)
    t.register(WorkerState("d0", D, 1))
    t.register(WorkerState("s", S, 4, free_slots=4))
    assert t.route(turn("x", 0), 0.0).worker_id == "d0"
    assert t.route(turn("a", 0), 0.0).worker_id == t.route(turn("b", 0), 0.0).worker_id == "s"
    t.complete("s", "a")
    assert t.workers["s"].held == 1
    t.complete("d0", "x")
    t.finish_trajectory("x")
    assert t.route(turn("a", 1), 0.1).worker_id == "d0"      # drifts to the less loaded dedicated
    assert (t.workers["s"].held, t.workers["d0"].occupied) == (0, 1)
    t.complete("d0", "a")
    t.remove("d0")
    assert "a" not in t.holder
    t.register(WorkerState("d1", D, 1))
    assert t.route(turn("a", 2), 0.2).worker_id in ("s", "d1")


def test_resume_folds_produced_tokens_into_the_prompt():
    r = resume(RoutedTurn("x", 3, prompt_tokens=100, max_tokens=50), 20)
    assert (r.prompt_tokens, r.max_tokens, r.produced_tokens, r.attempt) == (120, 30, 20, 1)
    with pytest.raises(ValueError):
        resume(r, 31)


def test_abort_reroutes_with_tokens_and_drops_affinity():
    t = table()
    for i in range(6):
        t.route(turn(f"f{i}"), 0.0)                          # fills the dedicated workers
    assert t.route(turn("a"), 0.0).worker_id == "s1"
    r = t.abort("s1", "a", produced=30, now=0.0)
    assert r.worker_id is not None
    moved = t.in_flight[r.worker_id]["a"]
    assert moved.produced_tokens == 30 and moved.max_tokens == 20 and moved.prompt_tokens == 130


def test_a_cut_turn_does_not_go_straight_back_to_the_executor_that_cut_it():
    t = table()
    for i in range(6):
        t.route(turn(f"f{i}"), 0.0)                          # fills the dedicated workers
    t.route(turn("a"), 0.0)                                  # s1: 3 free slots, now 2
    t.route(turn("b"), 0.0)
    assert t.location["a"] == "s1" and t.workers["s1"].free_slots == 1
    assert t.abort("s1", "a", produced=5, now=0.0).worker_id == "s0"  # s1's room predates its cut
    assert t.abort("s1", "b", produced=5, now=0.0).worker_id is None  # s0 full, s1 too: queued
    t.heartbeat("s1", 0.1, free_slots=0)                     # frozen, nothing free: still queued
    assert t.drain(0.1) == []
    t.heartbeat("s1", 0.2, free_slots=1)                     # room again, in a later report
    assert [(q.trajectory_id, r.worker_id) for q, r in t.drain(0.2)] == [("b", "s1")]


def test_dead_worker_turns_come_back_for_resume():
    t = table()
    for i in range(6):
        t.route(turn(f"t{i}"), 0.0)
    for wid in ("d1", "s0", "s1"):
        t.heartbeat(wid, 2.5)
    lost = t.reap(2.5)                                      # d0 silent for 2.5 s > 2 s
    assert "d0" not in t.workers and len(lost) == 2
    assert all(w != "d0" for w in t.affinity.values())
    r = t.route(resume(lost[0], 5), 2.5)
    assert r.worker_id in t.workers


def test_rebalance_moves_turns_only_where_they_decode_faster():
    t = RoutingTable()
    t.register(WorkerState("d", D, 8))
    t.register(WorkerState("s", S, 8, free_slots=8))
    for i in range(8):
        assert t.route(turn(f"d{i}"), 0.0).worker_id == "d"
    for i in range(3):
        assert t.route(turn(f"s{i}"), 0.0).worker_id == "s"
    for i in range(4):
        t.complete("d", f"d{i}")                             # d: 4 of 8 slots occupied
    assert t.rebalance(0.0) == []                            # unmeasured: by counts, 4 >= 3
    t.measure("d", 40.0)
    t.measure("s", 30.0)
    assert t.rebalance(0.0) == []                            # 40 x 4/5 = 32 < 1.25 x 30
    t.measure("s", 10.0)
    assert t.workers["s"].seq_rate == 20.0                   # smoothed
    # 40 x 4/5 = 32 and 40 x 4/6 = 26.7 beat 1.25 x 20 = 25; a third (22.9) would not.
    moves = t.rebalance(0.0)
    assert [(src, dst) for _, src, dst in moves] == [("s", "d")] * 2


def test_a_served_trajectory_moves_to_dedicated_only_when_it_decodes_faster_there():
    t = RoutingTable()
    t.register(WorkerState("d", D, 2))
    t.register(WorkerState("s", S, 8, free_slots=4))
    t.route(turn("x"), 0.0)
    t.route(turn("y"), 0.0)
    assert t.route(turn("a", 0), 0.0).worker_id == "s"       # dedicated full: spills over
    t.complete("s", "a")
    t.complete("d", "y")
    t.finish_trajectory("y")                                 # d has room again
    t.measure("d", 40.0)
    t.measure("s", 30.0)
    kept = t.route(turn("a", 1), 0.1)                        # 40 x 1/2 = 20 < 1.25 x 30
    assert kept.worker_id == "s" and kept.cache_hit
    t.complete("s", "a")
    t.measure("s", 5.0)
    t.measure("s", 5.0)                                      # 11.25 tokens/s: 1.25 x 11.25 < 20
    moved = t.route(turn("a", 2), 0.2)
    assert moved.worker_id == "d" and moved.reason is RouteReason.LEAST_LOADED


@pytest.mark.parametrize("caps", [(3, 4, 6), (4,)])   # mixed caps; one cap (whole levels)
def test_spread_sends_a_batch_where_one_by_one_routing_sends_each_turn(caps):
    """The simulator routes a tick's turns in one call (`spread`); it must be `choose_worker`'s
    rule, turn after turn, each placement filling a slot."""
    rng = random.Random(0)
    for _ in range(300):
        workers = []
        for i in range(rng.randint(1, 10)):
            cap = rng.choice(caps)
            workers.append(WorkerState(i, rng.choice([D, S]), cap, active=rng.randint(0, cap),
                                       free_slots=rng.randint(0, 5)))
        n = rng.randint(1, 25)
        batch = spread(n, np.array([w.occupied for w in workers], float),
                       np.array([w.max_concurrency for w in workers], float),
                       np.array([w.free_slots for w in workers], float),
                       np.array([w.kind is S for w in workers]))
        one_by_one = []
        for _ in range(n):
            route = choose_worker(turn("t"), workers, None, 0.0)
            if route.worker_id is None:
                break
            one_by_one.append(route.worker_id)
            w = workers[route.worker_id]
            w.active += 1
            w.free_slots -= w.kind is S
        assert batch.tolist() == one_by_one
