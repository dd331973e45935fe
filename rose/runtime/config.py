"""`rose train`'s configuration: its dataclass schemas and the checks beyond types.

YAML files and dotted overrides are merged by the shared loader (`rose.config`). Everything that
can be wrong is checked before anything starts (no Ray, no model loads): an unknown key, a value
of the wrong type, more cores than the machine has, a checkpoint that is not there. Each failure
is one `ValueError` line naming the key and what is expected.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rose.config import load
from rose.coserve.executor import ExecutorConfig
from rose.engine.kv_pool import KVSpec
from rose.engine.vllm_engine import check_model
from rose.model.config import CheckpointError, ModelConfig
from rose.model.device import resolve
from rose.model.presets import ARCHS, PRESETS, init_model, preset_config
from rose.model.pretrained import PRETRAINED, init_pretrained, pretrained_config
from rose.rl import Objective
from rose.rl.envs import env_options, list_envs, make_env
from rose.rl.envs.heldout import SPLITS
from rose.rl.objective import OBJECTIVES
from rose.rl.trainer import COMPLETE_FILE, SHARDINGS, is_complete
from rose.runtime.devices import available_cores, cluster_address
from rose.runtime.loggers import LOGGERS, missing_package
from rose.runtime.placement import ROLES
from rose.runtime.rollouts import env_kwargs, load_rollout_function
from rose.traces import TRACE_NAMES

BACKENDS = ("native", "vllm")  # rollout.backend: the dedicated workers' engines


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

    @property
    def is_pretrained(self) -> bool:
        return self.path is not None or self.pretrained is not None

    def checkpoint(self, out: Path) -> Path:
        """`path`, else the `pretrained` model or a random `arch`/`preset` checkpoint written to `out`."""
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
    # DAPO's dynamic sampling: sample up to this many rounds of `groups` until that many groups
    # have outcomes that differ (1: one round, the trainer drops the uninformative groups).
    max_sampling_rounds: int = 1
    # The step's rollout, `package.module:function` (rose.runtime.rollouts): a user's own is one
    # async function of a RolloutContext returning a RolloutReport.
    function: str = "rose.runtime.rollouts:multi_turn_rollout"
    # The dedicated workers' engine (serving devices keep the native one): "native" (rose.engine)
    # or "vllm" (vLLM's, from the venv `make install-vllm` makes: docs/vllm.md).
    backend: str = "native"


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
    # The objective's settings; None keeps the named objective's own (docs/rl.md).
    scale_advantages: bool | None = None  # divide by the group's reward std (GRPO; not Dr. GRPO)
    kl_coef: float | None = None
    clip_ratio_c: float | None = None  # dual clip
    recompute_old_logprobs: bool | None = None  # and truncated importance sampling
    tis_cap: float | None = None
    max_version_lag: int | None = None  # tokens sampled more versions ago do not train (None: all do)
    overlong_max_tokens: int | None = None  # DAPO's overlong penalty, per response
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
    it, and its co-serving executor's SLOs and admission settings."""

    # A random Qwen2 unlike the policy by default; `path` serves a real checkpoint (SmolLM2).
    model: ModelSource = dataclasses.field(default_factory=lambda: ModelSource(arch="qwen2", seed=1))
    trace: str = "azure-conv"
    load: float = 0.5
    prompt_scale: float = 0.25
    output_scale: float = 0.25
    max_context: int = 512
    max_output: int = 64
    window_s: float = 10.0
    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 100.0
    # Co-serving admission (docs/coserve.md, "Admission"): the executor's defaults.
    admission_quantile: float = ExecutorConfig.admission_quantile
    tpot_inflation: float = ExecutorConfig.tpot_inflation
    ttft_inflation: float = ExecutorConfig.ttft_inflation
    pool_mb: int = 64
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
    """The embedded default, then the YAML file, then `key=value` overrides; validated."""
    config = load(Config, [path] if path is not None else [], overrides)
    validate(config)
    return config


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"config: {message}")


