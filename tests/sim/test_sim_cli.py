"""`rose simulate`: list, a small scenario with JSON and PNG, clear errors."""

from __future__ import annotations

import json

from rose.cli import main

SMALL = ["cluster.train_gpus=4", "cluster.serving_gpus=4", "rl.trajectories=128", "rl.steps=1",
         "rl.response_median=200", "rl.max_response=512", "sim.slice=1",
         "sim.systems=[fixed-sync,elastic-spot,rose,naive-share]"]


def test_list(capsys):
    assert main(["simulate", "--list"]) == 0
    out = capsys.readouterr().out
    assert "paper-8b" in out and "paper-32b" in out and "sweep-bandwidth" in out


def test_scenario_writes_json_and_plot_and_prints_the_summary_last(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["simulate", "--scenario", "paper-8b", "--json", str(out), "--plot", str(png), *SMALL]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    for key in ("throughput_vs_fixed_sync", "throughput_vs_fixed_async", "rollout_speedup_vs_elastic_spot",
                "rollout_speedup_vs_elastic_serverless", "allocation_overhead", "serving_p99_ttft_ms",
                "serving_p99_tpot_ms", "slo_violations", "naive_share_slo_violations", "sim_wall_s"):
        assert key in summary
    data = json.loads(out.read_text())
    assert data["summary"] == summary and set(data["systems"]) == {"fixed-sync", "elastic-spot", "rose",
                                                                   "naive-share"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_override_is_a_one_line_error(capsys):
    assert main(["simulate", "--scenario", "paper-8b", "rl.nope=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rose simulate: error:") and "nope" in err and "\n" not in err


def test_missing_scenario(capsys):
    assert main(["simulate"]) == 2
    assert "--scenario" in capsys.readouterr().err


def test_sweep_plot_from_summaries(tmp_path):
    from rose.sim.plots import plot_sweep
    from rose.sim.runner import SweepResult
    from rose.sim.scenarios import SWEEPS

    sweep = SWEEPS["sweep-load"]
    points = [(v, {"throughput_vs_fixed_sync": 1.2, "throughput_vs_fixed_sync_by_system": {"rose": 1.2},
                   "slo_violations": 0, "serving_alone_slo_violations": 0,
                   "allocation_overhead": {"rose": 0.001}}) for v in sweep.values]
    res = SweepResult(sweep, points, 1.0)
    assert res.summary()["values"] == list(sweep.values)
    plot_sweep(res, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
