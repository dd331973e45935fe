"""Fault injection (`pytest -m chaos`): a short `rose train` in rose mode, synchronous and
asynchronous, in which a dedicated worker, a serving executor and the trainer are each killed in
the middle of a step. The run
completes every step with 0 lost trajectories; each dead actor is started again (the trainer
from the newest complete checkpoint, its step's trajectories trained on, not dropped)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from faults import rollout_with_fault

from rose.model import load_tokenizer
from rose.rl.trainer import is_complete
from rose.runtime.cluster import Cluster
from rose.runtime.config import Mode, load_config, resume_checkpoint
from rose.runtime.driver import train

ray = pytest.importorskip("ray")

# In `make test`: the three runs take about a minute and a half on 2 cores.
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

# Step -> what dies during that step's rollouts; the replicas once they are running turns.
VICTIMS = {0: "dedicated-0", 1: "serving-0", 2: "trainer"}
ROLLOUT = Cluster.rollout  # as defined: the test patches it


def _kill_when_busy(cluster: Cluster, step: int, victim: str) -> Any:
    """Step `step`'s rollouts, `victim` killed once it has turns in flight (the trainer: as the
    rollouts begin; an asynchronous run's last step may find its groups all played)."""
    if victim == "trainer":
        ray.kill(cluster.trainers.leader)
        return ROLLOUT(cluster, step)
    return rollout_with_fault(cluster, step, victim, lambda: ray.kill(cluster.replicas.all()[victim]))


@pytest.mark.parametrize("max_staleness", [0, 1])  # synchronous, and asynchronous RL's rollout stream
def test_a_run_survives_killed_workers_and_trainer(max_staleness: int, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(None, [
        "train.steps=3", "train.checkpoint_every=2", "rollout.groups=2", "rollout.group_size=4",
        "rollout.max_tokens=16", "rollout.dedicated_concurrency=4", "rollout.serving_concurrency=4",
        f"train.max_staleness={max_staleness}", f"train.out_dir={tmp_path}"])
    seen: dict[str, Any] = {"killed": []}
    rollout = Cluster.rollout

    def rollout_with_a_fault(self: Cluster, step: int) -> Any:
        seen["cluster"] = self
        if step not in VICTIMS:
            return rollout(self, step)
        report = _kill_when_busy(self, step, VICTIMS[step])
        seen["killed"].append((step, VICTIMS[step], len(report.trajectories)))
        seen.setdefault("failed", []).extend(report.failed + report.lost)
        return report

    monkeypatch.setattr(Cluster, "rollout", rollout_with_a_fault)
    result = train(config, Mode.ROSE)

    assert [k[1] for k in seen["killed"]] == ["dedicated-0", "serving-0", "trainer"]
    assert all(n == 8 for _, _, n in seen["killed"]), seen  # every trajectory came back whole
    assert [r.step for r in result.steps] == [0, 1, 2]
    assert [r.lost_trajectories for r in result.steps] == [0, 0, 0]
    assert result.summary["lost_trajectories"] == 0 and result.summary["failed_trajectories"] == 0
    assert [r.version for r in result.steps] == [1, 2, 3]  # versions only move forward
    restarts = [line for r in result.steps for line in r.restarts]
    assert any(line.startswith("dedicated-0 restarted") for line in restarts), restarts
    assert any(line.startswith("serving-0 restarted") for line in restarts), restarts
    # The checkpoint holds the weights it died with: they keep their version.
    assert (f"trainer restarted from {tmp_path / 'step-2'} (version 2): its weights are version 2, at step 2"
            in result.steps[2].restarts)
    # The restarted replicas took turns in the later steps: capacity came back (synchronous: in
    # each; asynchronous: a step may take groups played while the dedicated worker restarted).
    dedicated = [any(p.kind == "dedicated" for p in r.placements) for r in result.steps[1:]]
    assert all(dedicated) if max_staleness == 0 else any(dedicated)
    assert [Path(c).name for c in result.checkpoints] == ["step-2", "step-3"]
    assert all(is_complete(c) for c in result.checkpoints)
    assert resume_checkpoint(tmp_path) == tmp_path / "step-3"
    load_tokenizer(tmp_path / "step-3")  # a run can start from the checkpoint alone


def test_the_only_dedicated_worker_comes_back_within_the_step(tmp_path: Path) -> None:
    """Fixed mode, one dedicated worker, killed mid-rollout: nothing else can take its turns, so
    the step completes only because the cluster starts the worker again during the step."""
    config = load_config(None, ["rollout.groups=2", "rollout.group_size=4", "rollout.max_tokens=16",
                                "rollout.timeout_s=180", f"train.out_dir={tmp_path}"])
    cluster = Cluster(config, Mode.FIXED, tmp_path)
    try:
        cluster.start()
        old = cluster.replicas.dedicated["dedicated-0"]
        report = _kill_when_busy(cluster, 0, "dedicated-0")
        assert report.lost_trajectories == 0 and len(report.trajectories) == 8
        assert any(p.outcome == "lost" for p in report.placements)  # it died with turns in flight
        assert cluster.replicas.dedicated["dedicated-0"] is not old
        assert cluster.restarts == ["dedicated-0 restarted at version 0"]
        assert cluster.train(report.trajectories)["sequences"] > 0
        cluster.sync_weights()  # the new worker takes the next version like any other
    finally:
        cluster.shutdown()
