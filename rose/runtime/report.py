"""What a training run reports: per-step records, the JSON summary, the PNG figure, and the
plain-words lines that open and close `rose train`'s output.

One `TrainStep` per step is the single source: the loggers (rose.runtime.loggers) write its
`record()` as the step ends, and the `--json` summary and the PNG are built from the same list.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rose.contracts import WorkerKind
from rose.coserve.loadgen import RequestResult
from rose.coserve.loadgen import summarize as summarize_requests
from rose.coserve.metrics import transitions
from rose.coserve.settings import Engine
from rose.rl import Trajectory
from rose.rollout.manager import Placement, RolloutReport
from rose.runtime.config import Config, Mode, ModelSource, ServingDeviceConfig, actor_device
from rose.runtime.devices import cluster_address
from rose.runtime.loggers import METRICS_FILE

if TYPE_CHECKING:
    from rose.runtime.cluster import Cluster, SyncReport


@dataclasses.dataclass
class TrainStep:
    step: int
    version: int
    wall_start_s: float
    step_s: float
    rollout_s: float
    train_s: float
    sync_s: float
    sync_bytes: int
    success_rate: float
    heldout_success: float | None  # on held-out layouts, of the policy the step's rollouts sampled
    eval_s: float  # the held-out evaluation's share of step_s (0 at a step without one)
    serving_token_share: float  # share of generated tokens produced on serving devices
    serving_tokens: int  # generated on serving devices, by every attempt of a turn there
    dedicated_tokens: int
    serving_turns: int  # turns finished there
    dedicated_turns: int
    resumed_turns: int
    # Turns a serving device handed back (emergency cut) with their tokens, resumed elsewhere; and
    # the bursts (serving crossed the high watermark) that began on serving devices in the step.
    handed_back_turns: int
    bursts: int
    lost_trajectories: int
    failed_trajectories: int  # a turn refused every time it was tried (the reasons: RolloutReport.failed)
    placements: list[Placement]  # every turn attempt, its times in seconds since the run began
    serving: dict[str, Any]  # the serving requests that arrived during the step (loadgen.summarize)
    trainer: dict[str, float]  # all of `Trainer.step`'s metrics: loss, KL, entropy, grad norm, lr, ...
    elastic_devices: int
    restarts: list[str] = dataclasses.field(default_factory=list)  # actors that died and came back
    # Generated tokens trained on, by how many versions before the trained weights' they were
    # sampled ("0": on-policy; more under asynchronous RL, train.max_staleness).
    staleness: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def loss(self) -> float:
        return self.trainer["loss"]

    @property
    def reward(self) -> float:
        return self.trainer["reward_mean"]

    def record(self) -> dict[str, Any]:
        """What metrics.jsonl and `--json` keep of the step: everything but the turn placements
        (one per turn attempt: the PNG draws them, a log would grow with every turn)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "placements"}


@dataclasses.dataclass
class StepClock:
    """Where one step's time goes: laps since its start (`lap` names the part just done)."""

    run_start: float  # wall clock, the run's start
    wall0: float  # wall clock, the step's start
    t0: float  # perf counter, the step's start
    restarts: int  # restarts the run had logged before the step
    laps: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def start(cls, run_start: float, restarts: int) -> StepClock:
        return cls(run_start, time.time(), time.perf_counter(), restarts)

    def lap(self, name: str) -> None:
        self.laps[name] = self.elapsed - sum(self.laps.values())

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def step_record(step: int, cluster: Cluster, clock: StepClock, rollout: RolloutReport,
                metrics: dict[str, float], sync: SyncReport, heldout: RolloutReport | None) -> TrainStep:
    """The step's record, once its evaluation (if any), rollouts, training, weight sync and
    checkpoint are done. Held-out episodes that did not finish count as failures."""
    offset = clock.wall0 - clock.run_start
    served = [r for _, r in cluster.serving_results(since=clock.wall0)]
    triggers = [at for timeline in cluster.pool_timelines(since=clock.wall0).values()
                for at, a, b in transitions((sample for _, sample in timeline), clock.wall0)
                if (a, b) == ("normal", "burst") and at >= 0]
    heldout_success = (None if heldout is None else
                       sum(t.success for t in heldout.trajectories) / cluster.config.eval.episodes)
    return TrainStep(
        step=step, version=cluster.version, wall_start_s=offset, step_s=clock.elapsed,
        rollout_s=clock.laps["rollout"], train_s=clock.laps["train"], sync_s=sync.seconds,
        sync_bytes=sync.payload_bytes, success_rate=rollout.success_rate, heldout_success=heldout_success,
        eval_s=clock.laps["eval"], serving_token_share=rollout.serving_token_share,
        serving_tokens=rollout.tokens_on(WorkerKind.SERVING),
        dedicated_tokens=rollout.tokens_on(WorkerKind.DEDICATED),
        serving_turns=rollout.turns_on(WorkerKind.SERVING),
        dedicated_turns=rollout.turns_on(WorkerKind.DEDICATED),
        resumed_turns=rollout.resumed_turns, handed_back_turns=rollout.handed_back_turns,
        bursts=len(triggers),
        lost_trajectories=rollout.lost_trajectories, failed_trajectories=rollout.failed_trajectories,
        placements=[dataclasses.replace(p, start_s=p.start_s + offset, end_s=p.end_s + offset)
                    for p in rollout.placements],
        serving=serving_summary(served, cluster.config.serving) if cluster.replicas.serving else {},
        trainer=metrics, elastic_devices=len(cluster.replicas.elastic_alloc_s),
        restarts=cluster.restarts[clock.restarts:],
        staleness=staleness(rollout.trajectories, int(metrics["version"]) - 1))


