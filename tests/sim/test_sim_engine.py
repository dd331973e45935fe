"""The simulation core end to end on small clusters: every system runs the same workload,
nothing is lost, and the policies show the effects they exist for."""

from __future__ import annotations

import numpy as np
import pytest

from rose.coserve.admission import BurstState
from rose.sim.engine import Simulation, with_serving_engine
from rose.sim.rates import plan_rates
from rose.sim.runner import run_scenario
from rose.sim.scenarios import load_scenario
from rose.sim.systems import SYSTEMS
from rose.sim.workers import COSERVE, DEDICATED

SMALL = ["cluster.train_gpus=4", "cluster.serving_gpus=8", "rl.trajectories=256", "rl.steps=2",
         "rl.response_median=300", "rl.max_response=1024", "sim.tick_s=2", "sim.slice=1"]


@pytest.fixture(scope="module")
def small():
    return run_scenario(load_scenario("paper-8b", [*SMALL, f"sim.systems=[{','.join(SYSTEMS)}]"]))


def test_every_system_trains_every_trajectory(small):
    tokens = {name: sum(s.generated_tokens for s in r.steps) for name, r in small.runs.items()}
    assert len(set(tokens.values())) == 1                    # the same workload for all
    for r in small.runs.values():
        assert len(r.steps) == 2 and all(s.trajectories == 256 for s in r.steps)
        assert r.total_s > 0 and np.isclose(r.tick_tokens.sum(), tokens["fixed-sync"], rtol=0.02)


def test_only_elastic_and_coserving_systems_pay_allocation(small):
    oh = small.summary()["allocation_overhead"]
    assert oh["fixed-sync"] == oh["fixed-async"] == 0.0
    assert oh["elastic-spot"] > oh["elastic-serverless"] > oh["rose"] > 0.0


def test_rose_uses_serving_gpus_and_meets_the_slo(small):
    rose = small.runs["rose"]
    assert rose.tick_tokens[:, 2].sum() > 0                  # tokens generated on serving GPUs
    # Minutes over the SLO: none that serving alone does not have over the same span.
    assert small.serving["rose"].violations <= small.serving["serving-alone"].violations


def test_no_affinity_ablation_prefills_more_and_is_not_faster(small):
    assert small.runs["rose-no-affinity"].routes.get("affinity", 0) == 0
    assert small.runs["rose-no-affinity"].mean_rollout_s >= small.runs["rose"].mean_rollout_s * 0.98


def test_full_weight_sync_waits_longer_for_serving_gpus():
    # At 10 Gb/s a full 8B update takes ~13 s to reach the serving GPUs, a sparse delta ~2 s.
    sc = load_scenario("paper-8b", [*SMALL, "cluster.cross_gbps=10"])
    full = Simulation(sc, SYSTEMS["rose-full-weights"]).run()
    sparse = Simulation(sc, SYSTEMS["rose"]).run()
    # Step 0 loads full weights in both; from step 1 on the delta is ~11 s faster to deliver.
    assert full.steps[1].alloc_s > sparse.steps[1].alloc_s + 8


def test_rose_without_serving_gpus_is_fixed_sync():
    sc = load_scenario("paper-8b", [*SMALL, "cluster.serving_gpus=0"])
    a = Simulation(sc, SYSTEMS["fixed-sync"]).run()
    b = Simulation(sc, SYSTEMS["rose"]).run()
    assert b.total_s == pytest.approx(a.total_s)


