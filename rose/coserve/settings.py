"""The co-serving settings, defined once: the executor's (`ExecutorConfig`) and the HTTP server's
limits (`ServerLimits`).

`ExecutorConfig` is one field wherever an executor is configured: `executor` in `rose serve`'s
config (its flags, e.g. `--slo-ttft-ms`, set `executor.slo_ttft_ms`), `serving.executor` in
`rose train`'s (its serving devices) and in the simulator's scenarios (each simulated serving
replica). Its defaults are the only ones; a config that needs another value states it. Plain
data, no torch: every config schema imports it.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import math
import socket
from typing import Any

from rose.coserve.reasoning import check_reasoning_parser
from rose.tools.tool_parsers import check_tool_parser

MB = 1024**2

# The policy's default settings, which the admission functions (`rose.coserve.admission`) take
# as their own defaults too.
HEADROOM = 0.2          # H: share of the pool only serving may use (design default)
HIGH_WATERMARK = 0.5    # burst when serving has eaten this share of H
CHUNK_TOKENS = 512      # serving prompt tokens prefilled per iteration (chunked prefill)
# "Serving never notices": rollouts may add at most this share of a serving request's own
# decode time to it (its TPOT), and of its own time to first token to its TTFT (docs/coserve.md,
# "Admission"; measured in docs/benchmarks.md).
TPOT_INFLATION = 0.10
TTFT_INFLATION = 0.03
# TTFT room kept for a serving request that may arrive while an iteration runs: it waits for the
# iteration, then prefills this many tokens, within B_TTFT (`admission.rollout_time_cap`).
ARRIVAL_RESERVE_TOKENS = 512
# With no serving request in flight rollouts always get at least this many tokens
# (`admission.admission_step`).
IDLE_MIN_ROLLOUT_TOKENS = 32


class Policy(str, enum.Enum):  # a str: a config dumped as JSON (a report) holds its value
    ROSE = "rose"  # dual-SLO admission and burst control
    NAIVE = "naive"  # rollouts take whatever pages and tokens they like, no priority
    STATIC = "static"  # a fixed page split and a fixed rollout token budget
    # vLLM's priority scheduling across two models: serving first every iteration, rollouts fill
    # what it leaves of the iteration's token budget and of memory; no SLO budgets
    # (`admission.priority_step`)
    PRIORITY = "priority"


class Engine(str, enum.Enum):
    """What serves the serving model (the rollout model runs on the native engine either way)."""

    NATIVE = "native"  # ROSE's engine, from the KV pool both models share
    VLLM = "vllm"  # vLLM's, in this process, its KV cache its own (rose.coserve.vllm_serving)


def _setting(default: Any, text: str) -> Any:
    """A field with the one-line help `rose serve --help` shows for its flag."""
    return dataclasses.field(default=default, metadata={"help": text})


@dataclasses.dataclass(frozen=True)
class ExecutorConfig:
    """The co-serving executor's settings (`rose.coserve.executor.CoServingExecutor`): its KV
    pool, the SLOs it keeps, rollout admission and burst control. Each field's help is its
    `rose serve` flag's."""

    pool_mb: float = _setting(256.0, "KV page pool shared by both models, MiB")
    headroom: float = _setting(HEADROOM, "share of the pool reserved for serving")
    serving_pool_share: float = _setting(0.5, "with --engine vllm: vLLM's share, on the CPU of the pool (its "
                                         "KV cache), on cuda of --gpu-memory-utilization (its weights, "
                                         "activations and KV cache); the rollout model's is the rest")
    # vLLM's own flag and default, for what both models take of one GPU (rose.coserve.device_memory).
    gpu_memory_utilization: float = _setting(0.9, "with --engine vllm on cuda: the share of the GPU's memory "
                                             "both models may take (weights, activations, KV caches); "
                                             "sizes them in place of --pool-mb")
    high_watermark: float = _setting(HIGH_WATERMARK, "burst when serving has used this share of the headroom")
    slo_ttft_ms: float = _setting(1000.0, "serving's time-to-first-token objective (SLO), ms")
    slo_tpot_ms: float = _setting(200.0, "serving's time-per-output-token objective (SLO), ms")
    chunk_tokens: int = _setting(CHUNK_TOKENS, "serving prompt tokens prefilled per iteration")
    max_num_seqs: int = _setting(64, "sequences each engine runs at once")
    max_rollout_turns: int = _setting(32, "lease slots: rollout turns running at once; more get a 429")
    # `_setting` spelled out: ruff takes a call there for a shared mutable default (RUF009).
    policy: Policy = dataclasses.field(default=Policy.ROSE, metadata={
        "help": "rollout admission: rose (dual-SLO + burst control), naive, static, priority (serving "
                "first, rollouts fill the rest of each iteration's tokens and memory)"})
    static_rollout_pages: float = _setting(0.5, "static policy: rollout's fixed share of the pool")
    static_rollout_tokens: int = _setting(64, "static policy: rollout tokens per iteration")
    # Inflation budgets (TPOT_INFLATION says what they bound); a rollout step on an idle device is
    # capped at ttft_inflation x B_TTFT (and an arriving request interrupts it between layers).
    tpot_inflation: float = _setting(TPOT_INFLATION, "share of a serving request's own decode time "
                                                     "rollouts may add (inf: the SLO alone)")
    ttft_inflation: float = _setting(TTFT_INFLATION, "share of a serving request's own time to first token "
                                                     "rollouts may add (inf: the SLO alone)")
    # Admission predicts iteration times at this quantile of the latency model's measured
    # error (1.0: its largest recent error; 0.5: about its mean).
    admission_quantile: float = _setting(0.95, "quantile of the latency model's error admission predicts at")
    # TTFT room is kept for a request that may arrive while an iteration runs: it waits for
    # the iteration, then prefills this many tokens, within B_TTFT (0: no such reserve).
    arrival_reserve_tokens: int = _setting(ARRIVAL_RESERVE_TOKENS, "prompt tokens of a request that may "
                                                                   "arrive mid-iteration (0: none)")
    # With no serving request in flight rollouts always get at least this many tokens, so that
    # a latency model that overestimates (noisy profile) cannot starve them: each such
    # iteration is also a measurement that corrects the fit.
    idle_min_rollout_tokens: int = _setting(IDLE_MIN_ROLLOUT_TOKENS, "rollout tokens an iteration with no "
                                                                     "serving request always admits")
    # The context a new rollout turn is taken to attend to when counting free slots, while no
    # rollout sequence runs to measure it from.
    typical_rollout_context: int = _setting(1024, "context a new rollout turn is counted at while none runs")

    def __post_init__(self) -> None:
        # Each message starts with the key, so that a config loader can put its path in front.
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")

        need(math.isfinite(self.pool_mb) and self.pool_mb > 0, "pool_mb", "positive")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            need(getattr(self, name) > 0, name, "positive")
        for name in ("chunk_tokens", "max_num_seqs", "max_rollout_turns", "static_rollout_tokens"):
            need(getattr(self, name) >= 1, name, ">= 1")
        for name in ("arrival_reserve_tokens", "idle_min_rollout_tokens", "typical_rollout_context"):
            need(getattr(self, name) >= 0, name, ">= 0")
        need(0 < self.headroom < 1, "headroom", "in (0, 1)")
        need(0 < self.serving_pool_share < 1, "serving_pool_share", "in (0, 1)")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]")
        need(0 < self.high_watermark <= 1, "high_watermark", "in (0, 1]")
        need(0 < self.static_rollout_pages < 1, "static_rollout_pages", "in (0, 1)")
        need(0 < self.admission_quantile <= 1, "admission_quantile", "in (0, 1]")
        for name in ("tpot_inflation", "ttft_inflation"):
            need(getattr(self, name) >= 0, name, ">= 0 (inf: the SLOs alone bound rollouts)")

    @property
    def pool_bytes(self) -> int:
        return int(self.pool_mb * MB)

    def changed(self) -> list[str]:
        """The settings whose values differ from the defaults."""
        default = ExecutorConfig()
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(default, f.name)]


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Who may call, and how much any caller may ask of the server."""

    api_key: str | None = None  # bearer key of the OpenAI API; None: open
    lease_key: str | None = None  # bearer key of /v1/lease/*; None: open (only on loopback, `check_bind`)
    allow_open_lease: bool = False  # lets a non-loopback bind leave the lease API without a key
    max_body_bytes: int = 4 * 1024**2
    max_weights_bytes: int = 64 * 1024**3  # POST /v1/lease/weights: a whole model
    max_waiting_per_model: int = 256  # requests of one model waiting for their first token
    queue_timeout_s: float = 120.0  # no first token by then: aborted, answered 503
    health_timeout_s: float = 10.0  # the engine loop must answer /health within this
    # On SIGTERM: open serving requests may finish for this long (new ones are refused), then
    # what is left is cut. 25 s: the drain and the exit fit Kubernetes' default 30 s grace period.
    drain_timeout_s: float = 25.0
    shutdown_timeout_s: float = 5.0  # waited for the engine thread to stop at exit
    max_connections: int = 1024  # uvicorn's limit_concurrency: connections beyond it get a 503

    def __post_init__(self) -> None:
        for name in ("api_key", "lease_key"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must be a non-empty string, or None for no key")
        for name in ("max_body_bytes", "max_weights_bytes", "max_waiting_per_model", "queue_timeout_s",
                     "health_timeout_s", "shutdown_timeout_s", "max_connections"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0 (0: cut open requests at once), "
                             f"got {self.drain_timeout_s!r}")

    def check_bind(self, host: str) -> None:
        """Refuse to serve the lease API (rollout turns, weight pushes) without a key on `host`
        unless it is a loopback address, or the opening is asked for. The OpenAI API's key does
        not guard the lease API."""
        if self.lease_key is None and not self.allow_open_lease and not _loopback(host):
            raise ValueError(f"host {host!r} is not a loopback address and the lease API (/v1/lease/*: "
                             "rollout turns, weight pushes) has no key: set --lease-key (or "
                             "$ROSE_LEASE_KEY), or pass --allow-open-lease to open it to anyone who "
                             "reaches the port")


def _loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (a name is resolved; "" and a name
    that does not resolve are not)."""
    try:
        infos = socket.getaddrinfo(host, None) if host else []
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How chat requests are rendered and their replies read: vLLM's server flags of one name."""

    chat_template: str | None = None  # a Jinja template, or a file holding one; None: the model's
    tool_call_parser: str = "auto"  # the tool-call format in replies; auto: the template's own
    reasoning_parser: str | None = None  # reasoning text split off as `reasoning`; None: kept

    def __post_init__(self) -> None:
        check_tool_parser(self.tool_call_parser)
        check_reasoning_parser(self.reasoning_parser)
