"""Per-turn routing of multi-turn rollouts across dedicated workers and serving executors.

Pure policy over plain data (no I/O, no clock of its own): the real rollout scheduler feeds it
heartbeats, capacity reports and measured decode rates and acts on its answers; the cluster
simulator drives the very same code. Dedicated GPUs are first-class and serving GPUs
opportunistic: a co-served turn shares every iteration with the serving model, so it decodes
slower (0.5-0.6x as fast in `rose simulate`'s paper scenarios). Each *turn* of a
trajectory is routed, in this order:

1. cache affinity: the worker that ran the trajectory's previous turn, if it has capacity (its
   prefix KV is reusable, so only the new observation needs a prefill); a serving executor
   keeps the trajectory only while moving to a dedicated worker would not pay (`pays`);
2. else the least-loaded dedicated worker with room (occupied slots over its concurrency cap);
3. else a serving-GPU executor with free rollout slots (it counts them with the admission
   policy, `rose.coserve.admission.rollout_capacity`: sequences that would still decode within
   its serving SLOs), the one with the most;
4. else the turn queues until `drain` finds room: by priority (an asynchronous run's older
   groups first, rose.rollout.stream), first come first served within one.

Rollouts start on dedicated workers and spill to serving executors when those are full, as the
ROSE paper describes its scheduler. (The design's step order puts serving executors before the
least-loaded worker; with dedicated capacity to spare that sent new trajectories to slower
executors and cost up to 22% of the throughput: docs/simulator.md, "Routing".)
`rebalance` is the other half: it moves turns in flight from serving executors, with the tokens
they produced, to dedicated workers with room where they decode faster, so trajectories migrate
back as dedicated capacity frees up and the long tail of a step finishes there.

A worker is eligible when alive (a heartbeat within `stall_timeout_s`, default 2 s), on at
least the turn's policy version, and under its concurrency cap. Turns aborted by an executor
(emergency cut) or lost with a dead worker are resumed: `resume` folds the tokens already
produced into the prompt, so routing them again continues where they stopped.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import enum
import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numba
import numpy as np

from rose.contracts import WorkerKind

STALL_TIMEOUT_S = 2.0


@dataclasses.dataclass
class WorkerState:
    """What the scheduler knows of one worker. `free_slots` comes from a serving executor's
    capacity report; dedicated workers leave it at its default."""

    worker_id: Hashable
    kind: WorkerKind
    max_concurrency: int
    active: int = 0
    held: int = 0                # trajectories between turns keeping their slot here (hold_slots)
    last_heartbeat_s: float = 0.0
    policy_version: int = 0
    free_slots: int = 0
    seq_rate: float = 0.0        # tokens/s one of its sequences decodes, measured (0: not yet)
    paused: bool = False         # its device is lent to the trainer for now: no new turn

    def alive(self, now: float, stall_timeout_s: float = STALL_TIMEOUT_S) -> bool:
        return now - self.last_heartbeat_s <= stall_timeout_s

    @property
    def occupied(self) -> int:
        return self.active + self.held

    def room(self) -> int:
        """Turns it can take now."""
        room = self.max_concurrency - self.occupied
        if self.kind is WorkerKind.SERVING:
            room = min(room, self.free_slots)
        return max(0, room)


@dataclasses.dataclass(frozen=True)
class RoutedTurn:
    """One turn of one trajectory as the routing table holds it: token ids travel beside it,
    routing needs only counts."""

    trajectory_id: Hashable
    turn: int
    prompt_tokens: int
    max_tokens: int
    policy_version: int = 0
    produced_tokens: int = 0     # tokens earlier attempts produced, now part of the prompt
    attempt: int = 0
    priority: int = 0            # queued turns with a lower one start first

    @property
    def attempt_id(self) -> str:
        """This attempt's one id, from the manager to the engine (the `Turn`'s `turn_id`)."""
        return f"{self.trajectory_id}:{self.turn}:{self.attempt}"


def resume(turn: RoutedTurn, produced: int) -> RoutedTurn:
    """The turn continued after an abort or a lost worker: the `produced` tokens it already
    generated join its prompt and come off its budget. Nothing is regenerated."""
    if not 0 <= produced <= turn.max_tokens:
        raise ValueError(f"produced must be in [0, {turn.max_tokens}], got {produced}")
    return dataclasses.replace(turn, prompt_tokens=turn.prompt_tokens + produced,
                               max_tokens=turn.max_tokens - produced,
                               produced_tokens=turn.produced_tokens + produced,
                               attempt=turn.attempt + 1)


class RouteReason(enum.Enum):
    AFFINITY = "affinity"
    SERVING = "serving"
    LEAST_LOADED = "least_loaded"
    QUEUED = "queued"


@dataclasses.dataclass(frozen=True)
class Route:
    worker_id: Hashable | None       # None when queued
    reason: RouteReason

    @property
    def cache_hit(self) -> bool:
        """The worker holds this trajectory's prefix KV from its previous turn."""
        return self.reason is RouteReason.AFFINITY