def staleness(trajectories: list[Trajectory], trained: int) -> dict[str, int]:
    """Generated tokens by versions between the one that sampled them and `trained`."""
    lags = Counter(trained - v for t in trajectories for turn in t.turns for v in turn.versions)
    return {str(lag): n for lag, n in sorted(lags.items())}


def serving_summary(results: list[RequestResult], s: ServingDeviceConfig) -> dict[str, Any]:
    if not results:
        return {}
    duration = max(r.scheduled_s + (r.latency_s or 0) for r in results) - min(r.scheduled_s for r in results)
    return summarize_requests(results, max(duration, 1e-9), s.executor.slo_ttft_ms, s.executor.slo_tpot_ms)


def summarize(records: list[TrainStep], serving: dict[str, Any]) -> dict[str, Any]:
    """The summary keys of `rose train --json`."""
    n = max(len(records), 1)
    evals = [r.heldout_success for r in records if r.heldout_success is not None]
    return {
        "steps": len(records),
        "initial_success_rate": records[0].success_rate if records else None,
        "final_success_rate": records[-1].success_rate if records else None,
        "initial_heldout_success": evals[0] if evals else None,
        "final_heldout_success": evals[-1] if evals else None,
        "mean_step_s": round(sum(r.step_s for r in records) / n, 3),
        "mean_rollout_s": round(sum(r.rollout_s for r in records) / n, 3),
        "serving_token_share": round(sum(r.serving_token_share for r in records) / n, 4),
        "serving_slo_attainment": serving.get("slo_attainment"),
        "serving_p99_ttft_ms": serving.get("p99_ttft_ms"),
        "serving_p99_tpot_ms": serving.get("p99_tpot_ms"),
        "weight_sync_s": round(sum(r.sync_s for r in records) / n, 4),
        "weight_sync_bytes": sum(r.sync_bytes for r in records) // n,
        "bursts": sum(r.bursts for r in records),
        "handed_back_turns": sum(r.handed_back_turns for r in records),
        "lost_trajectories": sum(r.lost_trajectories for r in records),
        "failed_trajectories": sum(r.failed_trajectories for r in records),
        "restarts": sum(len(r.restarts) for r in records),
    }


PoolTimelines = dict[str, list[tuple[float, dict[str, float]]]]  # by serving device: (s into the run, sample)


