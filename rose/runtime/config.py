"""`rose train`'s configuration: its dataclass schemas, loaded and checked.

YAML files and dotted overrides are merged by the shared loader (`rose.config`). Everything that
can be wrong is checked before anything starts (no Ray, no model loads; `rose.runtime.checks`):
an unknown key, a value of the wrong type, more cores than the machine has, a checkpoint that is
not there. Each failure is one `ValueError` line naming the key and what is expected. This module
loads no torch, nor the model, RL or engine code: the checks import them when they run.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rose.config import load
from rose.contracts.adapter import LoRAConfig
from rose.coserve.settings import Engine, ExecutorConfig

BACKENDS = ("native", "vllm")  # rollout.backend: the dedicated workers' engines


class ServingRollout(str, enum.Enum):
    """What runs a serving device's rollout turns (`serving.rollout`)."""

    MODEL = "model"  # a rollout model of the policy's own beside the serving model
    # The serving model itself, the policy's LoRA adapter on its turns' rows (model.lora on the
    # serving model's checkpoint): one set of weights, one forward, each sync the adapter alone.
    ADAPTER = "adapter"


class Mode(enum.Enum):
    FIXED = "fixed"  # dedicated devices only
    ELASTIC = "elastic"  # plus devices started on demand, each paying start-up and provisioning
    ROSE = "rose"  # plus the idle capacity of serving devices


@dataclasses.dataclass
class ModelSource:
    """A model of the run (`model:`, the policy; `serving.model:`): a preset's random weights, a
    checkpoint, or a packaged pretrained model."""

    arch: str = "qwen3"
    preset: str = "tiny"
    seed: int = 0
    path: str | None = None  # an existing HF-format checkpoint instead of a random one
    # A packaged pretrained model (rose.model.pretrained, e.g. smollm2-135m-instruct), imported
    # into the run's directory when it starts: `rose init-model --preset` without the extra step.
    pretrained: str | None = None
    # The policy only: train a LoRA adapter on this model, frozen (rose.model.lora; rank, alpha,
    # dropout, targets by module name, the attention and MLP projections by default). Rollout
    # engines run the base with the adapter, and each weight sync carries the adapter alone.
    lora: LoRAConfig | None = None

    @property
    def is_pretrained(self) -> bool:
        return self.path is not None or self.pretrained is not None

    def identity(self) -> tuple[str, ...]:
        """What names the weights `checkpoint` gives: the resolved path, the pretrained model, or
        the random preset and its seed. Two sources of one identity hold the same weights."""
        if self.path is not None:
            return ("path", str(Path(self.path).resolve()))
        if self.pretrained is not None:
            return ("pretrained", self.pretrained)
        return ("preset", self.arch, self.preset, str(self.seed))

    def checkpoint(self, out: Path) -> Path:
        """`path`, else the `pretrained` model or a random `arch`/`preset` checkpoint written to `out`."""
        from rose.model.presets import init_model
        from rose.model.pretrained import init_pretrained

        if self.path is not None:
            return Path(self.path)
        if self.pretrained is not None:
            return init_pretrained(self.pretrained, out)
        return init_model(self.arch, self.preset, out, seed=self.seed)


@dataclasses.dataclass
class EnvConfig:
    name: str = "frozenlake"
    options: dict[str, Any] = dataclasses.field(
        # The recipe measured in docs/rl.md (tiny policy 0.00 -> 0.92 success in 64 steps).
        default_factory=lambda: {"size": 4, "slippery": False, "progress_reward": 0.5, "max_turns": 8})