def validate(config: Config, mode: Mode | None = None) -> None:
    m, t, d, s = config.model, config.train, config.devices, config.serving
    _check_numbers(config)
    for key in DEVICE_KEYS:
        section, name = key.split(".")
        resolve(getattr(getattr(config, section), name), label=f"config: {key}: ")
    for key, model in (("model", m), ("serving.model", s.model)):
        _check(model.arch in ARCHS, f"{key}.arch must be one of {', '.join(ARCHS)}, got {model.arch!r}")
        _check(model.preset in PRESETS,
               f"{key}.preset must be one of {', '.join(PRESETS)}, got {model.preset!r}")
        _check(model.path is None or model.pretrained is None,
               f"{key}.path and {key}.pretrained both name the model; give one")
        _check(model.pretrained is None or model.pretrained in PRETRAINED,
               f"{key}.pretrained must be one of {', '.join(PRETRAINED)}, got {model.pretrained!r}")
        _check(model.path is None or (Path(model.path) / "config.json").is_file(),
               f"{key}.path {model.path} is not an HF-format checkpoint (expected a directory with "
               "config.json, safetensors and tokenizer files, e.g. from `rose init-model`)")
    _check_env(config)
    load_rollout_function(config.rollout.function)
    _check_backend(config)
    _check(t.objective in OBJECTIVES, f"train.objective must be one of {', '.join(OBJECTIVES)}, "
                                      f"got {t.objective!r}")
    try:
        Objective.named(t.objective, **objective_options(config))
    except ValueError as exc:  # "objective: NAME must ...": NAME is the train key of that name
        raise ValueError(f"config: {str(exc).replace('objective: ', 'train.', 1)}") from None
    _check_loggers(t.logger)
    _check(t.sharding in SHARDINGS,
           f"train.sharding must be one of {', '.join(SHARDINGS)}, got {t.sharding!r}")
    _check(t.lr_schedule in ("constant", "cosine"),
           f"train.lr_schedule must be constant or cosine, got {t.lr_schedule!r}")
    _check(s.trace in TRACE_NAMES or Path(s.trace).is_file(),
           f"serving.trace must be one of {', '.join(TRACE_NAMES)} or a trace file, got {s.trace!r}")
    _check(s.max_context >= s.max_output + 2, f"serving.max_context must exceed serving.max_output + 1 "
                                              f"(a prompt of at least one token), got {s.max_context} "
                                              f"and {s.max_output}")
    _check_fits(config)
    # Core ids and CUDA devices are this machine's: checked here in local mode; on a cluster
    # core lists count CPUs and Ray finds the GPUs (`rose.runtime.placement`).
    local = cluster_address(config.ray_address) is None
    trainer_device = resolve(t.device)[0]
    if local and trainer_device.type == "cuda" and t.data_parallel > 1:
        gpus = torch.cuda.device_count()
        _check(trainer_device.index is None and t.data_parallel <= gpus,
               f"train.data_parallel ({t.data_parallel}) ranks on cuda take one CUDA device each, cuda:0 "
               f"to cuda:{t.data_parallel - 1}: give train.device=cuda and at most {gpus} ranks")
    _check(bool(d.dedicated), "devices.dedicated needs at least one device")
    unknown = sorted(set(d.resources) - set(ROLES))
    _check(not unknown, f"devices.resources: no role {', '.join(unknown)}; the roles are {', '.join(ROLES)}")
    for role, asked in d.resources.items():
        _check(all(math.isfinite(v) and v >= 0 for v in asked.values()),
               f"devices.resources.{role}: amounts must be finite and >= 0, got {dict(asked)}")
    cores = available_cores()
    for name, devices in (("trainer", [d.trainer]), ("dedicated", d.dedicated), ("serving", d.serving),
                          ("elastic", d.elastic)):
        for device in devices:
            _check(bool(device), f"devices.{name}: a device needs at least one core")
            missing = sorted(set(device) - cores) if local else []
            _check(not missing, f"devices.{name} uses core(s) {missing}, but this machine has only "
                                f"{sorted(cores)}; give fewer devices or cores")
    if mode is Mode.ROSE:
        _check(bool(d.serving or s.endpoints),
               "mode rose needs at least one serving device (devices.serving) or endpoint "
               "(serving.endpoints)")
    for url in s.endpoints:
        _check(re.fullmatch(r"https?://[^/\s]+/?", url) is not None,
               f"serving.endpoints: {url!r} is not a server's URL (expected http://HOST:PORT)")
    if mode is Mode.ELASTIC:
        _check(bool(d.elastic), "mode elastic needs at least one device to add (devices.elastic)")


