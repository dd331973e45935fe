"""The checks of `rose train`'s configuration beyond types (`rose.runtime.config.validate`).

They read the model presets and checkpoints, the environments, the objectives and the engine's
KV layout, whose modules load torch: `rose.runtime.config` imports this module only when a
config is checked, so that its schemas load without them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from pathlib import Path

import torch

from rose.coserve.settings import Engine
from rose.engine.kv_pool import KVSpec
from rose.engine.vllm_engine import BLOCK_SIZE, check_model
from rose.model.config import CheckpointError, ModelConfig
from rose.model.device import resolve
from rose.model.presets import ARCHS, PRESETS, preset_config
from rose.model.pretrained import PRETRAINED, pretrained_config
from rose.rl import Objective
from rose.rl.envs import env_options, list_envs, make_env
from rose.rl.envs.heldout import SPLITS
from rose.rl.objective import OBJECTIVES
from rose.rl.trainer import SHARDINGS
from rose.rollout.agent import load_agent
from rose.runtime.config import (
    BACKENDS,
    Config,
    Mode,
    ModelSource,
    RolloutConfig,
    ServingRollout,
    objective_options,
)
from rose.runtime.devices import available_cores, cluster_address
from rose.runtime.loggers import LOGGERS, missing_package
from rose.runtime.placement import ROLES
from rose.runtime.rollouts import env_kwargs, load_rollout_function
from rose.tools.sandbox import TOOLS
from rose.traces import TRACE_NAMES

# Where a model runs: the dedicated workers, the trainer, the serving devices.
DEVICE_KEYS = ("rollout.device", "train.device", "serving.device")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"config: {message}")


def check_config(config: Config, mode: Mode | None = None) -> None:
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
    _check(s.model.lora is None, "serving.model.lora: the serving model serves as it is; model.lora is "
                                 "the policy's adapter")
    if m.lora is not None:
        try:
            m.lora.modules(_context("model", m))
        except ValueError as exc:
            raise ValueError(f"config: model.lora.{exc}") from None
        _check(t.sharding != "fsdp", "train.sharding=fsdp with model.lora is not supported; use ddp")
    _check_env(config)
    load_rollout_function(config.rollout.function)
    load_agent(config.rollout.agent)
    for tool in config.rollout.tools:
        _check(tool in TOOLS, f"rollout.tools: {tool!r} is not a tool; the tools are {', '.join(TOOLS)}")
    _check_backend(config)
    _check_serving_rollout(config)
    _check_serving_engine(config)
    _check(t.objective in OBJECTIVES, f"train.objective must be one of {', '.join(OBJECTIVES)}, "
                                      f"got {t.objective!r}")
    try:
        Objective.named(t.objective, **objective_options(config))
    except ValueError as exc:  # "objective: NAME must ...": NAME is the train key of that name
        raise ValueError(f"config: {str(exc).replace('objective: ', 'train.', 1)}") from None
    if t.max_staleness:
        _check(mode is not Mode.ELASTIC, "train.max_staleness: asynchronous RL runs in fixed or rose mode; "
                                         "elastic mode adds devices for one step's rollouts")
        _check(config.rollout.function == RolloutConfig().function,
               "train.max_staleness: asynchronous RL plays the default rollout's episodes as a stream "
               "(rose.rollout.stream); a rollout.function of your own is for synchronous runs (set "
               "rollout.agent to change how one trajectory is played)")
    _check(config.rollout.shards <= config.rollout.groups,
           f"rollout.shards ({config.rollout.shards}) must be at most rollout.groups "
           f"({config.rollout.groups}): each shard plays whole groups of every step")
    _check_loggers(t.logger)
    _check(t.sharding in SHARDINGS,
           f"train.sharding must be one of {', '.join(SHARDINGS)}, got {t.sharding!r}")
    _check(t.lr_schedule in ("constant", "cosine"),
           f"train.lr_schedule must be constant or cosine, got {t.lr_schedule!r}")
    _check(s.trace in TRACE_NAMES or Path(s.trace).is_file(),
           f"serving.trace must be one of {', '.join(TRACE_NAMES)} or a trace file, got {s.trace!r}")
    _check(s.spike_at_s is None or s.trace != "gamma",
           "serving.spike_at_s: the gamma trace is drawn afresh for each window and has no spike of its "
           "own; replay a recorded trace (serving.trace) or leave spike_at_s unset")
    _check(s.max_context >= s.max_output + 2, f"serving.max_context must exceed serving.max_output + 1 "
                                              f"(a prompt of at least one token), got {s.max_context} "
                                              f"and {s.max_output}")
    _check("max_rollout_turns" not in s.executor.changed(),
           "serving.executor.max_rollout_turns: a serving device's lease slots are "
           "rollout.serving_concurrency, the turns the run keeps on each; set that instead")
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
        "max_context_tokens", "kv_cache_mb", "max_sampling_rounds", "shards")},
    "rollout.temperature": (0, math.inf, True),  # 0: greedy
    "rollout.stall_timeout_s": (0, math.inf, False),
    "rollout.timeout_s": (0, math.inf, False),
    **{f"train.{k}": (1, math.inf, True) for k in (
        "steps", "checkpoint_every", "micro_batch_size", "data_parallel", "mini_batches")},
    "train.lr": (0, math.inf, False),
    "train.max_staleness": (0, math.inf, True),
    "rollout.extra_groups": (0, math.inf, True),
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
    **{f"serving.{k}": (0, math.inf, False) for k in ("load", "prompt_scale", "output_scale", "window_s",
                                                      "spike_s")},
    "serving.spike_at_s": (0, math.inf, True),
    **{f"serving.{k}": (1, math.inf, True) for k in ("max_context", "max_output")},
}


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


def _check_serving_rollout(config: Config) -> None:
    """serving.rollout=adapter: the policy a LoRA adapter of the very model the devices serve, on
    the native engine (the one whose forward takes the adapter's rows beside serving's)."""
    m, s = config.model, config.serving
    if s.rollout is not ServingRollout.ADAPTER:
        return
    _check(m.lora is not None, "serving.rollout=adapter runs the policy as a LoRA adapter of the serving "
                               "model: set model.lora (or serving.rollout=model)")
    _check(m.identity() == s.model.identity(),
           f"serving.rollout=adapter: the policy's base must be the serving model; model is "
           f"{_named(m.identity())}, serving.model {_named(s.model.identity())} (give both the same path, "
           f"pretrained, or arch/preset/seed)")
    _check(s.engine is Engine.NATIVE,
           "serving.rollout=adapter with serving.engine=vllm: adapter mode runs on the native engine")


def _named(identity: tuple[str, ...]) -> str:
    """A `ModelSource.identity` as the config's keys give it."""
    kind, *rest = identity
    if kind == "preset":
        return "arch {} preset {} seed {}".format(*rest)
    return f"{kind} {rest[0]}"