@dataclasses.dataclass
class RolloutConfig:
    groups: int = 8  # prompts (environment seeds) per step
    group_size: int = 8  # samples per prompt (GRPO's group)
    max_tokens: int = 1  # per turn: one action word
    temperature: float = 1.0
    max_context_tokens: int = 1536
    dedicated_concurrency: int = 16  # turns in flight per dedicated worker (beyond: spill or queue)
    serving_concurrency: int = 16  # per serving executor
    stall_timeout_s: float = 2.0
    timeout_s: float = 900.0
    kv_cache_mb: int = 64
    # The dedicated workers' engines (None: cuda if there is one, else cpu; bfloat16 on cuda).
    device: str | None = None
    # Asynchronous RL (train.max_staleness >= 1): groups a step starts beyond the `groups` it
    # trains on; a step closes when `groups` have finished, and the rest carry over to the next
    # (None: a quarter of `groups`, at least 1).
    extra_groups: int | None = None
    # Dynamic sampling: sample up to this many rounds of `groups` until that many groups have
    # outcomes that differ (1: one round, the trainer drops the uninformative groups). None:
    # DAPO_SAMPLING_ROUNDS with train.objective dapo (its dynamic sampling refills the batch), else 1.
    max_sampling_rounds: int | None = None
    # The step's rollout, `package.module:function` (rose.runtime.rollouts): a user's own is one
    # async function of a RolloutContext returning a RolloutReport.
    function: str = "rose.runtime.rollouts:multi_turn_rollout"
    # The default rollout's agent, `package.module:function` (rose.rollout.agent): an async
    # function of a TurnHandle and an Episode of the config's environment returning its
    # Trajectory. `rose.rollout.agent:tool_episode` lets the policy call `tools` before it answers.
    agent: str = "rose.rollout.agent:play_episode"
    # Tools offered in every prompt (rose.tools.sandbox.TOOLS: python, calculator).
    tools: list[str] = dataclasses.field(default_factory=list)
    # The dedicated workers' engine (the serving devices': serving.engine): "native" (rose.engine)
    # or "vllm" (vLLM's, from the venv `make install-vllm` makes: docs/vllm.md).
    backend: str = "native"
    # The control plane's shards (rose.runtime.shards): 1 routes every turn from the driver;
    # K > 1 starts K Ray actors, each playing every K-th group and routing its turns to every device.
    shards: int = 1


@dataclasses.dataclass
class EvalConfig:
    """Success on held-out layouts: with `every` > 0 the environment (one that generates its
    maps or levels, with a `split` option) trains on the "train" split of its layouts and is
    evaluated on the "eval" split, which training never draws (rose.rl.envs.heldout)."""

    every: int = 0  # steps between evaluations, from step 0 (and at the last step); 0: none
    episodes: int = 64  # the same seeds, hence the same maps, at every evaluation
    # None: rollout.temperature, so that held-out and training success measure the same policy (a
    # tiny policy's greedy argmax can fail every map while its samples succeed: docs/rl.md); 0: greedy.
    temperature: float | None = None


@dataclasses.dataclass
class TrainConfig:
    steps: int = 100
    objective: str = "grpo"  # grpo, dr_grpo or dapo (docs/rl.md, "The objective")
    # 0: synchronous (rollouts, then training, then the weight sync). K >= 1: asynchronous: groups
    # keep playing on every device while the trainer trains (rose.rollout.stream), none starting
    # more than K versions before the step meant to train on it; then recompute_old_logprobs
    # (truncated importance sampling) is on and max_version_lag is K unless given.
    max_staleness: int = 0
    # The objective's settings; None keeps the named objective's own (docs/rl.md).
    scale_advantages: bool | None = None  # divide by the group's reward std (GRPO; not Dr. GRPO)
    kl_coef: float | None = None
    clip_ratio_c: float | None = None  # dual clip
    recompute_old_logprobs: bool | None = None  # and truncated importance sampling
    tis_cap: float | None = None
    max_version_lag: int | None = None  # tokens sampled more versions ago do not train (None: all do)
    # DAPO's overlong penalty, per response (None: with objective dapo, rollout.max_tokens, the
    # cap a response meets; else none) and its soft ramp (None: a fifth of it, DAPO's 4,096 of 20,480).
    overlong_max_tokens: int | None = None
    overlong_cache_tokens: int | None = None
    step_advantage_weight: float = 0.0  # GiGPO's step-level credit (rose.rl.objective); 0: off
    discount: float = 0.95  # of the returns-to-go the step level compares
    # None: the policy's default (`model_defaults`: a random preset's or a pretrained checkpoint's);
    # `rose train` says which it chose.
    lr: float | None = None
    lr_schedule: str = "cosine"  # down to lr * min_lr_ratio at train.steps, or "constant"
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # None: the policy's default, as lr
    max_grad_norm: float = 1.0
    weight_decay: float = 0.01
    micro_batch_size: int = 32
    data_parallel: int = 1  # trainer ranks, each a Ray actor on its share of devices.trainer
    # How the ranks hold the policy: ddp (a whole copy each) or fsdp (FSDP2: 1/N of the weights,
    # gradients and optimizer state each, for a model one device cannot hold with its optimizer).
    sharding: str = "ddp"
    # fp32 master weights there, bf16 compute on cuda (None: cuda if there is one, else cpu)
    device: str | None = None
    mini_batches: int = 4  # optimizer updates per step (docs/rl.md: 2 learned more slowly)
    checkpoint_every: int = 10
    out_dir: str = "runs/train"
    seed: int = 0
    # Where each step's record goes as it ends (rose.runtime.loggers): console, jsonl
    # (out_dir/metrics.jsonl), tensorboard, wandb.
    logger: list[str] = dataclasses.field(default_factory=lambda: ["console", "jsonl"])


