"""The serving fleet's fluid model (`rose.sim.serving`) on hand-checkable cases."""

from __future__ import annotations

import numpy as np
import pytest

from rose.coserve.admission import SLOBudgets, iteration_limit
from rose.sim.serving import ServingFleet
from rose.traces import Diurnal, Trace


def fleet(arrivals, prompts, outputs, n=1) -> ServingFleet:
    # A trace whose period is far beyond the test, so only these requests arrive.
    arr = np.array([*arrivals, 1e6])
    tr = Trace("t", arr, np.array([*prompts, 1]), np.array([*outputs, 1]))
    f = ServingFleet(n, tr, tr.mean_rate, Diurnal(0.0), 0.0, chunk_tokens=512, seed=0)
    f.phase[:] = 0.0
    return f


def run(f: ServingFleet, ticks: int, prefill_s: float, decode_s: float, per_iter: float = 512, dt=1.0):
    for k in range(ticks):
        f.advance(k * dt, dt, np.full(f.n, prefill_s), np.full(f.n, decode_s), np.full(f.n, per_iter))


def test_one_request_ttft_and_tpot():
    # 1024-token prompt at 512 tokens per 20 ms iteration: 40 ms; 11 outputs at 10 ms each.
    f = fleet([0.1], [1024], [11])
    run(f, 3, prefill_s=0.02, decode_s=0.01)
    arrival, ttft, tpot = f.log.arrays()
    assert arrival.tolist() == [pytest.approx(0.1)]
    assert ttft[0] == pytest.approx(0.04)
    # Fluid model: the tick's 40 ms of prefill iterations are averaged into every decode rate.
    assert tpot[0] == pytest.approx(0.01, rel=0.03)


def test_fifo_prefill_queues_behind_earlier_prompts():
    f = fleet([0.0, 0.0], [5120, 512], [2, 2])
    run(f, 3, prefill_s=0.1, decode_s=0.01)
    _, ttft, _ = f.log.arrays()
    assert sorted(ttft.tolist()) == [pytest.approx(1.0), pytest.approx(1.1)]


def test_blocked_prefill_waits_for_pages():
    f = fleet([0.0], [512], [2])
    run(f, 2, prefill_s=0.02, decode_s=0.01, per_iter=0.0)
    assert len(f.log.arrays()[0]) == 0 and f.prefill_backlog()[0] == 512
    f.advance(2.0, 1.0, np.full(1, 0.02), np.full(1, 0.01), np.full(1, 512.0))
    _, ttft, _ = f.log.arrays()
    assert ttft[0] == pytest.approx(2.02)


def test_decode_rate_mixes_prefill_and_decode_iterations():
    # A long prompt keeps half the tick in 20 ms prefill iterations; a decoding request
    # meanwhile gets tokens from both kinds of iteration.
    f = fleet([0.0, 0.0], [0, 0], [1001, 2])
    f.advance(0.0, 1.0, np.full(1, 0.02), np.full(1, 0.01), np.full(1, 512.0))
    assert f.decode_seqs()[0] == 1
    assert f.kv_tokens()[0] > 0


class _ZeroLatency:
    def iteration_time(self, serving: object, rollout: object) -> float:
        return 0.0


ZERO_LATENCY = _ZeroLatency()


def test_admission_sees_the_ttft_already_spent_and_tick_arrivals_as_arriving_now():
    # A prompt waiting since 0.1 s (no pages in the first tick) and one arriving during the tick
    # [1, 2). The first must keep its arrival: resetting it to the tick's start handed it a fresh
    # TTFT budget, and admission let rollouts stretch iterations past its deadline.
    f = fleet([0.1, 1.5], [5120, 512], [2, 2])
    run(f, 1, prefill_s=0.02, decode_s=0.01, per_iter=0.0)
    f.arrivals_until(2.0)
    state = f.admission_state(1.0, np.array([0]))
    assert [(float(a[0]), float(n[0])) for a, n in state.waiting] == [(pytest.approx(0.1), 5120), (1.0, 512)]
    # 1.1 s of the first's budget left for its 10 chunks; the second's 2 s for all 11.
    limit = iteration_limit(1.0, state, SLOBudgets(2.0, 0.2), ZERO_LATENCY, 512)
    assert limit == pytest.approx(min(1.1 / 10, 2.0 / 11))


def test_replicas_get_their_own_copies_of_the_trace():
    tr = Trace("t", np.arange(0.0, 100.0, 0.5), np.full(200, 10), np.full(200, 3))
    f = ServingFleet(4, tr, 2.0, Diurnal(0.0), 0.0, 512, seed=3)
    f.arrivals_until(50.0)
    counts = np.bincount(f.w_rep, minlength=4)
    assert counts.sum() == pytest.approx(4 * 100, abs=8)