def _check_serving_engine(config: Config) -> None:
    """serving.engine: vLLM importable here and able to run the serving model on its device; the
    pool split between vLLM and the rollout model only where vLLM serves."""
    s = config.serving
    if s.engine is not Engine.VLLM:
        _check("serving_pool_share" not in s.executor.changed(),
               "serving.executor.serving_pool_share: with serving.engine=native the serving devices keep "
               "one pool for both models; the share is vLLM's KV cache, with serving.engine=vllm")
        return
    _check(importlib.util.find_spec("vllm") is not None,
           "serving.engine=vllm needs the vllm package, which is not installed in this Python: run "
           "`make install-vllm` and start the run from .venv-vllm (.venv-vllm/bin/rose train ...)")
    try:
        check_model(_context("serving.model", s.model), str(resolve(s.device)[0]))
    except ValueError as exc:
        raise ValueError(f"config: serving.engine=vllm: {exc} (serving.model, serving.device)") from None


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


def _pages(config: ModelConfig, tokens: int, device: str | None, block_size: int = KVSpec.block_size) -> int:
    spec = KVSpec.of(config, resolve(device)[1], block_size)  # the device's default dtype
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
    if s.engine is Engine.VLLM:  # two caches: vLLM's share of the pool (its blocks, one kept back), the rest
        x, share = s.executor, s.executor.serving_pool_share
        need = _pages(serving, s.max_context + BLOCK_SIZE, s.device, BLOCK_SIZE)
        _check(x.pool_bytes * share >= need,
               f"serving.executor.pool_mb ({x.pool_mb:g}) x serving_pool_share ({share:g}), vLLM's KV cache, "
               f"cannot hold one serving request of serving.max_context ({s.max_context}); it needs at least "
               f"{-(-need // (1 << 20))} MB")
        need = _pages(policy, r.max_context_tokens, s.device)
        _check(x.pool_bytes * (1 - share) >= need,
               f"serving.executor.pool_mb ({x.pool_mb:g}) x (1 - serving_pool_share ({share:g})), the "
               f"rollout model's pool beside vLLM, cannot hold one rollout turn of "
               f"rollout.max_context_tokens ({r.max_context_tokens}); it needs at least "
               f"{-(-need // (1 << 20))} MB")
        return
    need = _pages(policy, r.max_context_tokens, s.device) + _pages(serving, s.max_context, s.device)
    _check(s.executor.pool_bytes >= need,
           f"serving.executor.pool_mb ({s.executor.pool_mb:g}) cannot hold one serving request of "
           f"serving.max_context ({s.max_context}) beside one rollout turn of rollout.max_context_tokens; "
           f"it needs at least "
           f"{-(-need // (1 << 20))} MB")