@dataclasses.dataclass
class DevicesConfig:
    trainer: list[int] = dataclasses.field(default_factory=lambda: [0])
    dedicated: list[list[int]] = dataclasses.field(default_factory=lambda: [[0]])
    serving: list[list[int]] = dataclasses.field(default_factory=lambda: [[1]])  # rose mode
    elastic: list[list[int]] = dataclasses.field(default_factory=lambda: [[1]])  # elastic mode
    provision_delay_s: float = 5.0  # elastic: waiting for an allocation, before the real start-up
    # On a Ray cluster the run joins, each role's custom Ray resources (trainer, dedicated,
    # serving, elastic: rose/runtime/placement.py), e.g. {serving: {serving: 1}}; a device's
    # core list then counts the CPUs its actor asks for.
    resources: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ServingDeviceConfig:
    """What each serving device runs in rose mode: the serving model, the trace replayed against
    it, and its co-serving executor."""

    # A random Qwen2 unlike the policy by default; `path` serves a real checkpoint (SmolLM2).
    model: ModelSource = dataclasses.field(default_factory=lambda: ModelSource(arch="qwen2", seed=1))
    trace: str = "azure-conv"
    load: float = 0.5
    prompt_scale: float = 0.25
    output_scale: float = 0.25
    max_context: int = 512
    max_output: int = 64
    window_s: float = 10.0
    # A spike on purpose: the replay starts where the trace's own spike (the `spike_s` seconds in
    # which the most KV tokens arrive, as replayed) comes `spike_at_s` seconds after it starts
    # (None: at the trace's start). On a pool the spike overfills, the executor takes the rollouts'
    # pages back (a burst: docs/rl.md, "A burst during training").
    spike_at_s: float | None = None
    spike_s: float = 20.0
    # The executor's settings, as `rose serve`'s (SLOs, pool, admission: docs/coserve.md); its
    # lease slots are rollout.serving_concurrency, the turns the run keeps on each device.
    executor: ExecutorConfig = dataclasses.field(default_factory=ExecutorConfig)
    # What serves the serving model: native (ROSE's engine, one KV pool for both models) or vllm
    # (vLLM's, from .venv-vllm, its KV cache `executor.serving_pool_share` of the pool, the rollout
    # model's the rest), as `rose serve --engine`; the rollout model runs on ROSE's engine either way.
    engine: Engine = Engine.NATIVE
    # What runs the rollout turns lent to the device: `model` (a rollout model, the policy's
    # weights, beside the serving model) or `adapter` (the serving model itself with the policy's
    # LoRA adapter: needs model.lora on the serving model's checkpoint, and the native engine).
    rollout: ServingRollout = ServingRollout.MODEL
    device: str | None = None  # both models (None: cuda if there is one, else cpu; bfloat16 on cuda)
    # `rose serve` processes started on their own (a serving team's replicas), attached by URL
    # beside or instead of `devices.serving`: turns are leased there and the policy's weights
    # pushed there with `endpoint_key` (their lease key; `${oc.env:ROSE_LEASE_KEY}` reads it from
    # the environment). The run neither starts nor stops them, nor replays a trace against them.
    endpoints: list[str] = dataclasses.field(default_factory=list)
    endpoint_key: str | None = None


