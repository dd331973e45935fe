"""The rollout control plane (`rose.sim.control`): the driver's CPU a tick needs for the turns it
starts and the tokens the workers stream, and rollouts that slow where its cores fall short."""

from __future__ import annotations

import numpy as np
import pytest

from rose.sim.control import ControlPlane, deliveries
from rose.sim.costs import HTTP_PER_TURN, STREAM, ControlPlaneCost
from rose.sim.rollout import TickRates
from rose.sim.runner import run_scenario
from rose.sim.scenarios import load_scenario

# Round numbers to check by hand: a millisecond a turn, 0.1 ms a chunk, 10 ms a frame.
COST = ControlPlaneCost(turn_s=1e-3, chunk_s=1e-4, frame_s=1e-2, interval_s=0.05)
# paper-8b on 4 training and 8 serving GPUs, one short step, its serving engine stated: a second.
SMALL = ["cluster.train_gpus=4", "cluster.serving_gpus=8", "rl.trajectories=256", "rl.steps=1",
         "rl.response_median=300", "rl.max_response=1024", "sim.tick_s=2", "sim.slice=1",
         "serving.target_p99_tpot_ms=0", "serving.engine_overhead_ms=57.5", "sim.systems=[fixed-sync,rose]"]


def _plan() -> tuple[TickRates, np.ndarray, np.ndarray]:
    """A dedicated worker (10 ms iterations, 4 sequences decoding) and a serving executor (3
    decoding: all at 5 tokens/s in its host time, the first 2 also at 10 a second, the first also
    at 30), and each one's iteration time."""
    iter_s = np.array([0.010, 0.020])
    plan = TickRates(prefill_rate=np.array([1e4, 2e3]), rate0=np.array([0.0, 5.0]),
                     cap1=np.array([np.inf, 2.0]), rate1=np.array([100.0, 10.0]),
                     cap2=np.array([0.0, 1.0]), rate2=np.array([0.0, 30.0]))
    return plan, iter_s, np.array([4.0, 3.0])


def test_a_tick_needs_the_turns_it_starts_its_chunks_and_its_frames():
    plan, iter_s, dec = _plan()
    chunks, frames = deliveries(plan, dec, COST.interval_s)
    # A chunk per 50 ms from every sequence at 20 tokens/s or more, else one a token: the
    # dedicated worker's 4 at 100 tokens/s, the executor's at 45, 15 and 5.
    assert chunks.tolist() == [4 * 20.0, 20.0 + 15.0 + 5.0]
    # A frame per 50 ms from each worker: both iterate faster.
    assert frames.tolist() == [20.0, 20.0]
    control = ControlPlane(COST, cores=0.0, dt=2.0, on_dedicated=False)
    control.tick(plan, iter_s, dec, np.array([True, False]), placements=7)
    # 7 turns, 120 chunks a second and 40 frames a second for 2 s.
    assert control.demand_s == [pytest.approx(7 * 1e-3 + 240 * 1e-4 + 80 * 1e-2)]
    # Turns count from the last tick's plan; twice the dedicated worker's sequences stream twice
    # its chunks, in as many frames.
    control.tick(plan, iter_s, np.array([8.0, 3.0]), np.array([True, False]), placements=10)
    assert control.demand_s[1] == pytest.approx(3 * 1e-3 + (160 + 40) * 2 * 1e-4 + 80 * 1e-2)
    assert control.saturated == [False, False]              # unlimited
    assert plan.rate1.tolist() == [100.0, 10.0]


def test_a_sequence_slower_than_the_interval_sends_a_chunk_a_token_and_its_device_a_frame_an_iteration():
    plan = TickRates(prefill_rate=np.zeros(1), rate0=np.zeros(1), cap1=np.full(1, np.inf),
                     rate1=np.full(1, 8.0), cap2=np.zeros(1), rate2=np.zeros(1))
    chunks, frames = deliveries(plan, np.array([3.0]), 0.05)
    assert (chunks.tolist(), frames.tolist()) == ([24.0], [8.0])
    chunks, frames = deliveries(plan, np.array([0.0]), 0.05)       # nothing decoding, nothing sent
    assert (chunks.tolist(), frames.tolist()) == ([0.0], [0.0])


def test_a_driver_short_of_cores_scales_every_rate_of_the_tick():
    plan, iter_s, dec = _plan()
    control = ControlPlane(COST, cores=0.2, dt=2.0, on_dedicated=False)
    control.tick(plan, iter_s, dec, np.array([True, False]), placements=7)
    keep = 0.2 * 2.0 / (7 * 1e-3 + 240 * 1e-4 + 80 * 1e-2)
    assert control.saturated == [True]
    assert plan.prefill_rate.tolist() == pytest.approx([1e4 * keep, 2e3 * keep])
    assert plan.rate0.tolist() == pytest.approx([0.0, 5.0 * keep])
    assert plan.rate1.tolist() == pytest.approx([100.0 * keep, 10.0 * keep])
    assert plan.rate2.tolist() == pytest.approx([0.0, 30.0 * keep])
    assert plan.cap1.tolist() == [np.inf, 2.0]