# The numeric fields' ranges: (low, high, low inclusive); every float must also be finite.
_RANGES: dict[str, tuple[float, float, bool]] = {
    **{f"rollout.{k}": (1, math.inf, True) for k in (
        "groups", "group_size", "max_tokens", "dedicated_concurrency", "serving_concurrency",
        "max_context_tokens", "kv_cache_mb", "max_sampling_rounds")},
    "rollout.temperature": (0, math.inf, True),  # 0: greedy
    "rollout.stall_timeout_s": (0, math.inf, False),
    "rollout.timeout_s": (0, math.inf, False),
    **{f"train.{k}": (1, math.inf, True) for k in (
        "steps", "checkpoint_every", "micro_batch_size", "data_parallel", "mini_batches")},
    "train.lr": (0, math.inf, False),
    "train.warmup_steps": (0, math.inf, True),
    "train.max_grad_norm": (0, math.inf, False),
    "train.weight_decay": (0, math.inf, True),
    "train.min_lr_ratio": (0, 1, True),
    "train.step_advantage_weight": (0, math.inf, True),
    "train.discount": (0, 1, True),
    "eval.every": (0, math.inf, True),
    "eval.episodes": (1, math.inf, True),
    "eval.temperature": (0, math.inf, True),  # 0: greedy
    "devices.provision_delay_s": (0, math.inf, True),
    **{f"serving.{k}": (0, math.inf, False) for k in (
        "load", "prompt_scale", "output_scale", "window_s", "slo_ttft_ms", "slo_tpot_ms")},
    **{f"serving.{k}": (1, math.inf, True) for k in ("max_context", "max_output", "pool_mb")},
    "serving.admission_quantile": (0, 1, False),
    "serving.tpot_inflation": (0, math.inf, True),
    "serving.ttft_inflation": (0, math.inf, True),
}


# Where a model runs: the dedicated workers, the trainer, the serving devices.
DEVICE_KEYS = ("rollout.device", "train.device", "serving.device")


def actor_device(device: str | None) -> str:
    """The device an actor runs its model on, resolved by the driver (None: its default) so that
    every actor of the run gets the same one, whatever its own process sees."""
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


def objective_options(config: Config) -> dict[str, Any]:
    """The settings the config gives `train.objective` (Dr. GRPO's length normaliser: the
    longest trajectory, rollout.max_context_tokens)."""
    given = {k: getattr(config.train, k) for k in _OBJECTIVE_KEYS if getattr(config.train, k) is not None}
    return {"norm_tokens": config.rollout.max_context_tokens, **given}


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
            "weight_decay": t.weight_decay, "sharding": t.sharding}


def _check_numbers(config: Config) -> None:
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if not dataclasses.is_dataclass(value):
            continue
        for field in dataclasses.fields(value):
            key, number = f"{section.name}.{field.name}", getattr(value, field.name)
            if number is None:  # left to a default
                continue
            if isinstance(number, float):
                _check(math.isfinite(number), f"{key} must be a finite number, got {number}")
            if key in _RANGES and number is not None:  # None: the default named beside the key
                low, high, inclusive = _RANGES[key]
                ok = (number >= low if inclusive else number > low) and number <= high
                bounds = (f"in [{low:g}, {high:g}]" if high < math.inf
                          else f"{'>=' if inclusive else '>'} {low:g}")
                _check(ok, f"{key} must be {bounds}, got {number}")


def _check_loggers(names: list[str]) -> None:
    for name in names:
        _check(name in LOGGERS, f"train.logger: unknown logger {name!r}; choose from {', '.join(LOGGERS)}")
        _check(names.count(name) == 1, f"train.logger names {name} more than once")
        package = missing_package(name)
        _check(package is None, f"train.logger: {name} needs the {package} package, which is not installed "
                                f"(pip install {package}), or leave {name} out")


