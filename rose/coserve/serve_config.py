"""`rose serve`'s settings: one key per command-line flag (`--pool-mb` is `pool_mb`), each default
taken from the executor's or the server's own dataclass. A YAML file (`--config`) and dotted
overrides hold the same keys, through the shared loader (`rose.config`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rose.config import load
from rose.coserve.executor import ExecutorConfig, Policy
from rose.coserve.server import ServerLimits
from rose.model.device import resolve

MB = 1024**2
POLICIES = tuple(p.value for p in Policy)


@dataclasses.dataclass
class ServeConfig:
    model: str | None = None  # serving checkpoint (HF format); required
    rollout_model: str | None = None  # leases are refused without one
    served_model_name: str | None = None  # None: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    slo_ttft_ms: float = ExecutorConfig.slo_ttft_ms
    slo_tpot_ms: float = ExecutorConfig.slo_tpot_ms
    tpot_inflation: float = ExecutorConfig.tpot_inflation
    ttft_inflation: float = ExecutorConfig.ttft_inflation
    admission_quantile: float = ExecutorConfig.admission_quantile
    pool_mb: float = ExecutorConfig.pool_bytes / MB
    headroom: float = ExecutorConfig.headroom
    policy: str = ExecutorConfig.policy.value
    max_rollout_turns: int = ExecutorConfig.max_rollout_turns
    device: str | None = ExecutorConfig.device  # None: cuda if there is one, else cpu
    dtype: str | None = ExecutorConfig.dtype  # None: bfloat16 on cuda, float32 on cpu
    threads: int | None = None  # None: torch's default
    cores: str | None = None  # pin the process to these cores, e.g. "1" or "0-1"
    no_profile: bool = False
    api_key: str | None = ServerLimits.api_key  # load_serve_config: $ROSE_API_KEY when unset
    lease_key: str | None = ServerLimits.lease_key  # ... $ROSE_LEASE_KEY
    max_body_mb: float = ServerLimits.max_body_bytes / MB
    max_weights_mb: float = ServerLimits.max_weights_bytes / MB
    max_waiting: int = ServerLimits.max_waiting_per_model
    queue_timeout_s: float = ServerLimits.queue_timeout_s
    limit_concurrency: int = ServerLimits.max_connections

    def executor_config(self) -> ExecutorConfig:
        return ExecutorConfig(pool_bytes=int(self.pool_mb * MB), headroom=self.headroom,
                              slo_ttft_ms=self.slo_ttft_ms, slo_tpot_ms=self.slo_tpot_ms,
                              tpot_inflation=self.tpot_inflation, ttft_inflation=self.ttft_inflation,
                              admission_quantile=self.admission_quantile, policy=Policy(self.policy),
                              max_rollout_turns=self.max_rollout_turns, device=self.device, dtype=self.dtype)

    def server_limits(self) -> ServerLimits:
        return ServerLimits(api_key=self.api_key, lease_key=self.lease_key,
                            max_body_bytes=int(self.max_body_mb * MB),
                            max_weights_bytes=int(self.max_weights_mb * MB),
                            max_waiting_per_model=self.max_waiting, queue_timeout_s=self.queue_timeout_s,
                            max_connections=self.limit_concurrency)


def load_serve_config(files: Sequence[str | Path] = (), overrides: Sequence[str] = (),
                      flags: Mapping[str, Any] | None = None) -> ServeConfig:
    """The defaults, the keys from the environment, the YAML file(s), `key=value` overrides, then
    the flags given. The executor's and the server's own checks run in `executor_config()` and
    `server_limits()`."""
    environment = ServeConfig(api_key=os.environ.get("ROSE_API_KEY") or None,
                              lease_key=os.environ.get("ROSE_LEASE_KEY") or None)
    config = load(environment, files, overrides, flags)
    if config.model is None:
        raise ValueError("config: model: a serving checkpoint is required (--model, or model: in --config)")
    if config.policy not in POLICIES:
        raise ValueError(f"config: policy must be one of {', '.join(POLICIES)}, got {config.policy!r}")
    resolve(config.device, config.dtype, label="config: ")
    return config
