"""Scenario configurations: dataclasses, their checks, and the named scenarios.

`load_scenario("paper-8b", ["cluster.serving_gpus=32", "rl.steps=4"])` returns a validated
`Scenario`, the overrides merged by the shared loader (`rose.config`); unknown keys and values of
the wrong type or range are one-line `ValueError`s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rose.config import load, read_named_config
from rose.contracts.adapter import LoRAConfig
from rose.coserve.settings import ExecutorConfig
from rose.sim.costs import DEVICES, MODELS, TRANSPORTS, WeightSync
from rose.sim.systems import SYSTEMS, Extra, batchable
from rose.sim.workloads import DEMAND_SIGMA, ENVS, EnvProfile
from rose.traces import TRACE_FILES

# Qwen3-8B's thinking length per FrozenLake turn (median tokens). The one calibrated workload
# constant: set so that the fixed-sync baseline spends the paper's measured share of its step in
# rollout (86.9% for Qwen3-8B), see docs/simulator.md. Nothing is calibrated against ROSE.
FROZENLAKE_THINKING_MEDIAN = 2400.0
# The paper's evaluation caps rollout concurrency at 16 trajectories per GPU (Qwen3 models, 32K
# context; a trajectory holds its slot between turns) for every system; its serving SLOs (P99
# TTFT / TPOT) are 500 / 150 ms for Qwen2.5-7B and 1,000 / 450 ms for Qwen2.5-32B. Source: a
# review of the paper's section 6 (docs/simulator.md says which, and why the SLOs are read in
# that order).
PAPER_TRAJECTORIES_PER_GPU = 16
ENV_FIELDS = ("prompt_tokens", "obs_tokens", "response_median", "max_response", "max_turns", "env_step_s")
# The executor settings each simulated serving replica follows (its pool, where set, else what
# the GPU's memory leaves beside both models' weights; its admission and burst control); the
# others are the device's own (its latency model: the roofline, exact; its lease slots:
# rl.fixed_concurrency) or the system's (policy: rose, naive-share, static-split).
SIMULATED_SETTINGS = ("pool_mb", "slo_ttft_ms", "slo_tpot_ms", "tpot_inflation", "ttft_inflation",
                      "chunk_tokens", "headroom", "high_watermark", "arrival_reserve_tokens",
                      "idle_min_rollout_tokens", "static_rollout_pages", "static_rollout_tokens")


@dataclasses.dataclass
class ClusterConfig:
    device: str = "H800"
    train_gpus: int = 48            # the RL job's own GPUs (training; rollout too when colocated)
    rollout_gpus: int = 0           # dedicated rollout-only GPUs besides them
    serving_gpus: int = 64          # the production serving cluster
    rollout_tp: int = 1             # tensor parallelism of a rollout replica
    serving_tp: int = 1             # ... of a serving replica (a co-served rollout model matches it)
    cross_gbps: float = 200.0       # link between the clusters (ROSE paper: 200 Gb/s Ethernet)
    # fixed-async: share of the job's GPUs that generate; -1 balances them against training
    # with the rollout/training times of one synchronous step of the same workload.
    async_rollout_fraction: float = -1.0
    # Synchronous systems roll out on the training GPUs between steps (and on rollout_gpus). False:
    # the training GPUs only train, as in `rose bench coserve`, whose rollouts have the serving
    # device alone.
    trainer_rolls_out: bool = True
    # The rollout manager runs on the dedicated devices' cores, as `rose train` pins its driver
    # to the trainer's: its CPU per token any worker streams comes out of their time. False: it
    # has CPUs of its own, as on GPU clusters.
    manager_on_dedicated: bool = False


@dataclasses.dataclass
class ControlPlaneConfig:
    """The rollout control plane: the driver's rollout manager, which every turn and every streamed
    chunk passes through (`rose.sim.control`)."""

    # stream: one multiplexed stream per device, a frame per interval carrying all its turns'
    # chunks; http: a stream per turn, each turn's chunk its own message (`costs.TRANSPORTS`).
    transport: str = "stream"
    # The cores the driver has for it; where a tick needs more, its rollouts slow to what they
    # give. 0: unlimited. With cluster.manager_on_dedicated it has the dedicated devices' cores.
    driver_cores: float = 0.0


@dataclasses.dataclass
class ModelsConfig:
    policy: str = "qwen3-8b"
    serving: str = "qwen2.5-7b"


@dataclasses.dataclass
class ServingFleetConfig:
    """The simulated serving cluster (`rose.sim.serving.ServingFleet`): its traffic over the day,
    and the co-serving executor on each replica."""

    trace: str = "azure-conv"
    load: float = 1.0                # x the trace's own mean request rate, per serving replica
    prompt_scale: float = 1.0        # x the trace's prompt lengths
    output_scale: float = 1.0        # x the trace's output lengths
    minute_peak_to_mean: float = 1.7   # ROSE paper's 24 h trace; sets the diurnal amplitude
    start_hour: float = 9.0          # time of day the run starts
    max_context: int = 0             # clip prompt + output to this (0: no clipping), as a replay does
    max_output: int = 0              # ... and outputs to this (used with max_context)
    # The serving engine's own time per iteration beyond the roofline's (scheduling, launches,
    # sampling, streaming): 0 for an engine as fast as the roofline (costs.Efficiency).
    engine_overhead_ms: float = 0.0
    # Of that overhead, the share the GPU idles while the engine works on the host: a rollout
    # engine on the same GPU steps whole iterations of its own then (`CoServing.plan`), whatever
    # the sharing. 0: the overhead keeps the GPU busy (slow kernels), so rollouts get none of it.
    engine_host_share: float = 0.0
    # > 0: the fleet is stated by serving alone's P99 TPOT, as the paper's Table 1 states it:
    # engine_overhead_ms is solved so that serving alone, at this load, has this P99 TPOT over the
    # run's first hour (`rose.sim.engine.with_serving_engine`).
    target_p99_tpot_ms: float = 0.0
    # A spike on purpose, as `rose train`'s serving.spike_at_s: every replica replays the trace
    # from where its spike (the `spike_s` seconds in which the most KV tokens arrive, as replayed)
    # comes `spike_at_s` seconds into the run, and the serving figures are also given inside the
    # spike and outside it. None: each replica starts at a random point of the trace.
    spike_at_s: float | None = None
    spike_s: float = 20.0
    # Every replica replays the trace from this many seconds into it, as replayed at this load
    # (`rose loadgen --start`, `rose bench coserve --start`), on a flat day. None: as above.
    replay_start_s: float | None = None
    # How each replica hosts the rollouts: "model", the policy a second model beside serving's (its
    # weights in device memory, its own forward after serving's each iteration); "adapter", the
    # policy a LoRA adapter of the serving model (models.policy must be models.serving): one set of
    # weights, rollout rows in serving's forward, one KV pool, and each RL step's weight sync the
    # adapter's tensors (`rose.sim.costs.OneForwardLatency`). Its rank, on every attention and MLP
    # projection, is adapter_rank.
    rollout: str = "model"
    adapter_rank: int = LoRAConfig.rank
    # Each replica's executor, as `rose serve`'s and with its defaults; the scenarios state their
    # SLOs. Only SIMULATED_SETTINGS may differ from the defaults.
    executor: ExecutorConfig = dataclasses.field(default_factory=ExecutorConfig)


@dataclasses.dataclass
class RLConfig:
    env: str = "frozenlake"
    algorithm: str = "grpo"          # grpo | dapo (DAPO adds dynamic sampling)
    trajectories: int = 4096         # per step (prompts x group)
    group: int = 16
    steps: int = 6
    demand_sigma: float = DEMAND_SIGMA
    rollout_max_seqs: int = 256      # vLLM's default max_num_seqs
    rollout_batched_tokens: int = 8192   # prefill token budget per iteration on dedicated GPUs
    # Turns in flight per worker, fixed (as `rose train` sets them); 0: the manager shares each
    # round's trajectories over the workers in proportion to their speed.
    fixed_concurrency: int = 0
    # What the cap counts: turns in flight (`rose train`'s manager), or trajectories, which keep
    # their slot between turns (the paper's evaluation, ROLL's environment managers).
    cap_counts: str = "turns"
    # > 0: a burst's freeze ends this long after its trigger, as if the next RL step began then
    # (`rose bench coserve --burst --next-step-s`); 0: when the run's next step begins.
    step_after_burst_s: float = 0.0
    # Optional overrides of the environment profile (rose.sim.workloads.ENVS); None keeps it.
    prompt_tokens: int | None = None
    obs_tokens: int | None = None
    response_median: float | None = None
    max_response: int | None = None
    max_turns: int | None = None
    env_step_s: float | None = None

    def env_profile(self) -> EnvProfile:
        changes = {f: getattr(self, f) for f in ENV_FIELDS if getattr(self, f) is not None}
        return dataclasses.replace(ENVS[self.env], **changes)


@dataclasses.dataclass
class ElasticConfig:
    max_gpus: int = -1               # extra GPUs an elastic system may hold; -1: as many as serving
    # Preemptible GPUs as measured for RLBoost-style systems (design): 56-67 s preparation
    # (instance, container, engine, weights) and 11-18 s finalisation per allocation.
    spot_prepare_min_s: float = 56.0
    spot_prepare_max_s: float = 67.0
    spot_finalize_min_s: float = 11.0
    spot_finalize_max_s: float = 18.0
    # Measured (rose.sim.spot): V100 spot instances on AWS lived 5.3 h on average (Can't Be Late, NSDI'24).
    spot_mean_lifetime_h: float = 5.3
    # measured: the market grants a share of each request as the Can't Be Late traces did
    # (rose.sim.spot), preempted or missing instances are asked for again; full: every requested
    # GPU at every step, preempted ones not replaced.
    availability: str = "measured"
    # Serverless functions (assumptions, no published lambda-RL figures at hand): a cold start
    # is container start + engine initialisation + the full new weights from object storage;
    # each turn is an invocation with its own dispatch latency and no KV kept between turns.
    serverless_container_s: float = 5.0
    serverless_engine_init_s: float = 20.0
    serverless_storage_gbps: float = 16.0    # 2 GB/s per instance from object storage
    serverless_invoke_s: float = 0.5
    serverless_finalize_s: float = 3.0
    # A function runs for at most 15 minutes, then starts cold again: lambda-RL's timeout (the
    # paper's review), AWS Lambda's documented maximum (900 s).
    serverless_max_run_s: float = 900.0


@dataclasses.dataclass
class SyncConfig:
    changed_fraction: float = WeightSync.changed_fraction
    full_every: int = WeightSync.full_every
    colocated_switch_s: float = 5.0  # assumption: offload/reload between train and rollout engines


@dataclasses.dataclass
class SimConfig:
    tick_s: float = 2.0
    seed: int = 0
    # > 0: the run stops at this simulated time, the step under way cut short there (and
    # counted, having trained nothing); 0: after rl.steps.
    duration_s: float = 0.0
    # Simulate 1/slice of the cluster with 1/slice of the batch: replicas of one kind are
    # statistically identical, so per-replica load is unchanged. (The inter-cluster link is not
    # sliced: one copy of the weights crosses it whatever the number of receivers.)
    slice: int = 1
    # How serving replicas are simulated: "requests", every request its own row (exact within
    # the fluid model; a day of thousands of replicas is billions of rows), or "aggregate", every
    # replica one row, its requests counted from the trace's running sums, latencies from its
    # fluid queue into per-minute histograms (`rose.sim.aggregate`; docs/simulator.md compares).
    serving_model: str = "requests"
    # How rollout turns are simulated: "turns", each routed through the routing table and
    # advanced every tick, or "batched", the turns due in a tick routed together and each worker
    # keeping clocks its sequences are targets on (`rose.sim.batched`; fixed-sync and ROSE's
    # synchronous systems with fixed per-worker caps).
    rollout_model: str = "turns"
    systems: list[str] = dataclasses.field(default_factory=lambda: [
        "fixed-sync", "fixed-async", "elastic-spot", "elastic-serverless", "rose", "naive-share"])


@dataclasses.dataclass
class Scenario:
    name: str = "custom"
    description: str = ""
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    models: ModelsConfig = dataclasses.field(default_factory=ModelsConfig)
    serving: ServingFleetConfig = dataclasses.field(default_factory=ServingFleetConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    elastic: ElasticConfig = dataclasses.field(default_factory=ElasticConfig)
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)
    control_plane: ControlPlaneConfig = dataclasses.field(default_factory=ControlPlaneConfig)

    @property
    def elastic_gpus(self) -> int:
        return self.cluster.serving_gpus if self.elastic.max_gpus < 0 else self.elastic.max_gpus

    def sliced(self) -> Scenario:
        """The 1/`sim.slice` of this scenario that is actually simulated."""
        k = self.sim.slice
        if k == 1:
            return self
        c, r = self.cluster, self.rl
        cluster = dataclasses.replace(c, train_gpus=c.train_gpus // k, rollout_gpus=c.rollout_gpus // k,
                                      serving_gpus=c.serving_gpus // k)
        elastic = dataclasses.replace(self.elastic, max_gpus=self.elastic_gpus // k)
        rl = dataclasses.replace(r, trajectories=r.trajectories // k)
        # The slice's share of the driver: its turns and tokens are 1/k of the cluster's.
        control = dataclasses.replace(self.control_plane, driver_cores=self.control_plane.driver_cores / k)
        return dataclasses.replace(self, cluster=cluster, elastic=elastic, rl=rl, control_plane=control,
                                   sim=dataclasses.replace(self.sim, slice=1))


def validate(sc: Scenario) -> Scenario:
    c, s, r = sc.cluster, sc.serving, sc.rl

    def need(ok: bool, key: str, what: str, value: Any) -> None:
        if not ok:
            raise ValueError(f"scenario {sc.name}: {key} must be {what}, got {value!r}")

    need(c.device in DEVICES, "cluster.device", f"one of {', '.join(DEVICES)}", c.device)
    need(sc.models.policy in MODELS, "models.policy", f"one of {', '.join(MODELS)}", sc.models.policy)
    need(sc.models.serving in MODELS, "models.serving", f"one of {', '.join(MODELS)}", sc.models.serving)
    need(s.trace in TRACE_FILES, "serving.trace", f"one of {', '.join(TRACE_FILES)}", s.trace)
    need(r.env in ENVS, "rl.env", f"one of {', '.join(ENVS)}", r.env)
    need(r.algorithm in ("grpo", "dapo"), "rl.algorithm", "grpo or dapo", r.algorithm)
    need(r.cap_counts in ("turns", "trajectories"), "rl.cap_counts", "turns or trajectories", r.cap_counts)
    need(sc.elastic.availability in ("measured", "full"), "elastic.availability", "measured or full",
         sc.elastic.availability)
    for key, value in (("cluster.rollout_tp", c.rollout_tp), ("cluster.serving_tp", c.serving_tp),
                       ("rl.group", r.group), ("rl.steps", r.steps),
                       ("rl.rollout_max_seqs", r.rollout_max_seqs),
                       ("rl.rollout_batched_tokens", r.rollout_batched_tokens),
                       ("sync.full_every", sc.sync.full_every), ("serving.adapter_rank", s.adapter_rank)):
        need(value >= 1, key, ">= 1", value)
    need(s.rollout in ("model", "adapter"), "serving.rollout", "model or adapter", s.rollout)
    if s.rollout == "adapter" and sc.models.policy != sc.models.serving:
        raise ValueError(f"scenario {sc.name}: serving.rollout=adapter trains a LoRA adapter of the serving "
                         f"model, so models.policy ({sc.models.policy}) must be models.serving "
                         f"({sc.models.serving})")
    if s.rollout == "adapter":
        try:
            MODELS[sc.models.serving].adapter_params(s.adapter_rank)
        except ValueError as exc:   # a rank above a projection's smaller side
            raise ValueError(f"scenario {sc.name}: serving.adapter_rank: {exc}") from None
    need(c.train_gpus >= c.rollout_tp and c.train_gpus % c.rollout_tp == 0, "cluster.train_gpus",
         f"a positive multiple of rollout_tp ({c.rollout_tp})", c.train_gpus)
    for key, value, tp in (("cluster.rollout_gpus", c.rollout_gpus, c.rollout_tp),
                           ("cluster.serving_gpus", c.serving_gpus, c.serving_tp)):
        need(value >= 0 and value % tp == 0, key, f"a non-negative multiple of its tp ({tp})", value)
    need(r.trajectories >= r.group and r.trajectories % r.group == 0, "rl.trajectories",
         f"a positive multiple of rl.group ({r.group})", r.trajectories)
    for key, value in (("cluster.cross_gbps", c.cross_gbps), ("serving.load", s.load),
                       ("serving.prompt_scale", s.prompt_scale), ("serving.output_scale", s.output_scale),
                       ("serving.spike_s", s.spike_s),
                       ("sim.tick_s", sc.sim.tick_s), ("rl.demand_sigma", r.demand_sigma + 1e-12),
                       ("elastic.spot_mean_lifetime_h", sc.elastic.spot_mean_lifetime_h),
                       ("elastic.serverless_storage_gbps", sc.elastic.serverless_storage_gbps),
                       ("elastic.serverless_max_run_s", sc.elastic.serverless_max_run_s)):
        need(value > 0, key, "positive", value)
    need(s.engine_overhead_ms >= 0, "serving.engine_overhead_ms", ">= 0", s.engine_overhead_ms)
    need(0 <= s.engine_host_share <= 1, "serving.engine_host_share", "between 0 and 1", s.engine_host_share)
    need(s.target_p99_tpot_ms >= 0, "serving.target_p99_tpot_ms", ">= 0 (0: not stated)",
         s.target_p99_tpot_ms)
    need(not (s.target_p99_tpot_ms and s.engine_overhead_ms), "serving.engine_overhead_ms",
         "0 with serving.target_p99_tpot_ms (which solves it)", s.engine_overhead_ms)
    unmodelled = [k for k in s.executor.changed() if k not in SIMULATED_SETTINGS]
    if unmodelled:
        raise ValueError(f"scenario {sc.name}: serving.executor.{unmodelled[0]} is not simulated (only "
                         f"{', '.join(SIMULATED_SETTINGS)} are); leave it at its default")
    need(r.fixed_concurrency >= 0, "rl.fixed_concurrency", ">= 0", r.fixed_concurrency)
    need(s.spike_at_s is None or s.spike_at_s >= 0, "serving.spike_at_s", ">= 0 or null", s.spike_at_s)
    need(s.replay_start_s is None or (s.replay_start_s >= 0 and s.spike_at_s is None),
         "serving.replay_start_s", ">= 0 or null, and null with serving.spike_at_s", s.replay_start_s)
    need(s.replay_start_s is None or s.minute_peak_to_mean == 1, "serving.minute_peak_to_mean",
         "1.0 with serving.replay_start_s (a flat day)", s.minute_peak_to_mean)
    need(s.spike_at_s is None or s.minute_peak_to_mean == 1, "serving.minute_peak_to_mean",
         "1.0 with serving.spike_at_s (a flat day: the diurnal curve would move the spike)",
         s.minute_peak_to_mean)
    need(r.step_after_burst_s >= 0, "rl.step_after_burst_s", ">= 0", r.step_after_burst_s)
    need(sc.sim.duration_s >= 0, "sim.duration_s", ">= 0", sc.sim.duration_s)
    need(sc.sim.serving_model in ("requests", "aggregate"), "sim.serving_model", "requests or aggregate",
         sc.sim.serving_model)
    need(sc.sim.rollout_model in ("turns", "batched"), "sim.rollout_model", "turns or batched",
         sc.sim.rollout_model)
    if sc.sim.rollout_model == "batched":
        unbatched = [x for x in sc.sim.systems if x in SYSTEMS and not batchable(SYSTEMS[x])]
        need(not unbatched, "sim.systems", "systems sim.rollout_model=batched simulates (the synchronous "
             "ones with fixed per-worker caps: fixed-sync, rose, rose-no-affinity, rose-full-weights, "
             "naive-share, static-split; not the asynchronous ones, whose training pauses or splits the "
             "dedicated devices, nor the elastic ones)", sc.sim.systems)
        need(r.fixed_concurrency > 0, "rl.fixed_concurrency",
             "> 0 with sim.rollout_model=batched (its slots)", r.fixed_concurrency)
    need(sc.sim.serving_model == "requests" or s.spike_at_s is None, "serving.spike_at_s",
         "null with sim.serving_model=aggregate (a spike's figures need every request)", s.spike_at_s)
    idle = [x for x in sc.sim.systems if SYSTEMS.get(x) and SYSTEMS[x].colocated
            and SYSTEMS[x].extra is Extra.NONE]
    need(c.trainer_rolls_out or c.rollout_gpus or not idle, "cluster.trainer_rolls_out",
         f"true where a system has no other rollout GPUs (cluster.rollout_gpus 0; {', '.join(idle)})",
         c.trainer_rolls_out)
    need(c.async_rollout_fraction == -1 or 0 < c.async_rollout_fraction < 1,
         "cluster.async_rollout_fraction", "in (0, 1), or -1 (balanced)", c.async_rollout_fraction)
    cp = sc.control_plane
    need(cp.transport in TRANSPORTS, "control_plane.transport", " or ".join(TRANSPORTS), cp.transport)
    need(cp.driver_cores >= 0, "control_plane.driver_cores", ">= 0 (0: unlimited)", cp.driver_cores)
    need(not (c.manager_on_dedicated and cp.driver_cores), "control_plane.driver_cores",
         "0 with cluster.manager_on_dedicated (the driver has the dedicated devices' cores)", cp.driver_cores)
    need(0 < sc.sync.changed_fraction < 1, "sync.changed_fraction", "in (0, 1)", sc.sync.changed_fraction)
    need(s.max_context == 0 or s.max_context > s.max_output + 1 >= 2, "serving.max_context",
         "0 (no clipping) or above serving.max_output + 1 (with max_output >= 1)", s.max_context)
    need(s.minute_peak_to_mean >= 1, "serving.minute_peak_to_mean", ">= 1", s.minute_peak_to_mean)
    need(0 <= s.start_hour < 24, "serving.start_hour", "in [0, 24)", s.start_hour)
    need(sc.elastic.spot_prepare_min_s <= sc.elastic.spot_prepare_max_s, "elastic.spot_prepare_max_s",
         ">= spot_prepare_min_s", sc.elastic.spot_prepare_max_s)
    need(sc.elastic.spot_finalize_min_s <= sc.elastic.spot_finalize_max_s,
         "elastic.spot_finalize_max_s", ">= spot_finalize_min_s", sc.elastic.spot_finalize_max_s)
    for f in ENV_FIELDS:
        value = getattr(r, f)
        need(value is None or value > 0 or (f == "env_step_s" and value == 0), f"rl.{f}",
             "positive (or null for the environment's default)", value)
    k = sc.sim.slice
    need(k >= 1, "sim.slice", ">= 1", k)
    for key, value, unit in (("cluster.train_gpus", c.train_gpus, c.rollout_tp),
                             ("cluster.rollout_gpus", c.rollout_gpus, c.rollout_tp),
                             ("cluster.serving_gpus", c.serving_gpus, c.serving_tp),
                             ("rl.trajectories", r.trajectories, r.group)):
        need(value % (k * unit) == 0, key, f"divisible by sim.slice x {unit} ({k * unit})", value)
    need(sc.elastic_gpus % (k * c.rollout_tp) == 0, "elastic.max_gpus",
         f"divisible by sim.slice x rollout_tp ({k * c.rollout_tp})", sc.elastic_gpus)
    unknown = [x for x in sc.sim.systems if x not in SYSTEMS]
    need(not unknown and sc.sim.systems, "sim.systems", f"a non-empty list from {', '.join(SYSTEMS)}",
         sc.sim.systems)
    return sc


def apply_overrides(sc: Scenario, overrides: Sequence[str]) -> Scenario:
    """`key=value` dotted overrides, type-checked against the dataclasses, then validated."""
    return validate(load(sc, overrides=overrides, label=f"scenario {sc.name}"))


# The paper's serving fleet, stated as its Table 1 states it: serving alone's P99 TPOT (117.8 ms for
# Qwen2.5-7B, 312.8 ms for Qwen2.5-32B), at the trace's own rate per replica; the serving engine's
# time per iteration beyond the roofline is solved for it (docs/reproducing-the-paper.md, "The
# serving fleet"). Its iterations prefill up to vLLM's default token budget for its OpenAI server on
# a GPU of 70 GiB or more (`max_num_batched_tokens`): the paper's executor lives inside vLLM 0.10.0.
VLLM_SERVER_BATCHED_TOKENS = 8192
# paper-8b's serving engine beyond the roofline as its `serving.target_p99_tpot_ms` solves it (the
# summary's serving_engine_overhead_ms), for scenarios that state the same engine.
PAPER_8B_ENGINE_OVERHEAD_MS = 57.5
# That time is the engine's host work with the GPU idle (`serving.engine_host_share`): were the GPU
# busy through it, serving alone would keep it busy all the time; the paper's serving clusters
# average 18.9% SM utilisation, and with it idle serving alone keeps it busy about 31%.
PAPER_ENGINE_HOST_SHARE = 1.0
# The paper scenarios' driver: its rollout manager is one Python process, which the interpreter's
# lock keeps to one core whatever its node has.
PAPER_DRIVER_CORES = 1.0
# fleet-day's, an assumption: at 10,000 GPUs the manager sharded, a process a core on its driver's
# node, 16 of them, a quarter of a 64-core host (the rest for the environments, Ray and the
# trainer's driver).
FLEET_DRIVER_CORES = 16.0


def _paper_8b() -> Scenario:
    return Scenario(
        name="paper-8b",
        description="Qwen3-8B (thinking) on FrozenLake, GRPO, 256 prompts x group 16; 48 H800 training "
                    "GPUs, 64 H800 serving Qwen2.5-7B under the Azure conversation trace; 16 trajectories "
                    "per rollout GPU",
        serving=ServingFleetConfig(target_p99_tpot_ms=117.8, engine_host_share=PAPER_ENGINE_HOST_SHARE,
                                   executor=ExecutorConfig(slo_ttft_ms=500.0, slo_tpot_ms=150.0,
                                                           chunk_tokens=VLLM_SERVER_BATCHED_TOKENS)),
        rl=RLConfig(steps=4, response_median=FROZENLAKE_THINKING_MEDIAN, max_response=8192,
                    fixed_concurrency=PAPER_TRAJECTORIES_PER_GPU, cap_counts="trajectories"),
        sim=SimConfig(tick_s=4.0, slice=4),
        control_plane=ControlPlaneConfig(driver_cores=PAPER_DRIVER_CORES),
    )


def _paper_32b() -> Scenario:
    return Scenario(
        name="paper-32b",
        description="Qwen3-32B on ALFWorld-like tasks, DAPO, 1,024 prompts x group 16; 48 H800 training "
                    "GPUs (TP 4), 64 H800 serving Qwen2.5-32B (TP 4); 16 trajectories per rollout GPU",
        cluster=ClusterConfig(rollout_tp=4, serving_tp=4),
        models=ModelsConfig(policy="qwen3-32b", serving="qwen2.5-32b"),
        serving=ServingFleetConfig(target_p99_tpot_ms=312.8, engine_host_share=PAPER_ENGINE_HOST_SHARE,
                                   executor=ExecutorConfig(slo_ttft_ms=1000.0, slo_tpot_ms=450.0,
                                                           chunk_tokens=VLLM_SERVER_BATCHED_TOKENS)),
        rl=RLConfig(env="alfworld", algorithm="dapo", trajectories=1024 * 16, group=16, steps=2,
                    fixed_concurrency=PAPER_TRAJECTORIES_PER_GPU * 4,    # a TP-4 replica: 4 GPUs
                    cap_counts="trajectories"),
        sim=SimConfig(tick_s=2.0, slice=4),
        control_plane=ControlPlaneConfig(driver_cores=PAPER_DRIVER_CORES),
    )


@dataclasses.dataclass(frozen=True)
class Sweep:
    """One key varied over values on a base scenario, with the systems it needs."""

    name: str
    description: str
    base: str
    key: str
    values: tuple[Any, ...]
    systems: tuple[str, ...]
    overrides: tuple[str, ...] = ()


def _cpu_bench_train() -> Scenario:
    # `rose bench train` on this machine, its figures read from the workload it runs, the named
    # config `bench-train` (rose/data/configs/bench-train.yaml; the full run, not --quick). Each
    # core is a `cpu` device: the dedicated one shared by the trainer, one rollout worker and the
    # driver (the rollout manager, pinned to the trainer's cores); the serving one replays the
    # trace and lends its idle capacity in rose mode. Weights: a Ray relay publish and pull of a
    # 0.4 MB model each step, assumed 0.2 s.
    bench = read_named_config("bench-train")
    m, r, t, d, s = bench["model"], bench["rollout"], bench["train"], bench["devices"], bench["serving"]
    executor = {k: v for k, v in s.get("executor", {}).items() if k in SIMULATED_SETTINGS}
    return Scenario(
        name="cpu-bench-train",
        description="rose bench train on this 2-core machine: core 0 trains, rolls out the tiny Qwen3 and "
                    "runs the rollout manager; core 1 serves the tiny Qwen2 under the Azure conversation "
                    "trace",
        cluster=ClusterConfig(device="cpu", train_gpus=len(d["dedicated"]), serving_gpus=len(d["serving"]),
                              cross_gbps=16.0, manager_on_dedicated=True),
        models=ModelsConfig(policy=f"{m['preset']}-{m['arch']}",
                            serving=f"{s['model']['preset']}-{s['model']['arch']}"),
        serving=ServingFleetConfig(trace=s["trace"], load=s["load"], prompt_scale=s["prompt_scale"],
                                   output_scale=s["output_scale"],
                                   max_context=s["max_context"], max_output=s["max_output"],
                                   minute_peak_to_mean=1.0, executor=ExecutorConfig(**executor)),
        # frozenlake-tiny: the measured profile of these episodes (rose.sim.workloads); a worker
        # never runs more sequences than the turns it has in flight; 2,048 batched tokens: the
        # engine's default (rose.engine.EngineConfig).
        rl=RLConfig(env="frozenlake-tiny", algorithm=t["objective"], steps=t["steps"],
                    trajectories=r["groups"] * r["group_size"], group=r["group_size"],
                    rollout_max_seqs=r["dedicated_concurrency"],
                    rollout_batched_tokens=2048, fixed_concurrency=r["dedicated_concurrency"],
                    max_response=r["max_tokens"], max_turns=bench["env"]["options"]["max_turns"]),
        sync=SyncConfig(colocated_switch_s=0.2),
        sim=SimConfig(tick_s=0.02, systems=["fixed-sync", "rose", "naive-share", "fixed-async-shared",
                                            "rose-async"]),
        # The benchmark streams each turn (the manager's measured cost per chunk, on core 0).
        control_plane=ControlPlaneConfig(transport="http"),
    )


def _cpu_bench_burst() -> Scenario:
    # `rose bench coserve --burst` on this machine, its defaults (rose/bench/burst.py; a test
    # holds the two together): one core serves the small Qwen2 over the 90 s window of the Azure
    # conversation trace (0.35 requests/s, prompts x 0.125, outputs at most 64, within 1,024
    # tokens) whose densest 20 s of KV tokens come 20 s in, on a 48 MiB pool, and lends it to 16
    # trajectories of the small Qwen3's 64-token turns; the next RL step begins 10 s after each
    # burst's trigger. No training device rolls out: the benchmark has the serving device alone.
    # Its static partition is the executor's `static` policy at its defaults (half the pool, 64
    # rollout tokens an iteration), as the benchmark's.
    # Its SLOs: the quiet run's (serving alone's P99s over the window x 1.5, docs/benchmarks.md).
    return Scenario(
        name="cpu-bench-burst",
        description="rose bench coserve --burst on this machine: one core serves the small Qwen2 through the "
                    "trace's densest 20 s on a 48 MiB pool and lends it to 16 rollout trajectories of the "
                    "small Qwen3",
        cluster=ClusterConfig(device="cpu", train_gpus=1, serving_gpus=1, cross_gbps=16.0,
                              trainer_rolls_out=False),
        models=ModelsConfig(policy="small-qwen3", serving="small-qwen2"),
        serving=ServingFleetConfig(load=0.35 / 5.53, prompt_scale=0.125, max_context=1024, max_output=64,
                                   minute_peak_to_mean=1.0, spike_at_s=20.0, spike_s=20.0,
                                   executor=ExecutorConfig(pool_mb=48.0, slo_ttft_ms=667.7,
                                                           slo_tpot_ms=32.8)),
        rl=RLConfig(env="coserve-backlog", steps=1, trajectories=16, group=16, demand_sigma=0.0,
                    fixed_concurrency=16, rollout_max_seqs=16, step_after_burst_s=10.0),
        sim=SimConfig(tick_s=0.02, duration_s=90.0, systems=["naive-share", "static-split", "rose"]),
        control_plane=ControlPlaneConfig(transport="http"),      # the lease API streams each turn
    )


def _cpu_bench_coserve() -> Scenario:
    # `rose bench coserve` on this machine, its defaults (rose/bench/coserve.py; a test holds the
    # two together): one core serves the small Qwen2 over 700 s of the Azure conversation trace from
    # 600 s in (0.35 requests/s, prompts x 0.125, outputs at most 64, within 1,024 tokens) on a
    # 512 MB pool, beside a saturating backlog of 16 trajectories of the small Qwen3's 64-token
    # turns (each keeps its slot; 256 trajectories outlast the window). No training device rolls
    # out. Its SLOs: serving alone's P99s x 1.5 in the run measured on the current engine
    # (docs/benchmarks.md).
    return Scenario(
        name="cpu-bench-coserve",
        description="rose bench coserve on this machine: one core serves the small Qwen2 for 700 s of the "
                    "trace on a 512 MB pool and lends it to 16 rollout trajectories of the small Qwen3",
        cluster=ClusterConfig(device="cpu", train_gpus=1, serving_gpus=1, cross_gbps=16.0,
                              trainer_rolls_out=False),
        models=ModelsConfig(policy="small-qwen3", serving="small-qwen2"),
        serving=ServingFleetConfig(load=0.35 / 5.53, prompt_scale=0.125, max_context=1024, max_output=64,
                                   minute_peak_to_mean=1.0, replay_start_s=600.0,
                                   executor=ExecutorConfig(pool_mb=512.0, slo_ttft_ms=517.7,
                                                           slo_tpot_ms=27.4)),
        rl=RLConfig(env="coserve-backlog", steps=1, trajectories=256, group=16, demand_sigma=0.0,
                    fixed_concurrency=16, rollout_max_seqs=16, cap_counts="trajectories"),
        sim=SimConfig(tick_s=0.02, duration_s=700.0, systems=["naive-share", "static-split", "rose"]),
        control_plane=ControlPlaneConfig(transport="http"),      # the lease API streams each turn
    )


def _fleet_day() -> Scenario:
    # paper-8b's models, SLOs, per-GPU workload (85 trajectories a training GPU, 3 serving GPUs to
    # each training GPU, as sweep-scale) on 10,000 H800s, every GPU simulated, through a whole
    # day of the diurnal trace from midnight: serving replicas in aggregate, rollouts in batches.
    # The serving engine is paper-8b's as solved for Table 1's P99 TPOT, stated (solving it again
    # here would fit the night's trough, not the paper's load). 30 s ticks, two a minute: the day
    # at 8-32 s ticks comes out within a few percent (docs/simulator.md), in under a minute.
    base = _paper_8b()
    return dataclasses.replace(
        base, name="fleet-day",
        description="paper-8b's models, SLOs and per-GPU workload on 2,500 training and 7,500 serving H800s, "
                    "24 h of the diurnal trace, every GPU simulated (aggregate serving, batched rollouts)",
        cluster=ClusterConfig(train_gpus=2500, serving_gpus=7500),
        serving=dataclasses.replace(base.serving, start_hour=0.0, target_p99_tpot_ms=0.0,
                                    engine_overhead_ms=PAPER_8B_ENGINE_OVERHEAD_MS),
        rl=dataclasses.replace(base.rl, trajectories=256 * round(85 * 2500 / 256), steps=1000),
        sim=SimConfig(tick_s=30.0, duration_s=86400.0, serving_model="aggregate", rollout_model="batched",
                      systems=["rose"]),
        control_plane=ControlPlaneConfig(driver_cores=FLEET_DRIVER_CORES))


SCENARIOS = {"paper-8b": _paper_8b, "paper-32b": _paper_32b, "cpu-bench-train": _cpu_bench_train,
             "cpu-bench-burst": _cpu_bench_burst, "cpu-bench-coserve": _cpu_bench_coserve,
             "fleet-day": _fleet_day}
SWEEPS: dict[str, Sweep] = {s.name: s for s in (
    Sweep("sweep-bandwidth", "cross-cluster bandwidth 10-200 Gb/s: sparse deltas against full weights",
          "paper-8b", "cluster.cross_gbps", (10, 25, 50, 100, 200),
          ("fixed-sync", "rose", "rose-full-weights"), ("rl.steps=2",)),
    Sweep("sweep-load", "serving load 0.5-2x the trace's rate per serving GPU, its engine solved at 1x",
          "paper-8b", "serving.load", (0.5, 1.0, 1.5, 2.0), ("fixed-sync", "rose"), ("rl.steps=2",)),
    Sweep("sweep-serving-gpus", "number of serving GPUs lent to rollouts",
          "paper-8b", "cluster.serving_gpus", (0, 16, 32, 64, 128), ("fixed-sync", "rose"),
          ("rl.steps=2",)),
    Sweep("sweep-scale", "cluster size: training GPUs and batch scaled together, 3x as many serving GPUs",
          "paper-8b", "cluster.train_gpus", (16, 64, 256),
          ("fixed-sync", "rose"), ("rl.steps=2",)),
)}


def scale_overrides(key: str, value: Any) -> list[str]:
    """Companion overrides that keep a sweep point sensible (cluster-size sweep)."""
    if key == "cluster.train_gpus":
        # paper-8b's load: ~85 trajectories per training GPU; each point simulates a 1/(gpus/16)
        # slice (16 training GPUs) of itself, so the cost of a point does not grow with the cluster.
        gpus = int(value)
        return [f"cluster.serving_gpus={3 * gpus}", f"rl.trajectories={256 * round(85 * gpus / 256)}",
                f"sim.slice={max(1, gpus // 16)}"]
    return []


def list_scenarios() -> list[tuple[str, str]]:
    return ([(name, make().description) for name, make in SCENARIOS.items()]
            + [(s.name, f"{s.description} ({s.key} in {list(s.values)})") for s in SWEEPS.values()])


def load_scenario(name: str, overrides: list[str] | None = None) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; expected one of "
                         f"{', '.join([*SCENARIOS, *SWEEPS])}")
    return apply_overrides(SCENARIOS[name](), list(overrides or []))