def write_plot(path: Path, records: list[TrainStep], served: list[tuple[float, RequestResult]],
               pools: PoolTimelines, s: ServingDeviceConfig, mode: Mode) -> Path:
    """Reward and success, step time split, serving latency against the SLO, where turns ran
    (turns handed back marked), and each serving device's KV pool (bursts and freezes shaded
    on the time panels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 11))
    grid = fig.add_gridspec(3, 2)
    ax = [[fig.add_subplot(grid[row, col]) for col in range(2)] for row in range(2)]
    steps = [r.step for r in records]
    a = ax[0][0]
    a.plot(steps, [r.reward for r in records], label="mean reward")
    a.plot(steps, [r.success_rate for r in records], label="success rate")
    evals = [(r.step, r.heldout_success) for r in records if r.heldout_success is not None]
    if evals:
        a.plot(*zip(*evals, strict=True), marker="o", label="held-out success")
    a.set(xlabel="step", title=f"learning ({mode.value})")
    a.legend()
    a = ax[0][1]
    bottom = [0.0] * len(records)
    for name, part in (("rollout", "rollout_s"), ("train", "train_s"), ("weight sync", "sync_s")):
        values = [getattr(r, part) for r in records]
        a.bar(steps, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    a.set(xlabel="step", ylabel="seconds", title="step time")
    a.legend()
    a = ax[1][0]
    ok = [(t, r) for t, r in served if r.ttft_s is not None]
    if ok:
        a.scatter([t for t, _ in ok], [r.ttft_s * 1e3 for _, r in ok], s=4, label="TTFT")
        tp = [(t, r.tpot_s) for t, r in ok if r.tpot_s is not None]
        a.scatter([t for t, _ in tp], [v * 1e3 for _, v in tp], s=4, label="TPOT")
        a.axhline(s.executor.slo_ttft_ms, color="C0", linestyle="--", label="TTFT SLO")
        a.axhline(s.executor.slo_tpot_ms, color="C1", linestyle="--", label="TPOT SLO")
        a.set_yscale("log")
        a.legend()
    a.set(xlabel="time (s)", ylabel="ms", title="serving latency" + ("" if ok else " (no serving device)"))
    a = ax[1][1]
    for kind, y, color in (("dedicated", 0, "C2"), ("serving", 1, "C3")):
        spans = [(p.start_s, p.end_s - p.start_s) for r in records for p in r.placements if p.kind == kind]
        if spans:
            a.broken_barh(spans, (y - 0.4, 0.8), facecolors=color, alpha=0.15)
    cut = [p.end_s for r in records for p in r.placements if p.kind == "serving" and p.outcome == "abort"]
    if cut:
        a.scatter(cut, [1.0] * len(cut), marker="x", color="k", s=16, label="handed back (cut)", zorder=3)
        a.legend(loc="center right", fontsize=8)
    a.set(yticks=[0, 1], yticklabels=["dedicated", "serving"], xlabel="time (s)", title="where turns ran")
    pool = fig.add_subplot(grid[2, :], sharex=ax[1][0])
    _plot_pools(pool, pools)
    for a in (ax[1][0], ax[1][1], pool):
        _shade_bursts(a, pools)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _plot_pools(a: Any, pools: PoolTimelines) -> None:
    """Each serving device's pages (its prefix caches' left out) and the rollout budget."""
    for i, (wid, timeline) in enumerate(sorted(pools.items())):
        t, serving, rollout = [at for at, _ in timeline], f"C{2 * i}", f"C{2 * i + 1}"
        a.plot(t, [x["serving_pages"] - x["cached_serving_pages"] for _, x in timeline], color=serving,
               label=f"{wid}: serving pages")
        a.plot(t, [x["rollout_pages"] - x["cached_rollout_pages"] for _, x in timeline], color=rollout,
               label=f"{wid}: rollout pages")
        a.plot(t, [x["rollout_budget"] for _, x in timeline], color=rollout, linestyle=":",
               label=f"{wid}: rollout budget")
    if pools:
        a.legend(fontsize=8, loc="upper left")
    title = "serving devices' KV pool (shaded: burst red, frozen orange)"
    a.set(xlabel="time (s)", ylabel="KV pages", title=title if pools else "serving devices' KV pool (none)")


def burst_spans(timeline: list[tuple[float, dict[str, float]]]) -> list[tuple[float, float, int]]:
    """A pool timeline's runs in one burst state other than normal: (start, end, state), each
    ending at the next run's first sample (or the timeline's last)."""
    runs: list[list[float]] = []  # [start, end, state]
    for t, sample in timeline:
        if runs:
            runs[-1][1] = t
        if not runs or runs[-1][2] != sample["state"]:
            runs.append([t, t, sample["state"]])
    return [(start, end, int(state)) for start, end, state in runs if state]


def _shade_bursts(a: Any, pools: PoolTimelines) -> None:
    """The spans in which a serving device was in a burst (red) or frozen (orange)."""
    for timeline in pools.values():
        for start, end, state in burst_spans(timeline):
            a.axvspan(start, end, color="red" if state == 1 else "orange", alpha=0.15, linewidth=0)


def describe(config: Config, mode: Mode) -> list[str]:
    """What the run trains, on which devices, what each step's line says and where the results go,
    in plain words: the lines `rose train` opens with, for a reader new to it."""
    c, d, r, s = config, config.devices, config.rollout, config.serving
    local = cluster_address(c.ray_address) is None
    options = ", ".join(f"{k} {v}" for k, v in c.env.options.items())
    env = f"{c.env.name} ({options})" if options else c.env.name
    policy = _model(c.model) + ("" if c.model.is_pretrained else " policy, from scratch")
    lines = [f"training: {policy}, with {c.train.objective} on {env}: {r.groups} groups of {r.group_size} "
             f"episodes a step, {c.train.steps} steps"]
    rollout = actor_device(r.device)
    where = [f"dedicated rollout worker dedicated-{i} on {_cores(cores, local)} ({rollout})"
             for i, cores in enumerate(d.dedicated)]
    if mode is Mode.ROSE:
        serving = actor_device(s.device)
        served = _model(s.model) + (" on vLLM" if s.engine is Engine.VLLM else "")
        where += [f"serving device serving-{i} on {_cores(cores, local)} ({serving}) when it has room: it "
                  f"serves {served} to a replay of the {s.trace} trace within SLOs of "
                  f"{s.executor.slo_ttft_ms:g} ms TTFT and {s.executor.slo_tpot_ms:g} ms TPOT"
                  for i, cores in enumerate(d.serving)]
        where += [f"the serving endpoint {url} when it has room" for url in s.endpoints]
    if mode is Mode.ELASTIC:
        where += [f"elastic device elastic-{i} on {_cores(cores, local)} ({rollout}), started for each "
                  f"step's rollouts after a {d.provision_delay_s:g} s provisioning delay"
                  for i, cores in enumerate(d.elastic)]
    trainer = f"{_cores(d.trainer, local)} ({actor_device(c.train.device)})"
    lines.append(f"devices: the trainer on {trainer}; turns run on {'; '.join(where)}")
    lines.append(f"each step's line: success = the share of its {r.groups * r.group_size} episodes that "
                 "reach the goal, which rises as the policy learns; reward = their mean return; on serving = "
                 "the share of tokens generated on serving devices")
    lines.append(f"results in {c.train.out_dir}: {METRICS_FILE} (every step, as it ends), report.png (at the "
                 "end: reward and success, step time, serving latency against the SLO, where turns ran), "
                 f"checkpoints step-N (every {c.train.checkpoint_every} steps and the last)")
    return lines


def outcome(records: list[TrainStep], serving: dict[str, Any]) -> list[str]:
    """How the run went, in plain words: the lines `rose train` closes with."""
    if not records:
        return []
    first, last = records[0], records[-1]
    best = max(records, key=lambda x: x.success_rate)
    dedicated, served = sum(x.dedicated_turns for x in records), sum(x.serving_turns for x in records)
    turns = f"turns: {dedicated} on dedicated workers, {served} on serving devices"
    if (met := serving.get("slo_attainment")) is not None:
        turns += (f"; the serving devices' own requests met their SLOs {met:.1%} of the time (p99 TTFT "
                  f"{serving.get('p99_ttft_ms')} ms, TPOT {serving.get('p99_tpot_ms')} ms)")
    lines = [f"success rate {first.success_rate:.2f} at step {first.step} -> {last.success_rate:.2f} at step "
             f"{last.step} (best {best.success_rate:.2f}, step {best.step})", turns]
    if bursts := sum(x.bursts for x in records):
        handed = sum(x.handed_back_turns for x in records)
        lines.append(f"bursts: serving took its KV pages back {bursts} time{'s' * (bursts > 1)}; {handed} "
                     f"turn{'s' * (handed != 1)} handed back with their tokens and resumed elsewhere")
    return lines


def _model(model: ModelSource) -> str:
    if model.path is not None:
        return f"the checkpoint {model.path}"
    if model.pretrained is not None:
        return f"the pretrained {model.pretrained}"
    return f"a random-initialised {model.arch} {model.preset} (seed {model.seed})"


def _cores(cores: list[int], local: bool) -> str:
    if not local:  # on a cluster a device's core list counts the CPUs its actor asks for
        return f"{len(cores)} CPU{'s' if len(cores) > 1 else ''}"
    return f"core{'s' if len(cores) > 1 else ''} {', '.join(map(str, cores))}"
