"""Kill a dedicated rollout worker, and separately a co-serving executor, in the middle of a
step: the step completes, every trajectory comes back whole (lost_trajectories 0). A trainer
call that finds its actor dead restarts the trainer and is made again, once; a second death
stops the run naming how to go on (tests/runtime/test_runtime_chaos.py kills the real actors)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from rose.coserve.settings import ServerLimits
from rose.runtime.cluster import PROMETHEUS_TARGETS, Cluster
from rose.runtime.config import Mode, ServingDeviceConfig, load_config
from rose.runtime.placement import PlacementPolicy
from rose.runtime.trainers import TrainerGroup

ray = pytest.importorskip("ray")


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["dedicated-0", "serving-0"])
def test_a_step_survives_a_killed_worker(victim: str, tmp_path: Path) -> None:
    config = load_config(None, ["rollout.groups=4", "rollout.group_size=4", "rollout.max_tokens=16",
                                "rollout.dedicated_concurrency=8", "rollout.serving_concurrency=8",
                                f"train.out_dir={tmp_path}"])
    cluster = Cluster(config, Mode.ROSE, tmp_path)
    try:
        cluster.start()
        _scrape_targets(tmp_path)
        handle = cluster.replicas.all()[victim]
        killer = threading.Timer(1.0, lambda: ray.kill(handle))
        killer.start()
        report = cluster.rollout(0)
        killer.join()
        assert report.lost_trajectories == 0 and len(report.trajectories) == 16
        assert all(t.done or t.truncated for t in report.trajectories)
        assert any(p.worker_id == victim for p in report.placements)  # it did run turns before
        metrics = cluster.train(report.trajectories)
        assert metrics["sequences"] > 0
        # The step's watch restarts a dead replica only if it notices before the rollouts end;
        # the weight sync after training (the driver's next call) restarts it in any case.
        cluster.sync_weights()
        assert any(line.startswith(f"{victim} restarted") for line in cluster.restarts), cluster.restarts
        _scrape_targets(tmp_path)  # a restarted executor's new port
    finally:
        cluster.replicas.dedicated.pop(victim, None)
        cluster.replicas.serving.pop(victim, None)
        cluster.shutdown()


def test_replicas_answer_the_liveness_probe_while_they_wait_for_weights(tmp_path: Path) -> None:
    """A replica's weight sync waits for the trainer's publish; its `ready` (what the run asks
    to tell a slow replica from a dead one) answers meanwhile, on every kind of replica."""
    cluster = Cluster(load_config(None, [f"train.out_dir={tmp_path}"]), Mode.ROSE, tmp_path)
    try:
        cluster.start()
        replicas = cluster.replicas.all()
        assert set(replicas) == {"dedicated-0", "serving-0"}
        pulls = {wid: handle.sync_weights.remote(120) for wid, handle in replicas.items()}
        time.sleep(1.0)  # the pulls have started waiting
        for wid, handle in replicas.items():
            assert ray.get(handle.ready.remote(), timeout=20), wid
            assert not ray.wait([pulls[wid]], timeout=0)[0], f"{wid} synced before any publish"
        cluster.loop.run_until_complete(cluster.trainers.publish())
        for wid, pull in pulls.items():
            assert ray.get(pull, timeout=120)["version"] == cluster.trainers.version, wid
    finally:
        cluster.shutdown()


def _scrape_targets(out_dir: Path) -> None:
    """The run directory lists the serving device's /metrics for Prometheus, and it answers."""
    [group] = json.loads((out_dir / PROMETHEUS_TARGETS).read_text())
    assert group["labels"]["replica"] == "serving-0"
    text = httpx.get(f"http://{group['targets'][0]}/metrics").text
    assert 'vllm:num_requests_running{model_name="serving-model"}' in text


class _Rank:
    """A trainer rank stand-in: `step` answers, or fails as a dead Ray actor's call does."""

    def __init__(self, dead: bool) -> None:
        self.dead = dead

    async def step(self, shard: list[int]) -> dict[str, float]:
        if self.dead:
            raise ray.exceptions.ActorDiedError()
        return {"version": 4.0, "sequences": float(len(shard))}


