"""`cpu-bench-coserve` is `rose bench coserve` with its defaults: the same window of the trace at
the same rate and lengths, the same pool and backlog."""

from __future__ import annotations

import argparse

import numpy as np

from rose.bench import coserve as bench_coserve
from rose.coserve.loadgen import build_trace
from rose.sim.engine import Simulation
from rose.sim.scenarios import load_scenario
from rose.sim.systems import SYSTEMS


def _bench_defaults() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_coserve.add_arguments(p)
    return p.parse_args([])


def test_cpu_bench_coserve_is_the_benchmarks_window_pool_and_backlog():
    sc, args = load_scenario("cpu-bench-coserve"), _bench_defaults()
    s, rl = sc.serving, sc.rl
    assert (s.trace, s.load, s.replay_start_s, s.prompt_scale, s.max_context, s.max_output) == (
        "azure-conv", args.rate / 5.53, args.start, 0.125, 1024, 64)
    assert sc.sim.duration_s == 700.0          # the benchmark's default --duration
    assert s.executor.pool_mb == 512.0
    assert rl.fixed_concurrency == args.trajectories and rl.cap_counts == "trajectories"
    env, first = rl.env_profile(), bench_coserve.first_prompt(np.random.default_rng(0))
    assert (env.prompt_tokens, env.max_response) == (len(first), 64)
    assert not sc.cluster.trainer_rolls_out    # the benchmark's rollouts have the serving device alone


def test_the_replay_brings_the_benchmarks_requests_at_the_same_times():
    sc, args = load_scenario("cpu-bench-coserve"), _bench_defaults()
    expected = build_trace("azure-conv", 700.0, load=args.rate / 5.53, start_s=args.start, prompt_scale=0.125)
    fleet = Simulation(sc, SYSTEMS["rose"]).coserving.fleet
    fleet.arrivals_until(700.0)
    assert len(fleet.w_arr) == len(expected.arrival_s)
    assert np.allclose(fleet.w_arr, expected.arrival_s, atol=1e-6)
    assert (fleet.w_out == np.minimum(expected.output_tokens, 64)).all()
