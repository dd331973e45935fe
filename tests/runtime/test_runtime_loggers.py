"""The step loggers (rose.runtime.loggers): metrics.jsonl is written and flushed step by step (a
killed `rose train` keeps its finished steps), TensorBoard's own reader reads the scalars, and
`train.logger` is checked before anything starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rose.runtime import loggers
from rose.runtime.config import load_config
from rose.runtime.loggers import METRICS_FILE, JsonlLogger, Loggers, TensorBoardLogger, scalars


def record(step: int) -> dict:
    """A step record as `TrainStep.record()` gives it (the keys the loggers read)."""
    return {"step": step, "version": step + 1, "success_rate": 0.5, "heldout_success": None,
            "restarts": ["dedicated-0 restarted at version 1"], "sync_bytes": 1024,
            "trainer": {"loss": 0.1 * step, "kl": 0.01, "lr": 3e-3, "reward_mean": 0.25},
            "serving": {"slo_attainment": 0.9, "p99_ttft_ms": None}}


def test_scalars_are_the_records_numbers_nested_ones_by_path() -> None:
    assert scalars(record(2)) == {"step": 2.0, "version": 3.0, "success_rate": 0.5, "sync_bytes": 1024.0,
                                  "trainer/loss": pytest.approx(0.2), "trainer/kl": 0.01, "trainer/lr": 3e-3,
                                  "trainer/reward_mean": 0.25, "serving/slo_attainment": 0.9}


def test_jsonl_logger_flushes_each_record_as_it_is_logged(tmp_path: Path) -> None:
    path = tmp_path / "run" / METRICS_FILE
    logger = JsonlLogger(path)
    for step in range(3):
        logger.log(record(step))
        # Read by another handle while the logger is still open: the line is complete already.
        assert [json.loads(line) for line in path.read_text().splitlines()] == [record(s) for s in
                                                                                range(step + 1)]
    logger.close()


def test_jsonl_logger_keeps_a_resumed_runs_earlier_steps(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text("".join(json.dumps(record(s)) + "\n" for s in range(4)) + '{"step": 4, "los')  # torn
    logger = JsonlLogger(path, first_step=2)  # resumed from step-2: steps 2 and 3 run again
    logger.log(record(2))
    logger.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    JsonlLogger(path).close()  # a fresh run into the same out_dir starts the file afresh
    assert path.read_text() == ""


def test_tensorboard_reads_the_runs_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path)
    for step in range(3):
        logger.log(record(step))
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {"trainer/loss", "trainer/kl", "serving/slo_attainment", "success_rate"} <= set(
        events.Tags()["scalars"])
    loss = events.Scalars("trainer/loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [e.value for e in loss] == pytest.approx([0.0, 0.1, 0.2])


def test_loggers_follow_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = load_config(None, [f"train.out_dir={tmp_path}", "train.logger=[jsonl]"])
    run = Loggers(config)
    run.log(record(0))
    run.close()
    assert json.loads((tmp_path / METRICS_FILE).read_text()) == record(0)
    assert capsys.readouterr().out == ""  # no console logger: no step line


@pytest.mark.parametrize("value, message", [
    ("[console,csv]", r"train\.logger: unknown logger 'csv'; choose from console, jsonl, tensorboard, wandb"),
    ("[jsonl,jsonl]", r"train\.logger names jsonl more than once"),
    ("jsonl", r"train\.logger"),  # a list, not a name
])
def test_train_logger_is_checked(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, [f"train.logger={value}"])


def test_an_optional_logger_without_its_package_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loggers, "PACKAGES", {**loggers.PACKAGES, "wandb": "no-such-package-rose"})
    with pytest.raises(ValueError, match=r"train\.logger: wandb needs the no-such-package-rose package, "
                                         r"which is not installed \(pip install no-such-package-rose\)"):
        load_config(None, ["train.logger=[console,wandb]"])
    assert load_config(None, ["train.logger=[]"]).train.logger == []  # no logger at all: a quiet run


def complete_lines(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_a_killed_rose_train_keeps_its_finished_steps(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    metrics, err = tmp_path / METRICS_FILE, tmp_path / "stderr.txt"
    # Its own session: the kill takes the driver and the Ray processes it started, nothing else.
    with err.open("w") as stderr:
        run = subprocess.Popen([sys.executable, "-m", "rose.cli", "train", "--mode", "fixed",
                                "train.steps=100", "rollout.groups=2", "rollout.group_size=2",
                                f"train.out_dir={tmp_path}"],
                               stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while len(complete_lines(metrics)) < 2 and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    steps = complete_lines(metrics)
    assert len(steps) >= 2 and [s["step"] for s in steps] == list(range(len(steps)))
    assert metrics.read_text().endswith("\n")  # no torn line: each was written whole, then flushed
    trainer = steps[0]["trainer"]
    assert {"loss", "kl", "entropy", "grad_norm", "clip_fraction", "lr", "version_lag", "reward_mean"} <= set(
        trainer)
    assert {"success_rate", "rollout_s", "sync_s", "sync_bytes", "dedicated_tokens", "dedicated_turns",
            "serving_tokens", "serving_turns", "serving"} <= set(steps[0])
    assert steps[0]["dedicated_turns"] > 0 and steps[0]["sync_bytes"] > 0
    # The trainer actor's log line reached the driver, with its role in Ray's prefix and in its own.
    assert re.search(r"\(trainer pid=\d+\).* INFO \[trainer\] rose\.runtime\.actors: policy", err.read_text())


def test_wandb_logs_offline_without_a_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = load_config(None, [f"train.out_dir={tmp_path / 'run'}", "train.logger=[wandb]"])
    run = Loggers(config)
    for step in range(2):
        run.log(record(step))
    run.close()
    # The offline run's history, kept for `wandb sync`.
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
