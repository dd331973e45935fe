"""`rose bench transfer` end to end on the tiny preset, with and without `--lora` (real figures:
--quick and the full run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rose.cli import main

KEYS = {"changed_fraction", "delta_bytes_ratio", "bytes_naive", "bytes_rose", "sync_s_naive", "sync_s_rose",
        "speedup_vs_naive", "efficiency_vs_link", "encode_gb_per_s", "apply_gb_per_s", "bit_exact"}


def test_bench_transfer_reports_its_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "transfer.json"
    assert main(["bench", "transfer", "--preset", "tiny", "--relay", "local", "--steps", "1",
                 "--json", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    report = json.loads(out.read_text())
    assert summary.keys() >= KEYS and summary == report["summary"]
    assert summary["bit_exact"] is True and "lora" not in summary
    weights = report["config"]["model_bytes_bf16"]
    assert summary["bytes_naive"] == 5 * weights  # a full copy to each of the five receiving processes
    assert weights < summary["bytes_shard_full"] < 1.05 * weights  # each slice once, plus headers
    assert 0 < summary["changed_fraction"] < 0.2 and summary["delta_bytes_ratio"] < 0.5
    # One party's thread is part of the process: its CPU time is within the sync's.
    assert 0 < summary["party_cpu_s_rose"] <= summary["cpu_s_rose"]


def test_bench_transfer_lora_syncs_the_adapter_alone(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "transfer.json"
    assert main(["bench", "transfer", "--preset", "tiny", "--relay", "local", "--steps", "1", "--lora",
                 "--json", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lora, eight_b = summary["lora"], summary["lora_8b"]
    assert lora["bit_exact"] is True and lora["rank"] == 16
    # tiny: 2 layers, rank 16 on the seven projections of hidden 64, KV 32, MLP 128: 32768 elements.
    assert lora["adapter_bytes_bf16"] == 2 * 32768 < lora["bytes_first_adapter"] < lora["bytes_first_model"]
    assert lora["bytes_first_model"] > lora["model_bytes_bf16"] == json.loads(out.read_text())["config"][
        "model_bytes_bf16"]
    # Every element of the update changed, so the delta sync carried the full adapter.
    assert lora["step_changed_fraction_adapter"] == 1.0 and lora["step_sent_adapter"] == "full"
    assert lora["bytes_step_adapter"] == lora["bytes_first_adapter"]
    assert lora["bytes_step_model"] == summary["bytes_rose"] and lora["sync_s_first_adapter"] > 0
    # Llama-3.1-8B: 8.03 B parameters, 41.9 M in the rank-16 adapter (1.31 M per layer).
    assert (eight_b["model_params"], eight_b["adapter_params"]) == (8_030_261_248, 32 * 1_310_720)
    assert eight_b["adapter_bytes_bf16"] == 2 * eight_b["adapter_params"]
    assert eight_b["link_s_first_adapter"] == pytest.approx(eight_b["adapter_bytes_bf16"] * 8 / 20e9)
