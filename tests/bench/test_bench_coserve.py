"""`rose bench coserve`'s summaries across runs, its trade-off picture and its model flags (the
benchmark itself runs for an hour; docs/benchmarks.md has its figures)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from rose.bench import coserve
from rose.bench.coserve import (
    ENGINE_MODES,
    ENGINES,
    PROMPT_IDS,
    _across_runs,
    _modes,
    _ttft_added,
    plot_tradeoff,
)
from rose.bench.rollouts import ADAPTER_MODE, Rollouts, adapter_rollouts, second_model_pages
from rose.cli import main
from rose.coserve.loadgen import RequestResult
from rose.engine import KVSpec
from rose.model import load_model
from rose.model.lora import load_adapter


def _summary(k: float) -> dict:
    mode = {"p99_ttft_ms": 100.0 * k, "p99_tpot_ms": 30.0 * k, "slo_attainment": 1.0,
            "rollout_tokens_per_s": 90.0, "completed": 214, "ttft_vs_alone": k, "tpot_vs_alone": k,
            "harvest_ratio": 0.7 * k}
    return {"slo": {"ttft_ms": 150.0, "tpot_ms": 45.0}, "idle_fraction_serving_alone": 0.68,
            "serving_alone": {"p99_ttft_ms": 100.0, "p99_tpot_ms": 30.0, "slo_attainment": 1.0,
                              "rollout_tokens_per_s": None},
            "naive_share": {**mode, "tpot_vs_alone": 4.0 * k}, "rose": mode, "rose_q0.5": mode,
            "harvest_ratio": 0.7 * k, "admission_quantile": 0.95}


def test_figures_across_runs_are_median_and_spread() -> None:
    out = _across_runs([_summary(1.0), _summary(1.2), _summary(0.9)])
    assert out["rose"]["tpot_vs_alone"] == {"median": 1.0, "min": 0.9, "max": 1.2}
    assert out["harvest_ratio"]["median"] == 0.7
    assert "rollout_tokens_per_s" not in out["serving_alone"]     # None in every run: no figure
    assert len(out["slo"]) == 3


def test_tradeoff_picture_is_written(tmp_path: Path) -> None:
    path = tmp_path / "tradeoff.png"
    plot_tradeoff([_summary(1.0), _summary(1.1)], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ttft_added_pairs_each_request_with_itself_serving_alone() -> None:
    alone = [RequestResult(float(i), prompt_tokens=10 * (i + 1), ttft_s=0.1) for i in range(20)]
    beside = [RequestResult(float(i), prompt_tokens=10 * (i + 1), ttft_s=0.1 + 0.001 * i) for i in range(20)]
    beside[3].ttft_s = None  # failed: not paired
    added = _ttft_added(alone, beside)
    deltas = [float(i) for i in range(20) if i != 3]
    assert added["ttft_added_mean_ms"] == pytest.approx(sum(deltas) / len(deltas), abs=0.01)
    assert added["ttft_added_long_ms"] == pytest.approx(18.5, abs=0.01)  # the two longest prompts
    assert added["ttft_added_p90_ms"] == pytest.approx(float(np.percentile(deltas, 90)), abs=0.01)
    assert _ttft_added(alone[:1], [RequestResult(0.0, 10)]) == {}


def test_model_flags_are_checked_before_anything_starts(tiny_qwen2: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    cores = os.sched_getaffinity(0)
    assert main(["bench", "coserve", "--quick", "--serving-model", str(tmp_path)]) == 2
    assert f"--serving-model: {tmp_path}: no config.json" in capsys.readouterr().err
    # A vocabulary that lacks the token ids the trace replay and the rollout backlog draw.
    small = tmp_path / "small-vocab"
    small.mkdir()
    (small / "config.json").write_text(json.dumps(
        {**json.loads((tiny_qwen2 / "config.json").read_text()), "vocab_size": PROMPT_IDS[1] - 1}))
    assert main(["bench", "coserve", "--quick", "--serving-model", str(tiny_qwen2),
                 "--rollout-model", str(small)]) == 2
    assert f"--rollout-model {small}: a vocabulary of {PROMPT_IDS[1] - 1} tokens" in capsys.readouterr().err
    assert os.sched_getaffinity(0) == cores  # refused before the benchmark pinned itself


@pytest.mark.parametrize("bench", ["coserve", "soak"])
def test_device_flags_are_checked_before_anything_starts(bench: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    cores = os.sched_getaffinity(0)
    assert main(["bench", bench, "--quick", "--device", "tpu"]) == 2
    assert "--device/--dtype: device 'tpu'" in capsys.readouterr().err
    assert os.sched_getaffinity(0) == cores


def test_device_flags_reach_the_servers_a_benchmark_starts() -> None:
    import argparse

    from rose.bench import serve_device_args

    assert serve_device_args(argparse.Namespace(device=None, dtype=None)) == ()
    assert serve_device_args(argparse.Namespace(device="cpu", dtype="bfloat16")) == (
        "--device", "cpu", "--dtype", "bfloat16")


def _args(*argv: str) -> argparse.Namespace:
    from rose.cli import parser_for

    return parser_for(["bench", "coserve", *argv]).parse_args(["bench", "coserve", *argv])


def test_engine_option_picks_each_engine_s_modes() -> None:
    native, vllm = _args(), _args("--engine", "vllm", "--sweep-quantile", "0.5")
    assert (native.engine, vllm.engine, vllm.serving_pool_share) == ("native", "vllm", 0.25)
    assert ENGINES == {"native": ("native",), "vllm": ("vllm", "native")}  # vLLM's table beside the native
    # (mode, server policy, seconds): the baselines run the baseline window, rose the full one.
    assert [m[:3] for m in _modes(native, "native", 700.0, 200.0)] == [
        ("rollout_alone", "rose", 200.0), ("naive_share", "naive", 200.0),
        ("static_partition", "static", 200.0), ("rose", "rose", 700.0)]
    assert [m[:3] for m in _modes(vllm, "vllm", 700.0, 200.0)] == [
        ("rollout_alone", "rose", 200.0), ("naive_share", "naive", 200.0), ("priority", "priority", 200.0),
        ("rose", "rose", 700.0), ("rose_q0.5", "rose", 700.0)]
    assert ENGINE_MODES["vllm"][0] == ENGINE_MODES["native"][0] == "serving_alone"  # it sets the SLO
    with pytest.raises(SystemExit):
        _args("--engine", "sglang")


def test_engine_vllm_is_checked_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    cores = os.sched_getaffinity(0)
    assert main(["bench", "coserve", "--quick", "--engine", "vllm", "--serving-pool-share", "1.5"]) == 2
    assert "--serving-pool-share must be in (0, 1), got 1.5" in capsys.readouterr().err
    if importlib.util.find_spec("vllm") is None:
        assert main(["bench", "coserve", "--quick", "--engine", "vllm"]) == 2
        assert "--engine vllm: vllm is not installed in this Python" in capsys.readouterr().err
    assert os.sched_getaffinity(0) == cores


def test_summary_gives_harvest_against_idle_capacity_and_naive_sharing() -> None:
    def mode(busy: float, tokens: float | None, ttft: float | None = 100.0,
             tpot: float | None = 30.0) -> dict:
        return {"serving_busy_fraction": busy, "rollout_tokens_per_s": tokens, "p99_ttft_ms": ttft,
                "p99_tpot_ms": tpot, "slo_attainment": 1.0, "completed": 10, "latency_model_error": 0.1,
                "admission_overruns": 2.0}

    results = {"serving_alone": mode(0.4, None), "rollout_alone": mode(0.0, 200.0, None, None),
               "naive_share": mode(0.4, 150.0, 300.0, 90.0), "priority": mode(0.4, 160.0, 200.0, 60.0),
               "rose": mode(0.4, 100.0, 102.0, 31.0)}
    summary = coserve._summary(results, {"ttft_ms": 150.0, "tpot_ms": 45.0}, {}, 0.95)
    assert summary["rose"]["harvest_ratio"] == pytest.approx(100.0 / (0.6 * 200.0), abs=1e-3)
    assert summary["rose"]["harvest_vs_naive"] == pytest.approx(100.0 / 150.0, abs=1e-3)
    assert summary["priority"]["tpot_vs_alone"] == 2.0 and summary["rose"]["ttft_vs_alone"] == 1.02
    assert (summary["harvest_ratio"], summary["harvest_vs_naive"]) == (summary["rose"]["harvest_ratio"],
                                                                       summary["rose"]["harvest_vs_naive"])


def test_a_vllm_run_has_a_table_per_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def engine_run(args: argparse.Namespace, engine: str, modes: list, *rest: object) -> dict:
        seen.append((engine, [m[0] for m in modes]))
        return {"summary": {"engine_was": engine}, "modes": {"rose": {}}}

    monkeypatch.setattr(coserve, "_engine_run", engine_run)
    out = coserve._one_run(_args("--engine", "vllm", "--quick"), Path("s"), Path("r"), None, ())
    assert seen == [("vllm", ["rollout_alone", "naive_share", "priority", "rose"]),
                    ("native", ["rollout_alone", "naive_share", "static_partition", "rose"])]
    assert out["summary"] == {"engine": "vllm", "vllm": {"engine_was": "vllm"},
                              "native": {"engine_was": "native"}}
    assert set(out["modes"]) == {"vllm", "native"}
    seen.clear()
    native = coserve._one_run(_args("--quick"), Path("s"), Path("r"), None, ())
    assert native["summary"] == {"engine_was": "native"}  # one engine: its summary as it always was


def test_rollout_adapter_runs_the_adapter_as_a_second_model_and_riding_serving(tiny_qwen2: Path,
                                                                               tmp_path: Path) -> None:
    args = _args("--rollout", "adapter", "--lora-rank", "4")
    assert [m[:3] for m in _modes(args, "native", 700.0, 200.0)] == [
        ("rollout_alone", "rose", 200.0), ("rose", "rose", 700.0), (ADAPTER_MODE, "rose", 700.0)]
    rollouts = adapter_rollouts(tiny_qwen2, tmp_path / "adapter", 4)
    adapter = ("--rollout-adapter", str(tmp_path / "adapter"), "--rollout-adapter-name", "policy")
    assert rollouts.server_args("rose") == ("--rollout-model", str(tiny_qwen2), *adapter)
    assert rollouts.server_args(ADAPTER_MODE) == adapter and rollouts.turn_adapter == "policy"
    assert Rollouts(tiny_qwen2).server_args("rose") == ("--rollout-model", str(tiny_qwen2))
    assert load_adapter(tmp_path / "adapter")[2] == str(tiny_qwen2)  # an adapter of the serving model
    freed = second_model_pages(tiny_qwen2, 4, torch.float32)
    model = load_model(tiny_qwen2)
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert freed["weights_mb"] == round(weights / 2**20, 1) and 0 < freed["kv_pages_given_back"] < (
        weights // KVSpec.of(model.config).block_bytes)
    refusals = ((("--engine", "vllm"), "--engine native"), (("--rollout-model", "r"), "--rollout-model"),
                (("--lora-rank", "0"), "--lora-rank"))
    for argv, named in refusals:
        with pytest.raises(ValueError, match=named):
            coserve.check_rollout(_args("--rollout", "adapter", *argv))


def test_summary_compares_adapter_mode_with_two_models() -> None:
    def mode(tokens: float | None) -> dict:
        return {"serving_busy_fraction": 0.4, "rollout_tokens_per_s": tokens, "p99_ttft_ms": 100.0,
                "p99_tpot_ms": 30.0, "slo_attainment": 1.0, "completed": 10, "latency_model_error": 0.1,
                "admission_overruns": 0.0, "rollout_tokens_beside_serving": 50.0}

    results = {"serving_alone": mode(None), "rollout_alone": mode(200.0), "rose": mode(80.0),
               ADAPTER_MODE: mode(120.0)}
    summary = coserve._summary(results, {"ttft_ms": 150.0, "tpot_ms": 45.0}, {}, 0.95)
    assert summary["adapter_vs_two_models"] == 1.5 and summary["rose"]["harvest_vs_naive"] is None
    assert summary[ADAPTER_MODE]["rollout_tokens_beside_serving"] == 50.0