def _check_backend(config: Config) -> None:
    backend = config.rollout.backend
    _check(backend in BACKENDS, f"rollout.backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "vllm":
        return
    _check(importlib.util.find_spec("vllm") is not None,
           "rollout.backend=vllm needs the vllm package, which is not installed in this Python: run "
           "`make install-vllm` and start the run from .venv-vllm (.venv-vllm/bin/rose train ...)")
    try:
        check_model(_context("model", config.model), str(resolve(config.rollout.device)[0]))
    except ValueError as exc:
        raise ValueError(f"config: rollout.backend=vllm: {exc} (model, rollout.device)") from None


def _check_env(config: Config) -> None:
    """The options against the environment's constructor, then one environment built with them
    (and, with evaluation on, a layout drawn from each split)."""
    env = config.env
    _check(env.name in list_envs(), f"env.name must be one of {', '.join(list_envs())}, got {env.name!r}")
    accepted = env_options(env.name)
    if accepted is not None:
        for key in env.options:
            _check(key in accepted, f"env.options.{key}: {env.name} has no option {key!r}; it accepts "
                                    f"{', '.join(accepted)}")
    try:
        make_env(env.name, **env.options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config: env.options: {exc}") from None
    if config.eval.every:
        try:
            for split in SPLITS:
                make_env(env.name, **env_kwargs(config, split)).reset(0)
        except (TypeError, ValueError) as exc:
            raise ValueError("config: eval.every needs an environment with held-out layouts: "
                             f"{exc}") from None


def _context(key: str, model: ModelSource) -> ModelConfig:
    """The model's configuration: its checkpoint's config.json, the pretrained model's, else the
    preset's."""
    try:
        if model.pretrained is not None:
            return pretrained_config(model.pretrained)
        return (ModelConfig.from_dir(model.path) if model.path is not None
                else preset_config(model.arch, model.preset))
    except FileNotFoundError as exc:  # the package that ships the pretrained model is not installed
        raise ValueError(f"config: {key}.pretrained: {exc}") from None
    except CheckpointError as exc:
        raise ValueError(f"config: {key}.{'path' if model.path else 'pretrained'}: {exc}") from None


def _pages(config: ModelConfig, tokens: int, device: str | None) -> int:
    spec = KVSpec.of(config, resolve(device)[1])  # the device's default dtype
    return -(-tokens // spec.block_size) * spec.block_bytes


def _check_fits(config: Config) -> None:
    """Contexts within the models' and one longest sequence within each KV cache: anything else
    fails only when a turn or request gets that long, or never finishes."""
    m, r, s = config.model, config.rollout, config.serving
    policy, serving = _context("model", m), _context("serving.model", s.model)
    _check(r.max_context_tokens <= policy.max_position_embeddings,
           f"rollout.max_context_tokens ({r.max_context_tokens}) exceeds the model's context "
           f"({policy.max_position_embeddings} tokens, max_position_embeddings)")
    _check(s.max_context <= serving.max_position_embeddings,
           f"serving.max_context ({s.max_context}) exceeds the serving model's context "
           f"({serving.max_position_embeddings} tokens)")
    _check(r.max_tokens < r.max_context_tokens,
           f"rollout.max_tokens ({r.max_tokens}) must be below rollout.max_context_tokens "
           f"({r.max_context_tokens}): a turn's prompt needs at least one token")
    need = _pages(policy, r.max_context_tokens, r.device)
    _check(r.kv_cache_mb << 20 >= need,
           f"rollout.kv_cache_mb ({r.kv_cache_mb}) cannot hold one sequence of rollout.max_context_tokens "
           f"({r.max_context_tokens}); it needs at least {-(-need // (1 << 20))} MB")
    need = _pages(policy, r.max_context_tokens, s.device) + _pages(serving, s.max_context, s.device)
    _check(s.pool_mb << 20 >= need,
           f"serving.pool_mb ({s.pool_mb}) cannot hold one serving request of serving.max_context "
           f"({s.max_context}) beside one rollout turn of rollout.max_context_tokens; it needs at least "
           f"{-(-need // (1 << 20))} MB")


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete `step-N` checkpoint in a run's `out_dir`; torn ones (a save that
    crashed, with no completion marker) are passed over."""
    steps = [(int(m.group(1)), p) for p in Path(out_dir).glob("step-*")
             if (m := re.fullmatch(r"step-(\d+)", p.name)) and is_complete(p)]
    return max(steps)[1] if steps else None


def resume_checkpoint(resume: str | Path | None) -> Path | None:
    """The checkpoint to resume from: `resume` itself or its newest complete `step-*` directory."""
    if resume is None:
        return None
    path = Path(resume)
    if (path / "config.json").is_file():
        if not is_complete(path):
            raise ValueError(f"--resume {resume}: not a complete checkpoint (no {COMPLETE_FILE}: a save "
                             "that did not finish); give the run's out_dir to take its newest complete one")
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(f"--resume {resume}: no complete checkpoint there (expected a checkpoint or "
                         f"step-N/ dirs holding {COMPLETE_FILE})")
    return latest