@pytest.mark.parametrize("dies_again", [False, True])
def test_a_dead_trainer_restarts_and_retrains_or_the_run_stops(dies_again: bool, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    group = TrainerGroup(load_config(None, [f"train.out_dir={tmp_path}"]), "relay", "rollout", tmp_path, [],
                         PlacementPolicy())
    group.ranks, group.version = [_Rank(dead=True)], 3
    restarts: list[int] = []

    async def restart() -> None:  # what TrainerGroup._restart does, without Ray: new ranks
        restarts.append(group.version)
        group.ranks = [_Rank(dead=dies_again)]

    monkeypatch.setattr(group, "_restart", restart)
    call = group.call(lambda ranks: [r.step([1, 2, 3]) for r in ranks])
    if dies_again:
        with pytest.raises(RuntimeError, match=rf"the trainer died again right after a restart "
                                               rf"\(ActorDiedError\); the run stops at version 3\. Go "
                                               rf"on with: rose train --resume {tmp_path}"):
            asyncio.run(call)
    else:  # the same step's batch, trained on the restarted trainer
        assert asyncio.run(call) == [{"version": 4.0, "sequences": 3.0}]
    assert restarts == [3]


class _Restarted:
    """A restarted rank's handle: its checkpoint's (version, steps), and how the group renumbers it."""

    def __init__(self, checkpoint: tuple[int, int]) -> None:
        self.checkpoint, self.renumbered = checkpoint, None
        self.renumber = SimpleNamespace(remote=self._renumber)

    async def start(self) -> tuple[int, int]:
        return self.checkpoint

    async def _renumber(self, version: int, steps: int) -> None:
        self.renumbered = (version, steps)


@pytest.mark.parametrize(("checkpoint", "version_after"), [((5, 5), 5), ((4, 4), 6), ((0, 0), 6)])
def test_a_restarted_trainer_names_rolled_back_weights_with_a_new_version(
        checkpoint: tuple[int, int], version_after: int, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At version 5 after 5 steps the trainer dies. From a checkpoint of the same weights the
    version stays; from older ones (step 4's, the run's start) the weights take version 6, a
    number no weights had, so the tokens sampled at 5 lag one behind them. The steps go on."""
    group = TrainerGroup(load_config(None, [f"train.out_dir={tmp_path}"]), "relay", "rollout", tmp_path, [],
                         PlacementPolicy())
    group.version = group.steps = 5
    group.checkpoints = [tmp_path / "step-4"]
    rank = _Restarted(checkpoint)
    monkeypatch.setattr(ray, "kill", lambda actor: None)

    async def launch(path: str) -> list[Any]:
        group.ranks = [rank]
        return [rank.start()]

    monkeypatch.setattr(group, "launch", launch)
    asyncio.run(group._restart())
    assert (group.version, group.steps, rank.renumbered) == (version_after, 5, (version_after, 5))
    assert group.restarts == [f"trainer restarted from {tmp_path / 'step-4'} (version {checkpoint[0]}): its "
                              f"weights are version {version_after}, at step 5"]


class _DeadHandle:
    """An actor handle whose every call fails as a dead actor's does."""

    def __getattr__(self, method: str) -> Any:
        async def fail() -> None:
            raise ray.exceptions.ActorDiedError()

        return type("Method", (), {"remote": staticmethod(fail)})


def test_an_elastic_device_that_died_is_released_without_failing_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(load_config(None, [f"train.out_dir={tmp_path}"]), Mode.ELASTIC, tmp_path)
    killed: list[Any] = []
    monkeypatch.setattr(ray, "kill", killed.append)
    dead = _DeadHandle()
    cluster.replicas.dedicated["elastic-0"] = dead
    try:
        cluster.loop.run_until_complete(cluster.replicas._release_elastic())
    finally:
        cluster.loop.close()
    assert killed == [dead] and "elastic-0" not in cluster.replicas.dedicated


def test_the_serving_replay_lives_through_windows_without_arrivals(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serving.window_s=2` at the default load: the trace's first windows hold under two
    requests; the replay waits them out (it used to die, leaving the serving side idle)."""
    import asyncio

    import rose.runtime.actors as actors

    device = actors.ServingDeviceActor.__new__(actors.ServingDeviceActor)
    device.spec, device.url, device.results = ServingDeviceConfig(window_s=2.0), "http://unused", []
    device.limits = ServerLimits(api_key="k")
    device._stop = threading.Event()
    waited: list[float] = []
    sent: list[int] = []

    async def wait(seconds: float) -> None:
        waited.append(seconds)

    async def replay(url: str, trace: Any, max_context: int, max_output: int, api_key: str) -> list[Any]:
        assert api_key == "k"  # the replay presents the device's own key
        sent.append(len(trace.arrival_s))
        device._stop.set()
        return []

    monkeypatch.setattr(actors.asyncio, "sleep", wait)
    monkeypatch.setattr(actors, "replay", replay)
    asyncio.run(device._replay_windows())
    assert waited == [2.0] * 4 and sent and sent[0] >= 2