@dataclasses.dataclass
class Config:
    model: ModelSource = dataclasses.field(default_factory=ModelSource)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    devices: DevicesConfig = dataclasses.field(default_factory=DevicesConfig)
    serving: ServingDeviceConfig = dataclasses.field(default_factory=ServingDeviceConfig)
    ray_address: str | None = None  # None: a local Ray instance started on demand


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The embedded default, then the YAML file, then `key=value` overrides; validated. The
    default `env.options` apply to the default environment only."""
    files = [path] if path is not None else []
    config = load(Config, files, overrides)
    if config.env.name != EnvConfig.name:
        # The default options are the FrozenLake recipe's: another environment starts from its own.
        given = load(Config(env=EnvConfig(options={})), files, overrides).env.options
        config.env = dataclasses.replace(config.env, options=given)
    validate(config)
    return config


def validate(config: Config, mode: Mode | None = None) -> None:
    """Every check beyond types (`mode`'s too, when given); a ValueError naming the key."""
    from rose.runtime.checks import check_config  # the model, RL and engine code, and torch

    check_config(config, mode)


def actor_device(device: str | None) -> str:
    """The device an actor runs its model on, resolved by the driver (None: its default) so that
    every actor of the run gets the same one, whatever its own process sees."""
    from rose.model.device import resolve

    return str(resolve(device)[0])


def rank_device(device: str | None, rank: int, world: int, local: bool = True) -> str:
    """Data-parallel trainer rank `rank`'s device: on CUDA one each (cuda:RANK on this machine;
    NCCL needs distinct devices; on a cluster Ray gives each rank its own GPU, which it sees as
    `cuda`), else `device` for all."""
    resolved = actor_device(device)
    return f"cuda:{rank}" if local and world > 1 and resolved.startswith("cuda") else resolved

_OBJECTIVE_KEYS = ("scale_advantages", "kl_coef", "clip_ratio_c", "recompute_old_logprobs", "tis_cap",
                   "max_version_lag", "overlong_max_tokens", "overlong_cache_tokens", "step_advantage_weight",
                   "discount")


# Sampling rounds DAPO's dynamic sampling may play to fill a step's batch with informative groups:
# a step whose groups keep agreeing trains on what it has after at most this many times its rollouts.
DAPO_SAMPLING_ROUNDS = 8


def objective_options(config: Config) -> dict[str, Any]:
    """The settings the config gives `train.objective` (Dr. GRPO's length normaliser: the
    longest trajectory, rollout.max_context_tokens; DAPO's overlong limit: the responses' cap,
    rollout.max_tokens, where the paper's 20,480 would never apply)."""
    given = {k: getattr(config.train, k) for k in _OBJECTIVE_KEYS if getattr(config.train, k) is not None}
    dapo, k = config.train.objective == "dapo", config.train.max_staleness
    limit = given.get("overlong_max_tokens", config.rollout.max_tokens if dapo else None)
    overlong = {} if limit is None else {
        "overlong_max_tokens": limit, "overlong_cache_tokens": given.get("overlong_cache_tokens", limit // 5)}
    # Off-policy tokens under asynchronous RL: weighed against the trainer's own old policy, and
    # masked beyond the staleness bound.
    off_policy = {"recompute_old_logprobs": True, "max_version_lag": k} if k else {}
    return {"norm_tokens": config.rollout.max_context_tokens, **off_policy, **given, **overlong}


def extra_groups(config: Config) -> int:
    """`rollout.extra_groups`, or its default: a quarter of `rollout.groups`, at least 1."""
    r = config.rollout
    return max(1, r.groups // 4) if r.extra_groups is None else r.extra_groups


def sampling_rounds(config: Config) -> int:
    """`rollout.max_sampling_rounds`, or its default for `train.objective`."""
    rounds = config.rollout.max_sampling_rounds
    if rounds is not None:
        return rounds
    return DAPO_SAMPLING_ROUNDS if config.train.objective == "dapo" else 1


@dataclasses.dataclass(frozen=True)
class ModelDefaults:
    """The optimizer settings a run gets where its config gives none, and why."""

    lr: float
    warmup_steps: int
    why: str


# The recipe measured in docs/rl.md: a random 0.1 M-parameter policy learns FrozenLake at 3e-3.
RANDOM_MODEL_DEFAULTS = ModelDefaults(3e-3, 0, "a random model.preset initialised by the run: the tiny-model "
                                               "recipe of docs/rl.md")
# verl's actor default lr (actor.optim.lr), the one DeepSeekMath's GRPO and DAPO (after a 20-step
# warmup) trained their policies at, with the 10 warmup steps of verl's DAPO recipe (recipe/dapo):
# Adam's first moments are noise, and full-size steps at the tiny recipe's 3e-3 would wreck a
# pretrained policy.
PRETRAINED_DEFAULTS = ModelDefaults(1e-6, 10, "model.path or model.pretrained is a pretrained model: "
                                              "verl's actor lr and its DAPO recipe's warmup")


def model_defaults(model: ModelSource) -> ModelDefaults:
    return PRETRAINED_DEFAULTS if model.is_pretrained else RANDOM_MODEL_DEFAULTS


def chosen_defaults(config: Config) -> dict[str, Any]:
    """The keys the config leaves to the policy's default, with the values chosen and why
    (empty when it sets them all): what the run prints and reports."""
    defaults, t = model_defaults(config.model), config.train
    chosen = {f"train.{k}": getattr(defaults, k) for k in ("lr", "warmup_steps") if getattr(t, k) is None}
    return {**chosen, "why": defaults.why} if chosen else {}


def trainer_options(config: Config) -> dict[str, Any]:
    """The run's `TrainerConfig` settings: train.* as given, the policy's defaults where unset."""
    t, defaults = config.train, model_defaults(config.model)
    return {"lr": defaults.lr if t.lr is None else t.lr,
            "warmup_steps": defaults.warmup_steps if t.warmup_steps is None else t.warmup_steps,
            "micro_batch_size": t.micro_batch_size, "mini_batches": t.mini_batches,
            "min_lr_ratio": t.min_lr_ratio, "lr_decay_steps": t.steps if t.lr_schedule == "cosine" else 0,
            "temperature": config.rollout.temperature, "max_grad_norm": t.max_grad_norm,
            "weight_decay": t.weight_decay, "sharding": t.sharding, "lora": config.model.lora}


# The adapter's name on every rollout engine of a LoRA run (model.lora): the turns name it.
POLICY_ADAPTER = "policy"


def policy_adapter(config: Config) -> str | None:
    """The adapter the run's turns name, or None when the policy is the whole model."""
    return POLICY_ADAPTER if config.model.lora is not None else None


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete `step-N` checkpoint in a run's `out_dir`; torn ones (a save that
    crashed, with no completion marker) are passed over."""
    from rose.rl.trainer import is_complete

    steps = [(int(m.group(1)), p) for p in Path(out_dir).glob("step-*")
             if (m := re.fullmatch(r"step-(\d+)", p.name)) and is_complete(p)]
    return max(steps)[1] if steps else None


def resume_checkpoint(resume: str | Path | None) -> Path | None:
    """The checkpoint to resume from: `resume` itself or its newest complete `step-*` directory."""
    from rose.model.lora import is_adapter
    from rose.rl.trainer import COMPLETE_FILE, is_complete

    if resume is None:
        return None
    path = Path(resume)
    if (path / "config.json").is_file() or is_adapter(path):
        if not is_complete(path):
            raise ValueError(f"--resume {resume}: not a complete checkpoint (no {COMPLETE_FILE}: a save "
                             "that did not finish); give the run's out_dir to take its newest complete one")
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(f"--resume {resume}: no complete checkpoint there (expected a checkpoint or "
                         f"step-N/ dirs holding {COMPLETE_FILE})")
    return latest
