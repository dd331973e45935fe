"""The simulator's burst model against `rose bench coserve --burst`: the `cpu-bench-burst`
scenario replays the benchmark's own window and backlog, and its burst state machine cuts
rollouts where serving's spike needs their pages."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from rose.bench import coserve as bench_coserve
from rose.bench.burst import TURN_TOKENS, Scale, burst_window
from rose.sim.coserving import CoServing
from rose.sim.engine import Simulation
from rose.sim.rollout import DECODE, Round
from rose.sim.runner import run_scenario
from rose.sim.scenarios import load_scenario
from rose.sim.systems import SYSTEMS
from rose.sim.workloads import ENVS, RoundDemand


def _bench_defaults() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_coserve.add_arguments(p)
    return p.parse_args(["--burst"])


def test_cpu_bench_burst_is_the_benchmarks_window_pool_and_backlog():
    sc, args = load_scenario("cpu-bench-burst"), _bench_defaults()
    s, e, rl = sc.serving, sc.serving.executor, sc.rl
    scale = Scale(load=args.rate / 5.53)
    assert (s.trace, s.load, s.prompt_scale, s.output_scale, s.max_output, s.max_context) == (
        scale.trace, scale.load, scale.prompt_scale, 1.0, scale.max_output, scale.max_context)
    assert (sc.sim.duration_s, s.spike_s, s.spike_at_s) == (90.0, args.spike_s, args.lead_s)
    assert (e.pool_mb, rl.step_after_burst_s, rl.trajectories) == (
        args.burst_pool_mb, args.next_step_s, args.trajectories)
    env = rl.env_profile()
    first = bench_coserve.first_prompt(np.random.default_rng(0))
    assert (env.prompt_tokens, env.response_median, env.max_response) == (
        len(first), TURN_TOKENS, TURN_TOKENS)
    assert not sc.cluster.trainer_rolls_out  # the benchmark's rollouts have the serving device alone


def test_the_replay_brings_the_benchmarks_spike_requests_at_the_same_time():
    sc = load_scenario("cpu-bench-burst")
    window = burst_window(Scale(), 90.0, 20.0, 20.0)
    expected = window.trace()
    fleet = Simulation(sc, SYSTEMS["rose"]).coserving.fleet
    fleet.arrivals_until(90.0)
    inside = (fleet.w_arr >= 20.0) & (fleet.w_arr < 40.0)
    assert inside.sum() == window.spike_requests == 20
    # The same requests at the same times (lengths as replayed: prompts clipped within the context).
    mine = np.flatnonzero(inside)
    theirs = np.flatnonzero((expected.arrival_s >= 20.0) & (expected.arrival_s < 40.0))
    assert np.allclose(fleet.w_arr[mine], expected.arrival_s[theirs], atol=1e-6)
    assert (fleet.w_out[mine] == np.minimum(expected.output_tokens[theirs], 64)).all()


def test_a_chunk_being_prefilled_holds_its_pages_before_it_is_computed():
    cs: CoServing = Simulation(load_scenario("cpu-bench-burst"), SYSTEMS["rose"]).coserving
    fleet = cs.fleet
    fleet.arrivals_until(21.0)  # the spike's first long prompts are waiting, none prefilled
    waiting = fleet.prefill_backlog()[0]
    assert waiting > 0 and fleet.kv_tokens()[0] == 0
    assert fleet.allocated_tokens()[0] == min(waiting, cs.chunk)


def test_rollouts_on_a_serving_device_shrink_to_a_cut_budget_by_the_next_tick():
    # An engine preempts its latest running sequence when the pages within its budget run out:
    # what held pages beyond a budget that shrank no longer runs.
    env = ENVS["coserve-backlog"]
    demand = RoundDemand(env, np.full((3, env.max_turns), 64), np.full(3, env.max_turns), 1)
    rnd = Round(demand, 0.0, 0)
    rows = np.arange(3)
    rnd.start(rows, np.zeros(3, int), np.zeros(3, bool))
    rnd.phase[:], rnd.ctx[:] = DECODE, 400.0  # 400 tokens each
    cap, seqs = np.array([1200.0]), np.array([16])
    assert rnd.active_view(cap, seqs).fits.all()
    view = rnd.active_view(np.array([900.0]), seqs)
    assert view.fits.sum() == 2 and view.kv[view.fits].sum() <= 900


@pytest.fixture(scope="module")
def burst_run():
    return run_scenario(load_scenario("cpu-bench-burst"))


def test_the_spike_triggers_a_burst_that_cuts_rollouts_and_spares_serving(burst_run):
    spike = burst_run.summary()["spike"]
    rose, naive = spike["rose"], spike["naive-share"]
    # The spike (20-40 s into the window) needs the rollouts' pages: a burst inside it.
    assert rose["bursts"] >= 1 and 20.0 <= rose["first_trigger_s"] < 40.0
    assert rose["rollout_turns_cut"] > 0 and rose["rollout_mb_cut"] > 0
    assert burst_run.runs["rose"].aborted_turns == rose["rollout_turns_cut"]
    # The freeze until the next RL step: less harvested from the trigger to it than before.
    harvest = rose["harvest_tokens_per_s"]
    assert harvest["until_next_step"] < harvest["before_trigger"]
    # Serving inside the spike: ROSE within its SLOs, naive sharing not.
    assert rose["inside"]["slo_attainment"] == 1.0 > naive["inside"]["slo_attainment"]
    assert rose["inside"]["tpot_vs_alone"] < naive["inside"]["tpot_vs_alone"]


def test_a_static_split_adds_its_fixed_rollout_tokens_to_every_serving_iteration(burst_run):
    # Half the pool and 64 rollout tokens an iteration whatever serving needs: serving's TPOT pays
    # for them inside the spike and out, where ROSE's admission holds rollouts back.
    spike = burst_run.summary()["spike"]
    static, rose = spike["static-split"], spike["rose"]
    for part in ("inside", "outside"):
        assert static[part]["tpot_vs_alone"] > 1.5 * rose[part]["tpot_vs_alone"]
    assert static["inside"]["slo_attainment"] < 1.0 == rose["inside"]["slo_attainment"]
    assert static["bursts"] == 0                   # no burst control: its budget never moves


def test_a_run_cut_short_at_its_duration_counts_the_step_it_was_in(burst_run):
    for r in burst_run.runs.values():
        assert r.total_s == pytest.approx(90.0)
        assert len(r.steps) == 1 and r.steps[0].trajectories == 0  # it trained nothing
        assert r.tick_t.max() < 90.0
