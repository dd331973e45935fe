"""The routing table under random interleavings (hypothesis state machine): turns submitted,
completed, failed (worker lost), refused or handed back, turned away (busy), moved, timed out
with a silent worker, cancelled with their step. After every operation each worker's counts
match its turns; once every trajectory ends or is cancelled nothing is left: no slot, turn in
flight or queued, held slot or affinity."""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rose.rollout.routing import RoutedTurn, RoutingTable, WorkerKind, WorkerState, choose_worker, resume

STALL_S = 2.0


class TableMachine(RuleBasedStateMachine):
    """The model: each live trajectory is either routed (its turn in flight or queued) or between
    two turns; the table must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.table = RoutingTable(STALL_S)
        self.specs: dict[str, tuple[WorkerKind, int]] = {}
        self.now = 0.0
        self.routed: dict[str, RoutedTurn] = {}   # trajectory -> its current turn
        self.between: dict[str, int] = {}          # trajectory -> turns it finished
        self.next_id = 0

    @initialize(hold=st.booleans(), affinity=st.booleans(),
                workers=st.lists(st.tuples(st.sampled_from(WorkerKind), st.integers(1, 3)),
                                 min_size=1, max_size=4))
    def setup(self, hold: bool, affinity: bool, workers: list[tuple[WorkerKind, int]]) -> None:
        self.table = RoutingTable(STALL_S, affinity=affinity, hold_slots=hold)
        self.specs = {f"w{i}": spec for i, spec in enumerate(workers)}
        for wid in self.specs:
            self._register(wid)

    def _register(self, wid: str) -> None:
        kind, cap = self.specs[wid]
        self.table.register(WorkerState(wid, kind, cap, last_heartbeat_s=self.now, free_slots=cap))

    def _in_flight(self) -> list[tuple[Hashable, Hashable]]:
        return sorted((w, t) for w, turns in self.table.in_flight.items() for t in turns)

    # -- operations ------------------------------------------------------------------------------

    @rule(prompt=st.integers(1, 100), budget=st.integers(1, 16))
    def submit(self, prompt: int, budget: int) -> None:
        tid = f"t{self.next_id}"
        self.next_id += 1
        self.routed[tid] = RoutedTurn(tid, 0, prompt, budget)
        self.table.route(self.routed[tid], self.now)

    @precondition(lambda self: self.between)
    @rule(data=st.data())
    def next_turn(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.between)))
        self.routed[tid] = RoutedTurn(tid, self.between.pop(tid), 10, 8)
        self.table.route(self.routed[tid], self.now)

    @precondition(lambda self: any(self.table.in_flight.values()))
    @rule(data=st.data(), outcome=st.sampled_from(["done", "lost", "refused", "busy", "handed_back"]),
          produced=st.integers(0, 16))
    def end_attempt(self, data: st.DataObject, outcome: str, produced: int) -> None:
        """An attempt ends as the rollout manager handles it."""
        wid, tid = data.draw(st.sampled_from(self._in_flight()))
        turn = self.routed[tid]
        produced = min(produced, turn.max_tokens)
        if outcome == "done":
            self.table.complete(wid, tid)
            self.between[tid] = turn.turn + 1
            del self.routed[tid]
            return
        self.routed[tid] = resume(turn, produced)
        if outcome == "lost":
            self.table.complete(wid, tid)
            self.table.route(self.routed[tid], self.now)
        else:
            if outcome == "busy":
                self.table.full(wid)
            self.table.abort(wid, tid, produced, self.now)

    @precondition(lambda self: self.between)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.between)))
        del self.between[tid]
        self.table.finish_trajectory(tid)

    @precondition(lambda self: self.routed or self.between)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """The step timed out or was cancelled, or the trajectory failed."""
        tid = data.draw(st.sampled_from(sorted([*self.routed, *self.between])))
        turn = self.table.cancel(tid)
        assert turn == self.routed.pop(tid, None)
        self.between.pop(tid, None)

    @precondition(lambda self: self.table.workers)
    @rule(data=st.data())
    def worker_times_out(self, data: st.DataObject) -> None:
        """A worker falls silent past the stall timeout: reaped, its turns routed again."""
        silent = data.draw(st.sampled_from(sorted(self.table.workers)))
        self.now += STALL_S + 1
        for wid in self.table.workers:
            if wid != silent:
                self.table.heartbeat(wid, self.now)
        expected = {t for w, t in self._in_flight() if w == silent}
        lost = self.table.reap(self.now)
        assert {t.trajectory_id for t in lost} == expected
        for turn in lost:
            self.routed[turn.trajectory_id] = resume(turn, 0)
            self.table.route(self.routed[turn.trajectory_id], self.now)

    @precondition(lambda self: len(self.table.workers) < len(self.specs))
    @rule(data=st.data())
    def worker_returns(self, data: st.DataObject) -> None:
        self._register(data.draw(st.sampled_from(sorted(set(self.specs) - set(self.table.workers)))))

    @precondition(lambda self: self.table.workers)
    @rule(data=st.data(), free=st.integers(0, 3), version=st.integers(0, 1), paused=st.booleans())
    def heartbeat(self, data: st.DataObject, free: int, version: int, paused: bool) -> None:
        self.now += 0.1
        wid = data.draw(st.sampled_from(sorted(self.table.workers)))
        self.table.heartbeat(wid, self.now, free_slots=free, policy_version=version)
        self.table.set_paused(wid, paused)

    @rule()
    def drain(self) -> None:
        for turn, _ in self.table.drain(self.now):
            assert turn == self.routed[turn.trajectory_id]

    @rule(produced=st.integers(0, 4))
    def rebalance(self, produced: int) -> None:
        for turn, src, dst in self.table.rebalance(self.now)[:1]:
            produced = min(produced, turn.max_tokens)
            self.routed[turn.trajectory_id] = resume(turn, produced)
            self.table.move(turn.trajectory_id, src, dst, produced)

    # -- what must hold --------------------------------------------------------------------------

    @invariant()
    def counts_match_turns(self) -> None:
        t = self.table
        assert set(t.in_flight) == set(t.workers)
        for wid, w in t.workers.items():
            assert w.active == len(t.in_flight[wid]), wid
            assert w.held == sum(h == wid for h in t.holder.values()), wid
            assert w.occupied <= w.max_concurrency, wid
        placed = [tid for turns in t.in_flight.values() for tid in turns] + [q.trajectory_id for q in t.queue]
        assert sorted(placed) == sorted(self.routed)  # each routed turn in exactly one place
        assert set(t.holder) <= set(self.between) | set(self.routed)

    @invariant()
    def picks_as_the_rule_does(self) -> None:
        """The table's indexed pick is `choose_worker`'s, for a new trajectory and for each
        routed one's next turn (its affinity), on every version."""
        t = self.table
        for tid in ["new", *self.routed]:
            previous = t.workers.get(t.affinity.get(tid)) if t.use_affinity else None
            for version in (0, 1):
                probe = RoutedTurn(tid, 1, 10, 8, policy_version=version)
                rule = choose_worker(probe, t.workers.values(), previous, self.now, STALL_S)
                assert t.decide(probe, self.now) == rule
        assert t.location == {tid: wid for wid, turns in t.in_flight.items() for tid in turns}
        assert t.queued == {q.trajectory_id for q in t.queue}

    def teardown(self) -> None:
        for tid in [*self.routed, *self.between]:
            self.table.cancel(tid)
        t = self.table
        assert all(w.active == 0 and w.held == 0 for w in t.workers.values())
        assert not any(t.in_flight.values()) and not t.queue and not t.holder and not t.affinity


TestRoutingTableReleasesEverything = TableMachine.TestCase
TestRoutingTableReleasesEverything.settings = settings(max_examples=300, stateful_step_count=40,
                                                       deadline=None)
