"""`rose train`'s configuration: dataclass schemas, YAML files and dotted overrides (OmegaConf).

Everything that can be wrong is checked before anything starts (no Ray, no model loads): an
unknown key, a value of the wrong type, more cores than the machine has, a checkpoint that is
not there. Each failure is one `ValueError` line naming the key and what is expected.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rose.model.presets import ARCHS, PRESETS
from rose.rl.envs import list_envs
from rose.runtime.devices import available_cores


class Mode(enum.Enum):
    FIXED = "fixed"  # dedicated devices only
    ELASTIC = "elastic"  # plus devices started on demand, each paying start-up and provisioning
    ROSE = "rose"  # plus the idle capacity of serving devices


@dataclasses.dataclass
class ModelConfig:
    arch: str = "qwen3"
    preset: str = "tiny"
    seed: int = 0
    path: str | None = None  # an existing HF-format checkpoint instead of a random one


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


@dataclasses.dataclass
class TrainConfig:
    steps: int = 100
    objective: str = "grpo"
    scale_advantages: bool = True  # divide by the group's reward std (GRPO); false: Dr. GRPO
    step_advantage_weight: float = 0.0  # GiGPO's step-level credit (rose.rl.objective); 0: off
    discount: float = 0.95  # of the returns-to-go the step level compares
    lr: float = 3e-3
    lr_schedule: str = "cosine"  # down to lr * min_lr_ratio at train.steps, or "constant"
    min_lr_ratio: float = 0.1
    micro_batch_size: int = 32
    data_parallel: int = 1  # trainer ranks, each a Ray actor on its share of devices.trainer (gloo)
    mini_batches: int = 4  # optimizer updates per step (docs/rl.md: 2 learned more slowly)
    checkpoint_every: int = 10
    out_dir: str = "runs/train"
    seed: int = 0


@dataclasses.dataclass
class DevicesConfig:
    trainer: list[int] = dataclasses.field(default_factory=lambda: [0])
    dedicated: list[list[int]] = dataclasses.field(default_factory=lambda: [[0]])
    serving: list[list[int]] = dataclasses.field(default_factory=lambda: [[1]])  # rose mode
    elastic: list[list[int]] = dataclasses.field(default_factory=lambda: [[1]])  # elastic mode
    provision_delay_s: float = 5.0  # elastic: waiting for an allocation, before the real start-up


@dataclasses.dataclass
class ServingConfig:
    arch: str = "qwen2"
    preset: str = "tiny"
    seed: int = 1
    trace: str = "azure-conv"
    load: float = 0.5
    prompt_scale: float = 0.25
    output_scale: float = 0.25
    max_context: int = 512
    max_output: int = 64
    window_s: float = 10.0
    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 100.0
    pool_mb: int = 64


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    devices: DevicesConfig = dataclasses.field(default_factory=DevicesConfig)
    serving: ServingConfig = dataclasses.field(default_factory=ServingConfig)
    ray_address: str | None = None  # None: a local Ray instance started on demand


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """The embedded default, then the YAML file, then `key=value` overrides; validated."""
    try:
        conf = OmegaConf.structured(Config)
        if path is not None:
            if not Path(path).is_file():
                raise ValueError(f"config file {path} does not exist")
            conf = OmegaConf.merge(conf, OmegaConf.load(path))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"override {bad[0]!r} is not key=value")
        conf = OmegaConf.merge(conf, OmegaConf.from_dotlist(list(overrides)))
        config: Config = OmegaConf.to_object(conf)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        message = str(getattr(exc, "msg", exc)).splitlines()[0]
        raise ValueError(f"config: {key + ': ' if key else ''}{message}") from None
    validate(config)
    return config


def validate(config: Config, mode: Mode | None = None) -> None:
    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f"config: {message}")

    m, r, t, d, s = config.model, config.rollout, config.train, config.devices, config.serving
    for name, arch, preset in (("model", m.arch, m.preset), ("serving", s.arch, s.preset)):
        check(arch in ARCHS, f"{name}.arch must be one of {', '.join(ARCHS)}, got {arch!r}")
        check(preset in PRESETS, f"{name}.preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    check(m.path is None or (Path(m.path) / "config.json").is_file(),
          f"model.path {m.path} is not an HF-format checkpoint (no config.json)")
    check(config.env.name in list_envs(), f"env.name must be one of {', '.join(list_envs())}, "
                                          f"got {config.env.name!r}")
    for name in ("groups", "group_size", "max_tokens", "dedicated_concurrency", "serving_concurrency"):
        check(getattr(r, name) >= 1, f"rollout.{name} must be >= 1, got {getattr(r, name)}")
    check(r.stall_timeout_s > 0 and r.timeout_s > 0, "rollout.stall_timeout_s and timeout_s must be > 0")
    check(t.steps >= 1 and t.checkpoint_every >= 1, "train.steps and train.checkpoint_every must be >= 1")
    check(t.data_parallel >= 1, f"train.data_parallel must be >= 1, got {t.data_parallel}")
    check(t.objective in ("grpo", "dapo"), f"train.objective must be grpo or dapo, got {t.objective!r}")
    check(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    check(t.lr_schedule in ("constant", "cosine"),
          f"train.lr_schedule must be constant or cosine, got {t.lr_schedule!r}")
    check(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    check(t.step_advantage_weight >= 0,
          f"train.step_advantage_weight must be >= 0, got {t.step_advantage_weight}")
    check(0 <= t.discount <= 1, f"train.discount must be in [0, 1], got {t.discount}")
    check(d.provision_delay_s >= 0, "devices.provision_delay_s must be >= 0")
    check(bool(d.dedicated), "devices.dedicated needs at least one device")
    cores = available_cores()
    for name, devices in (("trainer", [d.trainer]), ("dedicated", d.dedicated), ("serving", d.serving),
                          ("elastic", d.elastic)):
        for device in devices:
            check(bool(device), f"devices.{name}: a device needs at least one core")
            missing = sorted(set(device) - cores)
            check(not missing, f"devices.{name} uses core(s) {missing}, but this machine has only "
                               f"{sorted(cores)}; give fewer devices or cores")
    check(s.slo_ttft_ms > 0 and s.slo_tpot_ms > 0 and s.load > 0 and s.window_s > 0,
          "serving.slo_ttft_ms, slo_tpot_ms, load and window_s must be > 0")
    if mode is Mode.ROSE:
        check(bool(d.serving), "mode rose needs at least one serving device (devices.serving)")
    if mode is Mode.ELASTIC:
        check(bool(d.elastic), "mode elastic needs at least one device to add (devices.elastic)")


def resume_checkpoint(resume: str | Path | None) -> Path | None:
    """The checkpoint to resume from: `resume` itself or its newest `step-*` directory."""
    if resume is None:
        return None
    path = Path(resume)
    if (path / "config.json").is_file():
        return path
    steps = sorted(path.glob("step-*/config.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not steps:
        raise ValueError(f"--resume {resume}: no checkpoint there (expected config.json or step-N/ dirs)")
    return steps[-1].parent