QUEUED = Route(None, RouteReason.QUEUED)


MOVE_MARGIN = 1.25        # a move must promise this much faster decoding (it costs a re-prefill)
RATE_SMOOTHING = 0.5      # weight of the newest measurement in a worker's decode rate


def pays(dst_rate: Any, dst_occupied: Any, dst_load: Any, src_rate: Any, src_load: Any) -> Any:
    """Whether a turn on a serving executor (decode rate per sequence `src_rate`, holding
    `src_load`) decodes faster on a dedicated worker (`dst_rate`, `dst_occupied` when measured)
    once that holds `dst_load` + 1. With both rates measured: the dedicated rate, taken to fall
    as 1/sequences (KV-bound decode; pessimistic), beats the executor's by MOVE_MARGIN (the
    moved turn re-prefills its context); otherwise by counts, fewer sequences than `src`.
    Numbers, or arrays over many pairs."""
    measured = (dst_rate > 0) & (src_rate > 0)
    faster = dst_rate * np.maximum(1, dst_occupied) / (dst_load + 1) > MOVE_MARGIN * src_rate
    return np.where(measured, faster, dst_load < src_load)


def _picks(count: np.ndarray, start: np.ndarray, scale: np.ndarray | float,
           most: int) -> tuple[np.ndarray, np.ndarray]:
    """Worker i's `count[i]` picks, its j-th at key `(start[i] + j) / scale[i]`, all in order of
    key, ties to the lower index: the workers a one-by-one argmin of the key picks while each pick
    adds one to its worker's `start`; at most the first `most`. Returns (worker, j) of each."""
    count, most = count.astype(np.int64), max(0, int(most))
    if not count.any():
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if np.ndim(scale) == 0 or (scale == scale[0]).all():
        s = float(np.ravel(scale)[0])
        level = np.rint(start).astype(np.int64)
        if s > 0 and (level == start).all():
            # One scale and whole starts: the keys are whole levels over it, picked level by level.
            return _level_picks(count, level, most)
    return _merge_picks(count, start.astype(np.float64),
                        np.broadcast_to(np.asarray(scale, np.float64), (len(count),)), most)


@numba.njit(cache=True)
def _level_picks(count: np.ndarray, start: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray]:
    """`_picks` where every key is a whole level `start + j` over one scale: level by level, each
    level's workers in order, from one level with picks to the next. (Compiled: a pass over the
    workers a level, the picks at the first few levels.)"""
    total = min(most, count.sum())
    w, j = np.empty(total, np.int64), np.empty(total, np.int64)
    k = 0
    level = start[count > 0].min()
    while k < total:
        after = np.iinfo(np.int64).max
        for i in range(len(count)):
            if count[i] == 0 or start[i] + count[i] <= level:
                continue
            if start[i] <= level and k < total:
                w[k], j[k] = i, level - start[i]
                k += 1
            if start[i] + count[i] > level + 1:
                after = min(after, max(start[i], level + 1))
        level = after
    return w, j


