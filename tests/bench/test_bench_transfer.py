"""`rose bench transfer` end to end on the tiny preset (real figures: --quick and the full run)."""

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
    assert summary["bit_exact"] is True
    weights = report["config"]["model_bytes_bf16"]
    assert summary["bytes_naive"] == 5 * weights  # a full copy to each of the five receiving processes
    assert weights < summary["bytes_shard_full"] < 1.05 * weights  # each slice once, plus headers
    assert 0 < summary["changed_fraction"] < 0.2 and summary["delta_bytes_ratio"] < 0.5
    # One party's thread is part of the process: its CPU time is within the sync's.
    assert 0 < summary["party_cpu_s_rose"] <= summary["cpu_s_rose"]