def test_the_multiplexed_stream_costs_the_driver_less_than_a_stream_per_turn():
    plan, _, dec = _plan()
    chunks, frames = deliveries(plan, dec, STREAM.interval_s)
    stream, http = (cost.demand_s(1, chunks.sum(), frames.sum()) for cost in (STREAM, HTTP_PER_TURN))
    assert stream < http / 5


@pytest.mark.parametrize("model", ["turns", "batched"])
def test_an_unlimited_driver_leaves_the_results_as_they_were(model):
    # The figures of this run before the control plane was modelled, whichever the transport.
    before = {"turns": {"fixed-sync": (94.0, [438537.0, 0.0, 0.0]),
                        "rose": (60.0, [228313.935, 0.0, 210223.065])},
              "batched": {"fixed-sync": (100.0, [438537.0, 0.0, 0.0]),
                          "rose": (62.0, [210197.0, 0.0, 228344.018])}}[model]
    for transport in ("stream", "http"):
        r = run_scenario(load_scenario("paper-8b", [*SMALL, f"sim.rollout_model={model}",
                                                    f"control_plane.transport={transport}",
                                                    "control_plane.driver_cores=0"]))
        for name, (rollout_s, tokens) in before.items():
            run = r.runs[name]
            assert run.steps[0].rollout_s == rollout_s
            assert run.tick_tokens.sum(axis=0).tolist() == pytest.approx(tokens, abs=1e-3)
            assert run.driver_cores_peak > 0 and run.driver_saturated_share == 0


@pytest.mark.parametrize("model", ["turns", "batched"])
def test_a_saturated_control_plane_slows_the_rollout(model):
    # A stream per turn needs over a core for ROSE's 12 GPUs' turns here: half a core falls short.
    runs = {cores: run_scenario(load_scenario("paper-8b", [*SMALL, f"sim.rollout_model={model}",
                                                           "control_plane.transport=http",
                                                           f"control_plane.driver_cores={cores}"])).runs["rose"]
            for cores in (0, 0.5)}
    unlimited, short = runs[0], runs[0.5]
    assert unlimited.driver_cores_peak > 1.0 and unlimited.driver_saturated_share == 0
    assert short.driver_saturated_share > 0.3
    assert short.mean_rollout_s > 1.1 * unlimited.mean_rollout_s
    # The same work, later.
    assert short.tick_tokens.sum() == pytest.approx(unlimited.tick_tokens.sum(), rel=1e-4)


def test_the_summary_reports_the_driver_cores_each_system_needs():
    s = run_scenario(load_scenario("paper-8b", [*SMALL, "control_plane.transport=http",
                                                "control_plane.driver_cores=0.5"])).summary()
    assert (s["control_plane_transport"], s["driver_cores"]) == ("http", 0.5)
    need = s["driver_cores_needed"]
    assert set(need) == set(s["driver_saturated_share"]) == {"fixed-sync", "rose"}
    # ROSE streams from three times the GPUs.
    assert need["rose"]["peak"] >= need["rose"]["mean"] > need["fixed-sync"]["mean"] > 0


def test_a_sliced_scenario_has_its_share_of_the_driver_and_reports_the_whole_cluster_s_needs():
    whole = run_scenario(load_scenario("paper-8b", [*SMALL, "sim.systems=[fixed-sync]"])).runs["fixed-sync"]
    half = load_scenario("paper-8b", [*SMALL, "sim.systems=[fixed-sync]", "sim.slice=2",
                                      "control_plane.driver_cores=3"])
    assert half.sliced().control_plane.driver_cores == 1.5
    sliced = run_scenario(half).runs["fixed-sync"]
    assert sliced.driver_cores_mean == pytest.approx(whole.driver_cores_mean, rel=0.2)


def test_the_named_scenarios_state_their_driver():
    # The paper's manager is one Python process: one core. fleet-day's is sharded over 16. The
    # benchmarks' scenarios stream each turn, their driver unlimited or on the dedicated core.
    for name, cores in (("paper-8b", 1.0), ("paper-32b", 1.0), ("fleet-day", 16.0)):
        cp = load_scenario(name).control_plane
        assert (cp.transport, cp.driver_cores) == ("stream", cores), name
    for name in ("cpu-bench-train", "cpu-bench-burst", "cpu-bench-coserve"):
        cp = load_scenario(name).control_plane
        assert (cp.transport, cp.driver_cores) == ("http", 0.0), name