def test_a_serving_iteration_s_host_time_runs_whole_rollout_iterations():
    # A serving iteration every 100 ms, its engine's overhead host work with the GPU idle: the
    # rollout engine beside it decodes its 16 sequences in as many whole iterations as fit.
    sc = with_serving_engine(load_scenario("paper-8b", SMALL))
    sim = Simulation(sc, SYSTEMS["rose"])
    cs, wid, n = sim.coserving, sim.first_cs, len(sim.workers.kind)
    dec, ctx, none = np.zeros(n), np.zeros(n), np.zeros(n)
    dec[wid], ctx[wid] = 16, 16 * 2000
    load = (dec, ctx, none, none)
    plan, _ = plan_rates(*load, cs.cs_cost, cs.dt, 8192.0)
    cs._in_host_time(plan, np.array([wid]), np.array([10.0]), load)
    whole = int(cs.host_s // float(cs.cs_cost.time(0.0, 16.0, 32000.0)))
    assert cs.host_s == pytest.approx(sc.serving.engine_overhead_ms / 1e3) and whole >= 2
    assert plan.rate0[wid] == pytest.approx(whole * 10.0)   # tokens a sequence, a serving iteration each
    assert plan.rate0[:wid].sum() == 0                       # dedicated workers: their own rates only


def test_host_time_lends_the_serving_gpu_without_lengthening_serving_s_iterations():
    runs = {share: run_scenario(load_scenario("paper-8b", [
        *SMALL, "rl.steps=1", "sim.systems=[fixed-sync,rose]", f"serving.engine_host_share={share}"]))
        for share in (0.0, 1.0)}
    lent = {share: r.runs["rose"].tick_tokens[:, COSERVE].sum() for share, r in runs.items()}
    assert lent[1.0] > 2 * lent[0.0]
    assert runs[1.0].runs["rose"].mean_rollout_s < runs[0.0].runs["rose"].mean_rollout_s
    # Only what admission puts inside serving's iterations lengthens them: its TPOT budget.
    s, budget = runs[1.0].summary(), load_scenario("paper-8b").serving.executor.tpot_inflation
    assert s["serving_p99_tpot_ms"] <= s["serving_alone_p99_tpot_ms"] * (1 + budget)
    with pytest.raises(ValueError, match=r"serving\.engine_host_share must be between 0 and 1"):
        load_scenario("paper-8b", ["serving.engine_host_share=1.5"])


def test_bursts_cut_rollouts_and_lose_nothing():
    # Long rollout contexts fill the rollout budget of an 8 GB pool (a headroom of 28k tokens);
    # Mooncake's prompts of up to 12k tokens, prefilled within a tick, then burst into the serving
    # headroom: emergency cuts abort rollout turns, which resume elsewhere.
    sc = load_scenario("paper-8b", [*SMALL, "serving.trace=mooncake", "serving.load=0.5",
                                    "cluster.serving_gpus=4", "rl.steps=1", "rl.trajectories=512",
                                    "rl.response_median=3000", "rl.max_response=8192",
                                    "serving.executor.pool_mb=8000"])
    sim = Simulation(sc, SYSTEMS["rose"])
    in_burst, report = [], sim.dispatch.report

    def checked_report(t, free_slots):
        memory = sim.coserving.memory
        in_burst.extend(slots for wid, slots in free_slots
                        if memory.state(np.array([wid - sim.first_cs]))[0] == BurstState.BURST)
        report(t, free_slots)

    sim.dispatch.report = checked_report
    r = sim.run()
    assert r.bursts > 0 and r.aborted_turns > 0
    assert r.steps[0].trajectories == 512 and r.total_s > 0
    assert in_burst and not any(in_burst)                # no free slot while pages are taken back


def test_dapo_generates_more_trajectories_than_it_trains_on():
    sc = load_scenario("paper-32b", ["cluster.train_gpus=8", "cluster.serving_gpus=8", "rl.trajectories=256",
                                     "rl.steps=1", "sim.slice=1", "sim.tick_s=4", "rl.max_turns=6"])
    r = Simulation(sc, SYSTEMS["fixed-sync"]).run()
    assert r.steps[0].generated > r.steps[0].trajectories == 256


def test_serving_executors_report_every_tick_and_free_a_slot_per_finished_turn():
    """The real manager polls capacity every 0.25 s: a turn ending on a serving executor frees its
    slot before the trajectory's next turn is routed (else that turn loses its cached prefix)."""
    sim = Simulation(load_scenario("paper-8b", SMALL), SYSTEMS["rose"])
    d = sim.dispatch
    reports, ticks, freed = [0], [0], []
    report, advance, complete = d.report, d.advance, d.table.complete

    def counted_report(t, free_slots):
        reports[0] += 1
        report(t, free_slots)

    def checked_advance(rnd, t, view, plan, credit=True):
        ticks[0] += credit
        done: list = []
        d.table.complete = lambda wid, tid: done.append((wid, d.table.workers[wid].free_slots)) or \
            complete(wid, tid)
        out = advance(rnd, t, view, plan, credit)
        for wid in {w for w, _ in done if sim.workers.kind[w] == COSERVE}:
            before = min(f for w, f in done if w == wid)
            freed.append(d.table.workers[wid].free_slots - before == sum(w == wid for w, _ in done))
        return out

    d.report, d.advance = counted_report, checked_advance
    sim.run()
    assert reports[0] == ticks[0]
    assert freed and all(freed)


def test_serverless_functions_restart_cold_at_their_time_limit():
    """A function runs at most `serverless_max_run_s`: its turns resume elsewhere with their
    tokens and it starts cold again, which the allocation overhead counts."""
    base = [*SMALL, "sim.systems=[elastic-serverless]"]
    unlimited = Simulation(load_scenario("paper-8b", [*base, "elastic.serverless_max_run_s=1e9"]),
                           SYSTEMS["elastic-serverless"]).run()
    limited = Simulation(load_scenario("paper-8b", [*base, "elastic.serverless_max_run_s=60"]),
                         SYSTEMS["elastic-serverless"]).run()
    assert unlimited.aborted_turns == 0 and limited.aborted_turns > 0
    assert [s.generated_tokens for s in limited.steps] == [s.generated_tokens for s in unlimited.steps]
    assert limited.allocation_overhead > unlimited.allocation_overhead


def test_asynchronous_systems_on_shared_devices_overlap_training_within_the_bound() -> None:
    sc = load_scenario("cpu-bench-train", ["sim.systems=[fixed-sync,rose,fixed-async-shared,rose-async]"])
    runs = run_scenario(sc).runs
    rose, shared = runs["rose-async"], runs["fixed-async-shared"]
    for r in (rose, shared):
        assert [s.trajectories for s in r.steps] == [sc.rl.trajectories] * sc.rl.steps
        # Round k starts only once step k - 2's training has ended (staleness 1), and before
        # step k - 1's has: rollout and training overlap.
        for k in range(2, len(r.steps)):
            assert r.steps[k].start_s >= r.steps[k - 2].end_s - 1e-9
        assert any(r.steps[k].start_s < r.steps[k - 1].end_s for k in range(1, len(r.steps)))
        # Training has its devices: it takes its own time, and their rollouts pause meanwhile.
        for k, s in enumerate(r.steps):
            begin = s.end_s - s.train_s - s.sync_s
            assert begin >= s.start_s + s.rollout_s - 1e-9
            assert k == 0 or begin >= r.steps[k - 1].end_s - 1e-9
            during = (r.tick_t >= begin) & (r.tick_t < s.end_s - 1e-9)
            assert r.tick_tokens[during, DEDICATED].sum() == 0
            assert during.any() or k == len(r.steps) - 1   # the last step trains after every round
    # Borrowed serving capacity keeps rolling out while the trainer has core 0: faster than
    # synchronous ROSE; on core 0 alone the overlap only splits the core (no faster than fixed).
    assert rose.throughput > runs["rose"].throughput
    assert shared.throughput == pytest.approx(runs["fixed-sync"].throughput, rel=0.05)
