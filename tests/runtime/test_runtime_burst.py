"""A burst during `rose train` (docs/rl.md, "A burst during training"): the serving device's
replay starts where the trace's own spike comes `serving.spike_at_s` seconds in; on a pool the
spike overfills, the executor takes the rollouts' pages back, the turns it cuts come back with
their tokens and finish on the dedicated worker, and the run records and draws it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rose.coserve.loadgen import build_trace, spike
from rose.rollout.manager import Placement
from rose.runtime.actors import replay_start
from rose.runtime.config import Mode, load_config
from rose.runtime.driver import train

CPU = ["train.device=cpu", "rollout.device=cpu", "serving.device=cpu"]


def test_the_replay_starts_so_that_the_spike_comes_spike_at_s_in() -> None:
    s = load_config(None, [*CPU, "serving.spike_at_s=5"]).serving
    start = replay_start(s)
    assert start > 0
    window = build_trace(s.trace, 60.0, s.load, start, s.prompt_scale, s.output_scale)
    at, tokens = spike(window, s.max_context, s.max_output, s.spike_s)
    assert at == pytest.approx(5.0, abs=1e-6)
    # No stretch of the trace holds more: what the replay from 0 sends has no denser one.
    first = build_trace(s.trace, 60.0, s.load, 0.0, s.prompt_scale, s.output_scale)
    assert spike(first, s.max_context, s.max_output, s.spike_s)[1] <= tokens
    assert replay_start(dataclasses.replace(s, spike_at_s=None)) == 0.0
    assert replay_start(dataclasses.replace(s, spike_at_s=1e9)) == 0.0  # sooner: the trace has less before it


def test_a_spike_needs_a_recorded_trace() -> None:
    with pytest.raises(ValueError, match=r"serving\.spike_at_s: the gamma trace .* has no spike"):
        load_config(None, ["serving.trace=gamma", "serving.spike_at_s=5"])
    with pytest.raises(ValueError, match=r"serving\.spike_at_s must be >= 0, got -1"):
        load_config(None, ["serving.spike_at_s=-1"])


@pytest.mark.slow
def test_a_spike_during_training_cuts_turns_that_finish_elsewhere(tmp_path: Path) -> None:
    """A 2 MiB pool on the serving device: a serving prompt of a few hundred tokens that arrives
    while the rollouts hold their budget needs their pages. Every turn cut there comes back with
    its tokens and finishes in its step on a worker with room: the dedicated one when it has a
    slot, else the serving device again within its frozen budget; no trajectory is lost."""
    config = load_config(None, [*CPU, "train.steps=3", "rollout.groups=8", "rollout.group_size=4",
                                "rollout.max_tokens=48", "rollout.dedicated_concurrency=4",
                                "serving.spike_at_s=20", "serving.executor.pool_mb=2",
                                f"train.out_dir={tmp_path}"])
    run = train(config, Mode.ROSE)
    assert run.summary["bursts"] >= 1 and run.summary["handed_back_turns"] >= 1
    assert run.summary["lost_trajectories"] == run.summary["failed_trajectories"] == 0
    for record in run.steps:
        attempts: dict[tuple[str, int], list[Placement]] = {}
        for p in record.placements:
            attempts.setdefault((p.trajectory_id, p.turn), []).append(p)
        cut = [p for p in record.placements if (p.kind, p.outcome) == ("serving", "abort")]
        assert len(cut) == record.handed_back_turns
        for p in cut:  # a later attempt of the same turn finished it
            later = attempts[p.trajectory_id, p.turn]
            assert any(q.attempt > p.attempt and q.outcome == "done" for q in later)
    assert run.summary["serving_slo_attainment"] is not None
    assert Path(run.plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
