"""The training loop: rollouts, train, weight sync, record, repeat."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from rose.progress import bar
from rose.runtime.cluster import Cluster
from rose.runtime.config import Config, Mode
from rose.runtime.loggers import Loggers
from rose.runtime.report import StepClock, TrainStep, serving_summary, step_record, summarize, write_plot

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainRun:
    summary: dict[str, Any]
    steps: list[TrainStep]
    serving: dict[str, Any]
    elastic_alloc_s: list[float]
    elastic_cancelled_s: list[float]
    checkpoints: list[str]
    plot: str


def train(config: Config, mode: Mode, resume: Path | None = None) -> TrainRun:
    """Run `config.train.steps` RL steps in `mode` (from `resume`, a checkpoint, if given); each
    step's record goes to the config's loggers as the step ends."""
    out_dir, t = Path(config.train.out_dir), config.train
    cluster = Cluster(config, mode, out_dir, resume)
    records: list[TrainStep] = []
    checkpoints: list[str] = []
    loggers: Loggers | None = None
    run_start = time.time()
    try:  # a start that fails half-way also releases what it started (actors, pinned cores)
        cluster.start()
        loggers = Loggers(config, first_step=cluster.steps)
        steps = range(cluster.steps, t.steps)  # a resumed run goes on from its checkpoint
        with bar(f"train ({mode.value})", len(steps)) as progress:
            for step in steps:
                clock = StepClock.start(run_start, len(cluster.restarts))
                # 0. held-out success of the policy this step's rollouts sample, every eval.every steps
                evaluates = config.eval.every > 0 and (step % config.eval.every == 0 or step + 1 == t.steps)
                heldout = cluster.evaluate(step) if evaluates else None
                clock.lap("eval")
                # 1. rollouts: every episode, turn by turn, across dedicated (and borrowed) devices
                rollout = cluster.rollout(step)
                clock.lap("rollout")
                # 2. train on whatever came back (whole GRPO groups: no trajectory is lost)
                metrics = cluster.train(rollout.trajectories)
                clock.lap("train")
                # 3. weight sync: the trainer's new version reaches every replica through the relay
                sync = cluster.sync_weights()
                if (step + 1) % t.checkpoint_every == 0 or step + 1 == t.steps:
                    checkpoints.append(cluster.save(step + 1))
                # 4. record
                records.append(step_record(step, cluster, clock, rollout, metrics, sync, heldout))
                loggers.log(records[-1].record())
                for restart in records[-1].restarts:
                    log.warning(restart)
                progress.advance()
        results = cluster.serving_results(stop=True)
        pools = cluster.pool_timelines()
    finally:
        if loggers is not None:
            loggers.close()
        cluster.shutdown()
    served = [(at - run_start, r) for at, r in results]
    serving = serving_summary([r for _, r in served], config.serving) if mode is Mode.ROSE else {}
    pools = {wid: [(at - run_start, sample) for at, sample in timeline] for wid, timeline in pools.items()}
    plot = write_plot(out_dir / "report.png", records, served, pools, config.serving, mode)
    r = cluster.replicas
    summary = summarize(records, serving)
    if t.max_staleness:  # asynchronous RL's groups: started, taken, dropped, expired, in play at the end
        summary["stream_groups"] = cluster.stream_groups
    return TrainRun(summary, records, serving, r.elastic_alloc_s, r.elastic_cancelled_s,
                    checkpoints, str(plot))
