"""`rose bench coserve --burst`: the window around the trace's spike, the figures it computes from
what it measured, its plot, and a short run on tiny models (about 30 s) that must cut rollout
turns and hand them back."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rose.bench import burst
from rose.bench.coserve import bench_server
from rose.bench.rollouts import ADAPTER_MODE, Rollouts, adapter_rollouts
from rose.cli import main
from rose.coserve.loadgen import RequestResult, kv_tokens
from rose.coserve.metrics import ExecutorMetrics, read_pool_sample, transitions
from rose.traces import load_trace


def test_window_is_the_scaled_traces_spike_placed_lead_s_in() -> None:
    scale = burst.Scale()
    w = burst.burst_window(scale, duration_s=90.0, spike_s=20.0, lead_s=20.0)
    assert w.spike == (20.0, 40.0)
    trace = w.trace()
    tokens = kv_tokens(trace, scale.max_context, scale.max_output)
    inside = np.array([w.inside(t) for t in trace.arrival_s])
    assert inside.sum() == w.spike_requests and tokens[inside].sum() == w.spike_kv_tokens
    # The spike: several times the trace's mean KV arrival, and no other 20 s of the window more.
    assert w.spike_kv_tokens > 3 * w.mean_kv_tokens_per_s * 20.0
    for lo in np.arange(0.0, 70.0, 1.0):
        span = (trace.arrival_s >= lo) & (trace.arrival_s < lo + 20.0)
        assert tokens[span].sum() <= w.spike_kv_tokens
    # Scaled as asked: the trace's rate times `load`, prompts times `prompt_scale`.
    full = load_trace(scale.trace)
    at = (w.start_s + trace.arrival_s) * scale.load  # in the trace's own time (its first period here)
    index = np.searchsorted(full.arrival_s, at - 1e-6)
    np.testing.assert_allclose(full.arrival_s[index], at, atol=1e-6)
    scaled = np.maximum(1, np.rint(full.prompt_tokens[index] * scale.prompt_scale))
    np.testing.assert_array_equal(trace.prompt_tokens, scaled)
    assert kv_tokens(trace, scale.max_context, scale.max_output).max() <= scale.max_context
    with pytest.raises(ValueError, match="inside the 30 s window"):
        burst.burst_window(scale, duration_s=30.0, spike_s=20.0, lead_s=20.0)


def test_window_figures_split_requests_at_the_spike() -> None:
    w = burst.BurstWindow(burst.Scale(), 0.0, 60.0, (20.0, 40.0), 2, 100, 1.0)
    fast = [RequestResult(float(t), 10, 8, 0.1, 0.1 + 7 * 0.02) for t in (1.0, 50.0, 55.0)]
    slow = [RequestResult(float(t), 10, 8, 2.0, 2.0 + 7 * 0.5) for t in (21.0, 30.0)]
    out = burst.window_figures(fast + slow, w, {"ttft_ms": 1000.0, "tpot_ms": 100.0})
    assert out["inside"]["requests"] == 2 and out["outside"]["requests"] == 3
    assert out["inside"]["p99_ttft_ms"] == pytest.approx(2000.0)
    assert out["inside"]["p99_tpot_ms"] == pytest.approx(500.0)
    assert out["inside"]["slo_attainment"] == 0.0 and out["outside"]["slo_attainment"] == 1.0


def _scrape(**set_: float) -> str:
    m = ExecutorMetrics(("serving", "rollout"))
    m.set_model_name("s")
    m.pool_pages.labels("serving").set(set_.get("serving", 0))
    m.pool_pages.labels("rollout").set(set_.get("rollout", 0))
    m.rollout_tokens.inc(set_.get("tokens", 0))
    if "trigger" in set_:
        m.transition_time.labels("normal", "burst").set(set_["trigger"])
    if "frozen" in set_:
        m.transition_time.labels("burst", "frozen").set(set_["frozen"])
    if "normal" in set_:
        m.transition_time.labels("frozen", "normal").set(set_["normal"])
    for seconds, iterations in set_.get("reclaims", ()):
        m.reclaim_seconds.observe(seconds)
        m.reclaim_iterations.observe(iterations)
    return m.expose().decode()


def test_a_scrape_gives_the_timelines_columns_and_the_reclaim_histograms() -> None:
    sample = read_pool_sample(_scrape(serving=12, rollout=30, tokens=7, trigger=1000.5))
    assert (sample["serving_pages"], sample["rollout_pages"], sample["rollout_tokens"]) == (12, 30, 7)
    assert sample["normal_to_burst"] == 1000.5 and sample["burst_to_frozen"] == 0.0
    text = _scrape(reclaims=[(0.0002, 0), (0.0003, 0), (0.003, 1)])
    iterations = burst.histogram(text, "rose:burst_reclaim_iterations")
    assert iterations == {"count": 3, "mean": pytest.approx(1 / 3), "max_at_most": 1.0}
    seconds = burst.histogram(text, "rose:burst_reclaim_seconds")
    assert seconds["max_at_most"] == 0.005 and seconds["mean"] == pytest.approx(0.0035 / 3)
    assert burst.histogram(_scrape(), "rose:burst_reclaim_seconds")["count"] == 0


def test_the_bursts_course_and_harvest_from_the_timeline() -> None:
    wall0 = 1000.0
    samples = [{"t": float(t), **read_pool_sample(_scrape(
        tokens=10 * t if t < 20 or t >= 35 else 200 + (t - 20),
        **({"trigger": wall0 + 20.25} if t >= 21 else {}),
        **({"frozen": wall0 + 24.0} if t >= 25 else {}),
        **({"normal": wall0 + 35.0} if t >= 36 else {})))} for t in range(60)]
    events = transitions(samples, wall0)
    assert events == [(20.25, "normal", "burst"), (24.0, "burst", "frozen"), (35.0, "frozen", "normal")]
    course = burst.burst_figures(events, [{"t": 35.0}])
    assert course["bursts"] == 1 and course["trigger_s"] == 20.25
    assert course["burst_state_s"] == 3.75 and course["freeze_s"] == 11.0
    assert course["trigger_to_next_step_s"] == 14.75
    before, during, after = burst.harvest(samples, [0.0, 20.0, 35.0, 59.0])
    assert before == pytest.approx(10.0) and during == pytest.approx(150.0 / 15.0, rel=0.1)
    assert after == pytest.approx(10.0)
    assert burst.burst_figures([], [])["bursts"] == 0


def _report() -> dict:
    samples = [{"t": t / 10, **read_pool_sample(_scrape(serving=t % 40, rollout=100 - t % 40))}
               for t in range(300)]
    events = [(10.0, "normal", "burst"), (20.0, "frozen", "normal")]
    mode = {"timeline": {"samples": samples, "events": events}, "pool_pages": 128.0}
    requests = [{"scheduled_s": float(t), "ttft_s": 0.1 * (1 + t % 3), "tpot_s": 0.02 if t % 4 else None}
                for t in range(30)]
    modes = burst.ENGINE_MODES["native"]
    return {"modes": dict.fromkeys(modes, mode), "requests": dict.fromkeys(modes, requests),
            "summary": {"window": {"spike_s": [8.0, 18.0]}, "slo": {"ttft_ms": 500.0, "tpot_ms": 50.0},
                        "pool": {"watermark_pages": 115.2}}}


def test_the_window_is_plotted(tmp_path: Path) -> None:
    path = tmp_path / "burst.png"
    burst.plot_burst(_report(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flags_that_do_not_apply_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "coserve", "--burst", "--sweep-quantile", "0.9"]) == 2
    assert "--sweep-quantile does not apply to --burst" in capsys.readouterr().err
    assert main(["bench", "coserve", "--burst", "--modes", "naive_share,priority"]) == 2
    assert "priority: not a mode of --engine native" in capsys.readouterr().err
    assert main(["bench", "coserve", "--burst", "--modes", "naive_share"]) == 2
    assert "include rose" in capsys.readouterr().err
    assert main(["bench", "coserve", "--burst", "--runs", "0"]) == 2
    assert "--runs must be >= 1" in capsys.readouterr().err


def test_runs_give_each_runs_figures_their_medians_and_the_worst() -> None:
    def run(attainment: float, ttft: float, tpot: float) -> dict[str, Any]:
        inside = {"slo_attainment": attainment, "ttft_vs_alone": ttft, "tpot_vs_alone": tpot}
        return {"rose": {"inside": inside, "outside": {"slo_attainment": 1.0}}, "slo": {"ttft_ms": 600.0}}

    summaries = [run(1.0, 1.02, 1.1), run(1.0, 1.08, 1.0), run(0.95, 0.9, 1.0), run(1.0, 1.01, 1.2)]
    assert burst.worst_run(summaries) == 2  # attainment first
    assert burst.worst_run([summaries[i] for i in (0, 1, 3)]) == 1  # then TTFT inside
    median = burst.median_summary(summaries)
    assert median["rose"]["inside"] == {"slo_attainment": 1.0, "ttft_vs_alone": 1.015, "tpot_vs_alone": 1.05}
    assert median["slo"] == {"ttft_ms": 600.0}


@pytest.mark.parametrize("mode", ["rose", ADAPTER_MODE])
def test_a_spike_cuts_rollout_turns_which_come_back_with_their_tokens(
        mode: str, tiny_qwen2: Path, tiny_qwen3: Path, tmp_path: Path) -> None:
    """Tiny models on a pool of 128 pages: the trace's spike (its rate and prompts scaled up, long
    outputs) needs the pages rollouts hold; the burst cuts turns, hands them back with their tokens,
    and their trajectories finish them after the next RL step. The server traces its iterations.
    In adapter mode the turns are the serving engine's own guests, their pages in its pool."""
    scale = burst.Scale(load=0.5, prompt_scale=0.25, max_output=200, max_context=512)
    window = burst.burst_window(scale, duration_s=24.0, spike_s=4.0, lead_s=8.0)
    args = argparse.Namespace(trajectories=8, next_step_s=6.0, engine="native", rollout="model")
    rollouts = Rollouts(tiny_qwen3)
    if mode == ADAPTER_MODE:
        args.rollout, rollouts = "adapter", adapter_rollouts(tiny_qwen2, tmp_path / "adapter", 4)
    slo = {"ttft_ms": 1e6, "tpot_ms": 1e6}
    log = tmp_path / "iterations.jsonl"
    extra = ("--pool-mb", "0.5", "--chunk-tokens", "64", "--no-profile", "--iteration-log", str(log))
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(bench_server(tiny_qwen2, rollouts, mode, "rose", slo, None, extra))
        result, requests = asyncio.run(burst._measure(url, mode, window, args, slo, rollouts.turn_adapter))
    assert result["bursts"] >= 1 and result["burst_cuts"] >= 1
    assert result["rollout_turns_cut"] >= 1 and result["rollout_pages_cut"] > 0
    assert result["reclaim_iterations"]["max_at_most"] <= 1.0
    back = result["hand_back"]
    assert back["handed_back_with_tokens"] >= 1 and back["partial_tokens"] > 0
    assert back["resumed_finished"] >= 1 and back["lost"] == 0
    assert result["errors"] == 0 and len(requests) == result["requests"]
    iterations = [json.loads(line) for line in log.read_text().splitlines()]
    cuts = [r for r in iterations if r["cut"]]
    assert cuts and all(r["state"] == "burst" and r["pages"]["rollout"] <= r["pages"]["budget"] for r in cuts)
    assert sum(r["cut"] for r in iterations) == result["rollout_turns_cut"]
    first = iterations[0]["i"]
    assert [r["i"] for r in iterations] == list(range(first, first + len(iterations)))  # each one
