"""The training loop: rollouts, train, weight sync, repeat."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rose.runtime.cluster import Cluster
from rose.runtime.config import Config, Mode
from rose.runtime.report import TrainStep, serving_summary, summarize, write_plot


@dataclasses.dataclass
class TrainRun:
    summary: dict[str, Any]
    steps: list[TrainStep]
    serving: dict[str, Any]
    elastic_alloc_s: list[float]
    elastic_cancelled_s: list[float]
    checkpoints: list[str]
    plot: str


def train(config: Config, mode: Mode, resume: Path | None = None,
          on_step: Callable[[TrainStep], None] | None = None) -> TrainRun:
    """Run `config.train.steps` RL steps in `mode` (from `resume`, a checkpoint, if given)."""
    out_dir = Path(config.train.out_dir)
    cluster = Cluster(config, mode, out_dir, resume)
    records: list[TrainStep] = []
    checkpoints: list[str] = []
    t_start = time.time()
    try:  # a start that fails half-way also releases what it started (actors, pinned cores)
        cluster.start()
        first = cluster.version  # a resumed run goes on from its checkpoint's version
        for step in range(first, config.train.steps):
            t0, wall0, restarts = time.perf_counter(), time.time(), len(cluster.restarts)
            # 1. rollouts: every episode, turn by turn, across dedicated (and borrowed) devices
            rollout = cluster.rollout(step)
            t_rollout = time.perf_counter() - t0
            # 2. train on whatever came back (whole GRPO groups: no trajectory is lost)
            metrics = cluster.train(rollout.trajectories)
            t_train = time.perf_counter() - t0 - t_rollout
            # 3. weight sync: the trainer's new version reaches every replica through the relay
            sync = cluster.sync_weights()
            if (step + 1) % config.train.checkpoint_every == 0 or step + 1 == config.train.steps:
                checkpoints.append(cluster.save(step + 1))
            served = [r for _, r in cluster.serving_results(since=wall0)]
            record = TrainStep(
                step=step, version=cluster.version, wall_start_s=wall0 - t_start,
                step_s=time.perf_counter() - t0, rollout_s=t_rollout, train_s=t_train,
                sync_s=sync.seconds, sync_bytes=sync.payload_bytes,
                success_rate=rollout.success_rate, reward=metrics["reward_mean"],
                serving_token_share=rollout.serving_token_share, resumed_turns=rollout.resumed_turns,
                lost_trajectories=rollout.lost_trajectories, failed_trajectories=rollout.failed_trajectories,
                placements=[(p.start_s + (wall0 - t_start), p.end_s + (wall0 - t_start), p.kind)
                            for p in rollout.placements],
                serving=serving_summary(served, config.serving) if cluster.serving else {},
                loss=metrics["loss"], elastic_devices=len(cluster.elastic_alloc_s),
                restarts=cluster.restarts[restarts:])
            records.append(record)
            if on_step is not None:
                on_step(record)
        results = cluster.serving_results(stop=True)
    finally:
        cluster.shutdown()
    served = [(t - t_start, r) for t, r in results]
    serving = serving_summary([r for _, r in served], config.serving) if mode is Mode.ROSE else {}
    summary = summarize(records, serving)
    plot = write_plot(out_dir / "report.png", records, served, config.serving, mode)
    return TrainRun(summary, records, serving, cluster.elastic_alloc_s, cluster.elastic_cancelled_s,
                     checkpoints, str(plot))