@numba.njit(cache=True)
def _merge_picks(count: np.ndarray, start: np.ndarray, scale: np.ndarray,
                 most: int) -> tuple[np.ndarray, np.ndarray]:
    """`_picks` as a merge of the workers' key sequences: a binary heap of each worker's next
    (key, worker). (Compiled: the simulator asks it of ten thousand workers several times a tick.)"""
    key, who = np.empty(len(count)), np.empty(len(count), np.int64)
    size = 0
    for i in range(len(count)):
        if count[i] > 0:
            key[size], who[size] = start[i] / scale[i], i
            size += 1
    for top in range(size // 2 - 1, -1, -1):
        _sift_down(key, who, top, size)
    total = min(most, count.sum())
    w, j = np.empty(total, np.int64), np.empty(total, np.int64)
    taken = np.zeros(len(count), np.int64)
    for k in range(total):
        i = who[0]
        w[k], j[k] = i, taken[i]
        taken[i] += 1
        if taken[i] < count[i]:
            key[0] = (start[i] + taken[i]) / scale[i]
        else:
            size -= 1
            key[0], who[0] = key[size], who[size]
        _sift_down(key, who, 0, size)
    return w, j


@numba.njit(cache=True)
def _sift_down(key: np.ndarray, who: np.ndarray, i: int, size: int) -> None:
    """Restore the heap below entry i: (key, worker) pairs, the least at the top."""
    while True:
        least = i
        for c in (2 * i + 1, 2 * i + 2):
            if c < size and (key[c] < key[least] or (key[c] == key[least] and who[c] < who[least])):
                least = c
        if least == i:
            return
        key[i], key[least] = key[least], key[i]
        who[i], who[least] = who[least], who[i]
        i = least


def spread(n: int, occupied: np.ndarray, cap: np.ndarray, free_slots: np.ndarray,
           serving: np.ndarray) -> np.ndarray:
    """The workers that `n` turns without affinity go to, turn by turn (fewer where room runs
    out): the least-loaded dedicated worker with room (occupied over its cap; ties to the
    first), then, when no dedicated worker has room, the serving executor with the most room
    (its free rollout slots, at most its cap's room; ties to the first). Each turn placed fills
    one slot. Arrays over the workers; the caller gives an ineligible worker (stale, behind the
    turn's version, or paused) no room."""
    if n <= 0:
        return np.zeros(0, np.int64)
    room = np.maximum(0, np.where(serving, np.minimum(cap - occupied, free_slots), cap - occupied))
    ded = ~serving & (room > 0)
    if n == 1:  # one turn (a turn routed on its own): the first of the picks below
        if ded.any():
            return np.array([np.argmin(np.where(ded, occupied / cap, np.inf))])
        srv = serving & (room > 0)
        return np.array([np.argmax(np.where(srv, room, -1))]) if srv.any() else np.zeros(0, np.int64)
    d, _ = _picks(np.where(ded, room, 0), occupied, cap, n)
    if len(d) >= n:
        return d
    s, _ = _picks(np.where(serving, room, 0), -room.astype(float), 1.0, n - len(d))
    return np.concatenate([d, s])


def rebalance_moves(occupied: np.ndarray, cap: np.ndarray, rate: np.ndarray, active: np.ndarray,
                    serving: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The moves `RoutingTable.rebalance` makes, as (dedicated worker, serving executor) pairs in
    order: while the least-occupied dedicated worker (ties to the first) has room, and the most
    occupied executor (ties to the first) has a turn in flight (`active`) that `pays` to move,
    one moves; each move shifts one slot. Arrays over the workers (dedicated ones alive and not
    paused, serving ones with turns in flight: the caller passes only those)."""
    ded, srv = np.flatnonzero(~serving), np.flatnonzero(serving)
    if not len(ded) or not len(srv):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    room = np.maximum(0, cap[ded] - occupied[ded])
    if not room.any():       # the least-occupied dedicated worker is full
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # Each worker's picks and, after them, one that stops the moves: a full least-occupied
    # worker, an executor out of turns. No more moves than the dedicated room.
    most = int(min(room.sum(), active[srv].sum())) + 1
    dw, dj = _picks(room + 1, occupied[ded].astype(float), 1.0, most)
    sw, sj = _picks(active[srv] + 1, -occupied[srv].astype(float), 1.0, most)
    m = min(len(dw), len(sw))
    dw, dj, sw, sj = dw[:m], dj[:m], sw[:m], sj[:m]
    dst, src = ded[dw], srv[sw]
    ok = (dj < room[dw]) & (sj < active[src]) & pays(rate[dst], occupied[dst], occupied[dst] + dj, rate[src],
                                                     occupied[src] - sj)
    k = int(np.argmin(ok)) if not ok.all() else m
    return dst[:k], src[:k]


def compile_kernels() -> None:
    """Compile the picks' kernels (or load them from numba's cache) now, before a run's first
    rebalance or batch of turns would: a fraction of a second, once a process."""
    count, start = np.array([2, 1, 0]), np.array([0.0, 1.0, 0.0])
    _picks(count, start, 1.0, 3)                      # one scale, whole starts: by levels
    _picks(count, start, np.array([1.0, 2.0, 3.0]), 3)  # the rest: a merge


def choose_worker(turn: RoutedTurn, workers: Iterable[WorkerState], previous: WorkerState | None,
                  now: float, stall_timeout_s: float = STALL_TIMEOUT_S) -> Route:
    """The routing decision for one turn; `previous` is the worker of its previous turn (None
    for a first turn or with affinity disabled). Without affinity the turn goes where `spread`
    sends one. (O(workers): the rule itself. `RoutingTable` decides the same in O(log workers).)"""
    eligible = _eligible(turn, now, stall_timeout_s)
    ws = list(workers)
    cap, occupied, serving, free = np.array(
        [(w.max_concurrency, w.occupied if eligible(w) else w.max_concurrency, w.kind is WorkerKind.SERVING,
          w.free_slots) for w in ws], float).reshape(-1, 4).T
    first = spread(1, occupied, cap, free, serving > 0)
    return _decide(previous, ws[int(first[0])] if len(first) else None, eligible)


def _eligible(turn: RoutedTurn, now: float, stall_timeout_s: float) -> Callable[[WorkerState], bool]:
    """Whether a worker may take the turn: alive, on its policy version or later, not paused."""
    version = turn.policy_version

    def eligible(w: WorkerState) -> bool:
        return w.policy_version >= version and now - w.last_heartbeat_s <= stall_timeout_s and not w.paused

    return eligible


def _decide(previous: WorkerState | None, pick: WorkerState | None,
            eligible: Callable[[WorkerState], bool]) -> Route:
    """The turn's route, given the worker of its previous turn and where `spread` would send it:
    back to a dedicated `previous` with room (its prefix KV is there); to a serving `previous`
    with room unless `pick` is a dedicated worker that `pays`; else to `pick`, or queued."""
    if previous is not None and eligible(previous) and previous.room() > 0:
        if previous.kind is WorkerKind.DEDICATED or pick is None or pick.kind is WorkerKind.SERVING:
            return Route(previous.worker_id, RouteReason.AFFINITY)
        if not pays(pick.seq_rate, pick.occupied, pick.occupied, previous.seq_rate, previous.occupied):
            return Route(previous.worker_id, RouteReason.AFFINITY)
    if pick is None:
        return QUEUED
    return Route(pick.worker_id, RouteReason.SERVING if pick.kind is WorkerKind.SERVING
                 else RouteReason.LEAST_LOADED)


_NO_ROOM_AT = (1.0, 0.0)  # a `_Picks` key this high, dedicated's and serving's: no room


class _Picks:
    """Where `spread` sends one turn, in O(log workers): the dedicated workers in a heap by load
    (occupied over cap), the serving executors in one by room (most first), ties to the first
    registered, as `spread`'s argmin and argmax. A worker's entry is pushed again whenever its
    key changes, and an entry whose key is no longer its worker's is dropped when it surfaces;
    a worker that may not take this turn (stale, paused, behind its version) is set aside for
    the pick and put back."""

    def __init__(self) -> None:
        # Dedicated workers' at 0, serving executors' at 1 (a list: an enum hashes slowly).
        self.heaps: list[list[tuple[float, int, Hashable]]] = [[], []]
        self.keys: list[dict[Hashable, float]] = [{}, {}]
        self.order: dict[Hashable, int] = {}  # registration order, for ties
        self._registered = itertools.count()

    @staticmethod
    def key(w: WorkerState) -> float:
        if w.kind is WorkerKind.DEDICATED:
            return w.occupied / w.max_concurrency
        return -float(w.room())

    def add(self, w: WorkerState) -> None:
        if w.worker_id not in self.order:
            self.order[w.worker_id] = next(self._registered)
        self.discard(w.worker_id, keep_order=True)
        self.update(w)

    def update(self, w: WorkerState) -> None:
        serving = w.kind is WorkerKind.SERVING
        key, keys = self.key(w), self.keys[serving]
        if keys.get(w.worker_id) == key:
            return
        keys[w.worker_id] = key
        heap = self.heaps[serving]
        heapq.heappush(heap, (key, self.order[w.worker_id], w.worker_id))
        if len(heap) > 4 * len(keys) + 64:  # mostly stale entries: rebuilt from the current keys
            heap[:] = [(k, self.order[i], i) for i, k in keys.items()]
            heapq.heapify(heap)

    def discard(self, worker_id: Hashable, keep_order: bool = False) -> None:
        for keys in self.keys:
            keys.pop(worker_id, None)
        if not keep_order:
            self.order.pop(worker_id, None)

    def first(self, workers: dict[Hashable, WorkerState],
              eligible: Callable[[WorkerState], bool]) -> WorkerState | None:
        return self._best(False, workers, eligible) or self._best(True, workers, eligible)

    def _best(self, serving: bool, workers: dict[Hashable, WorkerState],
              eligible: Callable[[WorkerState], bool]) -> WorkerState | None:
        heap, keys, aside, best = self.heaps[serving], self.keys[serving], [], None
        while heap:
            key, order, wid = heap[0]
            if keys.get(wid) != key or self.order.get(wid) != order:
                heapq.heappop(heap)  # stale
            elif key >= _NO_ROOM_AT[serving]:
                break
            elif not eligible(w := workers[wid]):
                aside.append(heapq.heappop(heap))
            else:
                best = w
                break
        for entry in aside:
            heapq.heappush(heap, entry)
        return best


class RoutingTable:
    """The scheduler's routing state: workers, the cache-affinity table, turns in flight per
    worker, and the queued turns (by priority, FIFO within one). Every method is a pure state
    update.

    The concurrency cap counts turns in flight; with `hold_slots` it counts trajectories, as the
    ROSE paper's "16 trajectories per GPU" and ROLL's environment managers do: a trajectory keeps
    its slot between its turns (its prefix KV stays there) until its next turn is routed or it
    ends, so queued turns start only when a trajectory finishes or moves, not at every turn
    boundary."""

    def __init__(self, stall_timeout_s: float = STALL_TIMEOUT_S, affinity: bool = True,
                 hold_slots: bool = False) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.use_affinity = affinity
        self.hold_slots = hold_slots
        self.holder: dict[Hashable, Hashable] = {}                   # trajectory -> worker held
        self.workers: dict[Hashable, WorkerState] = {}
        self.affinity: dict[Hashable, Hashable] = {}                 # trajectory -> worker
        self.in_flight: dict[Hashable, dict[Hashable, RoutedTurn]] = {}   # worker -> traj -> turn
        self.queue: list[RoutedTurn] = []      # sorted by priority, FIFO within one
        self.queued: set[Hashable] = set()     # the trajectories with a turn in the queue
        self.location: dict[Hashable, Hashable] = {}                  # trajectory -> worker running its turn
        self.counts: collections.Counter[RouteReason] = collections.Counter()
        self._picks = _Picks()

    def register(self, worker: WorkerState) -> None:
        self.workers[worker.worker_id] = worker
        self.in_flight.setdefault(worker.worker_id, {})
        self._picks.add(worker)

    def heartbeat(self, worker_id: Hashable, now: float, *, free_slots: int | None = None,
                  policy_version: int | None = None) -> None:
        w = self.workers[worker_id]
        w.last_heartbeat_s = now
        if free_slots is not None and free_slots != w.free_slots:
            w.free_slots = free_slots
            self._picks.update(w)
        if policy_version is not None:
            w.policy_version = policy_version

    def suspect(self, worker_id: Hashable) -> None:
        """A call to the worker failed: route nothing more to it until its next heartbeat."""
        if worker_id in self.workers:
            self.workers[worker_id].last_heartbeat_s = -float("inf")

    def measure(self, worker_id: Hashable, tokens_per_s: float) -> None:
        """A measured decode rate of one sequence on the worker (tokens/s), smoothed."""
        w = self.workers[worker_id]
        w.seq_rate = tokens_per_s if w.seq_rate <= 0 else (
            RATE_SMOOTHING * tokens_per_s + (1 - RATE_SMOOTHING) * w.seq_rate)

    def set_paused(self, worker_id: Hashable, paused: bool) -> None:
        """A worker whose device the trainer takes for a while (its turns in flight wait there)
        gets no new turn and no moved one meanwhile."""
        self.workers[worker_id].paused = paused

    def set_concurrency(self, worker_id: Hashable, max_concurrency: int) -> None:
        """Change a worker's concurrency cap (the rollout manager's per-worker share)."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        w = self.workers[worker_id]
        w.max_concurrency = max_concurrency
        self._picks.update(w)

    def _place(self, turn: RoutedTurn, route: Route) -> None:
        w = self.workers[route.worker_id]
        w.active += 1
        if w.kind is WorkerKind.SERVING:
            w.free_slots -= 1
        self._picks.update(w)
        self.in_flight[route.worker_id][turn.trajectory_id] = turn
        self.location[turn.trajectory_id] = route.worker_id
        self.affinity[turn.trajectory_id] = route.worker_id

    def route(self, turn: RoutedTurn, now: float) -> Route:
        """Route (and place) a turn, or queue it when no worker has room."""
        self._release(turn.trajectory_id)
        decision = self.decide(turn, now)
        self.counts[decision.reason] += 1
        if decision.worker_id is None:
            bisect.insort_right(self.queue, turn, key=lambda q: q.priority)
            self.queued.add(turn.trajectory_id)
        else:
            self._place(turn, decision)
        return decision

    def decide(self, turn: RoutedTurn, now: float) -> Route:
        """Where `choose_worker` would send the turn now, in O(log workers); nothing changes."""
        prev_id = self.affinity.get(turn.trajectory_id) if self.use_affinity else None
        previous = self.workers.get(prev_id) if prev_id is not None else None
        eligible = _eligible(turn, now, self.stall_timeout_s)
        return _decide(previous, self._picks.first(self.workers, eligible), eligible)

    def drain(self, now: float,
              owned: Callable[[RoutedTurn], bool] = lambda turn: True) -> list[tuple[RoutedTurn, Route]]:
        """Route the queued turns `owned` passes (each rollout manager drains its own: a held-out
        evaluation's manager beside an asynchronous run's), in queue order, until one finds no room."""
        placed = []
        i = 0
        while i < len(self.queue):
            turn = self.queue[i]
            if not owned(turn):
                i += 1
                continue
            del self.queue[i]
            self.queued.discard(turn.trajectory_id)
            decision = self.route(turn, now)
            if decision.worker_id is None:
                self.queue.remove(turn)          # route() queued it behind its priority's others
                self.queue.insert(i, turn)
                break
            placed.append((turn, decision))
        return placed

    def complete(self, worker_id: Hashable, trajectory_id: Hashable) -> RoutedTurn:
        """The turn finished on `worker_id`; its slot frees (with `hold_slots`, the trajectory
        keeps it until its next turn is routed). A serving executor's free slots grow back by
        one, as its next capacity report will say, so that the trajectory's next turn may return
        to its cached prefix before that report comes."""
        turn = self._take(worker_id, trajectory_id)
        w = self.workers[worker_id]
        if w.kind is WorkerKind.SERVING:
            w.free_slots += 1
            self._picks.update(w)
        return turn

    def _take(self, worker_id: Hashable, trajectory_id: Hashable) -> RoutedTurn:
        """Take the turn off `worker_id` (finished, aborted, moved or cancelled)."""
        turn = self.in_flight[worker_id].pop(trajectory_id)
        del self.location[trajectory_id]
        w = self.workers[worker_id]
        w.active -= 1
        if self.hold_slots:
            w.held += 1
            self.holder[trajectory_id] = worker_id
        self._picks.update(w)
        return turn

    def _release(self, trajectory_id: Hashable) -> None:
        wid = self.holder.pop(trajectory_id, None)
        if wid in self.workers:
            w = self.workers[wid]
            w.held -= 1
            self._picks.update(w)

    def abort(self, worker_id: Hashable, trajectory_id: Hashable, produced: int, now: float) -> Route:
        """An executor aborted the turn (emergency cut): resume it elsewhere with its tokens.
        The aborting executor loses the trajectory's affinity (its KV is gone) and takes no turn
        until its next capacity report says it has room: the report this table holds predates
        the cut, and the device is short of memory until its serving load recedes."""
        turn = self._take(worker_id, trajectory_id)
        self.affinity.pop(trajectory_id, None)
        self.full(worker_id)
        return self.route(resume(turn, produced), now)

    def rebalance(self, now: float) -> list[tuple[RoutedTurn, Hashable, Hashable]]:
        """Moves (turn, from serving executor, to dedicated worker): while the least-loaded
        eligible dedicated worker has room and a turn of the busiest serving executor would
        decode faster there (`pays`), that executor's longest-running turn moves to it. The
        caller aborts each on its executor and calls `move` with the tokens it produced."""
        ws = [w for w in self.workers.values()
              if (w.kind is WorkerKind.DEDICATED and w.alive(now, self.stall_timeout_s) and not w.paused)
              or (w.kind is WorkerKind.SERVING and w.active)]
        n = len(ws)
        dst, src = rebalance_moves(np.fromiter((w.occupied for w in ws), np.int64, n),
                                   np.fromiter((w.max_concurrency for w in ws), np.int64, n),
                                   np.fromiter((w.seq_rate for w in ws), float, n),
                                   np.fromiter((w.active for w in ws), np.int64, n),
                                   np.fromiter((w.kind is WorkerKind.SERVING for w in ws), bool, n))
        taken = {ws[i].worker_id: iter(self.in_flight[ws[i].worker_id].values()) for i in set(src.tolist())}
        moves = []
        for d, s in zip(dst.tolist(), src.tolist(), strict=True):
            turn = next(taken[ws[s].worker_id])
            if turn.policy_version > ws[d].policy_version:
                break
            moves.append((turn, ws[s].worker_id, ws[d].worker_id))
        return moves

    def move(self, trajectory_id: Hashable, src: Hashable, dst: Hashable, produced: int) -> Route:
        """Carry out one `rebalance` move: the turn resumes on `dst` with `produced` tokens."""
        turn = self._take(src, trajectory_id)
        self._release(trajectory_id)
        self.affinity.pop(trajectory_id, None)
        route = Route(dst, RouteReason.LEAST_LOADED)
        self._place(resume(turn, produced), route)
        self.counts[RouteReason.LEAST_LOADED] += 1
        return route

    def full(self, worker_id: Hashable) -> None:
        """A serving executor turned a turn away for lack of room (busy): route it nothing more
        until its next capacity report."""
        w = self.workers[worker_id]
        w.free_slots = 0
        self._picks.update(w)

    def finish_trajectory(self, trajectory_id: Hashable) -> None:
        self._release(trajectory_id)
        self.affinity.pop(trajectory_id, None)

    def cancel(self, trajectory_id: Hashable) -> RoutedTurn | None:
        """Take a trajectory out wherever it is (its step timed out or was cancelled, it failed):
        its turn in flight or queued, the slot it holds, its affinity. Returns that turn, if any."""
        wid = self.location.get(trajectory_id)
        turn = self._take(wid, trajectory_id) if wid is not None else None
        queued = [q for q in self.queue if q.trajectory_id == trajectory_id] if trajectory_id in self.queued \
            else []
        for q in queued:
            self.queue.remove(q)
        self.queued.discard(trajectory_id)
        self.finish_trajectory(trajectory_id)
        return turn or (queued[0] if queued else None)

    def reap(self, now: float) -> list[RoutedTurn]:
        """Remove workers silent past the stall timeout; return their turns in flight, which the
        caller resumes (`resume(turn, produced)`) and routes again."""
        dead = [w.worker_id for w in self.workers.values() if not w.alive(now, self.stall_timeout_s)]
        return [turn for wid in dead for turn in self.remove(wid)]

    def remove(self, worker_id: Hashable) -> list[RoutedTurn]:
        """Take a worker out now (dead, released, preempted); return its turns in flight."""
        lost = list(self.in_flight.pop(worker_id).values())
        for turn in lost:
            del self.location[turn.trajectory_id]
        del self.workers[worker_id]
        self._picks.discard(worker_id)
        for tid in [t for t, w in self.holder.items() if w == worker_id]:
            del self.holder[tid]
        for tid in [t for t, w in self.affinity.items() if w == worker_id]:
            del self.affinity[tid]
        return lost
