"""`rose serve`'s settings: the executor's (`executor`, a `rose.coserve.settings.ExecutorConfig`)
and the process's and server's own, one key per command-line flag (`--port` is `port`, and each
executor setting's flag names its key in `executor`: `--pool-mb` is `executor.pool_mb`). A YAML
file (`--config`) and dotted overrides hold the same keys, through the shared loader
(`rose.config`). Importing this module loads no torch."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from rose.config import load
from rose.coserve.settings import MB, ChatOptions, Engine, ExecutorConfig, ServerLimits


@dataclasses.dataclass
class ServeConfig:
    model: str | None = None  # serving checkpoint (HF format); required
    rollout_model: str | None = None  # leases are refused without one (or a rollout_adapter)
    # A PEFT adapter directory loaded at start: of the rollout model, or without one of the serving
    # model, whose engine then runs the turns too (adapter mode)
    rollout_adapter: str | None = None
    rollout_adapter_name: str | None = None  # the name turns run it by; None: the directory's name
    engine: Engine = Engine.NATIVE  # what serves the serving model
    served_model_name: str | None = None  # None: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    executor: ExecutorConfig = dataclasses.field(default_factory=ExecutorConfig)
    device: str | None = None  # both models; None: cuda if there is one, else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    threads: int | None = None  # None: torch's default
    cores: str | None = None  # pin the process to these cores, e.g. "1" or "0-1"
    no_profile: bool = False
    iteration_log: str | None = None  # a JSON line per executor iteration goes to this file
    chat_template: str | None = ChatOptions.chat_template
    tool_call_parser: str = ChatOptions.tool_call_parser
    reasoning_parser: str | None = ChatOptions.reasoning_parser
    # Default sampling, as vLLM's flag: auto (the serving checkpoint's generation_config.json), vllm
    # (none: OpenAI's defaults), or a directory holding a generation_config.json.
    generation_config: str = "auto"
    api_key: str | None = ServerLimits.api_key  # load_serve_config: $ROSE_API_KEY when unset
    lease_key: str | None = ServerLimits.lease_key  # ... $ROSE_LEASE_KEY
    allow_open_lease: bool = ServerLimits.allow_open_lease  # a non-loopback host with no lease key
    shutdown_timeout: float = ServerLimits.drain_timeout_s  # vLLM's flag: the drain on SIGTERM, s
    disable_uvicorn_access_log: bool = False  # vLLM's flag: no line per HTTP request (on stdout)
    max_body_mb: float = ServerLimits.max_body_bytes / MB
    max_weights_mb: float = ServerLimits.max_weights_bytes / MB
    max_waiting: int = ServerLimits.max_waiting_per_model
    queue_timeout_s: float = ServerLimits.queue_timeout_s
    limit_concurrency: int = ServerLimits.max_connections

    @property
    def adapter_mode(self) -> bool:
        """Rollout turns ride the serving model with `rollout_adapter` (no rollout model)."""
        return self.rollout_model is None and self.rollout_adapter is not None

    def adapter_name(self) -> str:
        """The name turns run `rollout_adapter` by (`Turn.adapter`)."""
        return self.rollout_adapter_name or Path(self.rollout_adapter or "").resolve().name

    def chat_options(self) -> ChatOptions:
        return ChatOptions(chat_template=self.chat_template, tool_call_parser=self.tool_call_parser,
                           reasoning_parser=self.reasoning_parser)

    def server_limits(self) -> ServerLimits:
        return ServerLimits(api_key=self.api_key, lease_key=self.lease_key,
                            allow_open_lease=self.allow_open_lease, drain_timeout_s=self.shutdown_timeout,
                            max_body_bytes=int(self.max_body_mb * MB),
                            max_weights_bytes=int(self.max_weights_mb * MB),
                            max_waiting_per_model=self.max_waiting, queue_timeout_s=self.queue_timeout_s,
                            max_connections=self.limit_concurrency)


def load_serve_config(files: Sequence[str | Path] = (), overrides: Sequence[str] = (),
                      flags: Mapping[str, Any] | None = None) -> ServeConfig:
    """The defaults, the keys from the environment, the YAML file(s), `key=value` overrides, then
    the flags given (dotted keys: `executor.pool_mb`). The executor's checks run as it loads; the
    server's (`server_limits()`) and the lease key's on a non-loopback host once it has."""
    from rose.model.device import resolve  # torch: only once a config is checked

    environment = ServeConfig(api_key=os.environ.get("ROSE_API_KEY") or None,
                              lease_key=os.environ.get("ROSE_LEASE_KEY") or None)
    config = load(environment, files, overrides, flags)
    if config.model is None:
        raise ValueError("config: model: a serving checkpoint is required (--model, or model: in --config)")
    resolve(config.device, config.dtype, label="config: ")
    try:
        config.server_limits().check_bind(config.host)
    except ValueError as exc:
        raise ValueError(f"config: {exc}") from None
    try:
        config.chat_options()  # an unknown parser's name
    except ValueError as exc:
        raise ValueError(f"config: {exc}") from None
    if config.rollout_adapter is not None:
        _check_rollout_adapter(config)
    if config.chat_template is not None:
        config = dataclasses.replace(config, chat_template=_chat_template(config.chat_template))
    if config.engine is Engine.VLLM:
        if find_spec("vllm") is None:
            raise ValueError("config: engine: vllm is not installed in this Python (`make install-vllm` "
                             "makes .venv-vllm, which has it)")
        if config.rollout_model is None:
            raise ValueError("config: engine: vllm serves beside a rollout model, which it needs "
                             "(--rollout-model; adapter mode, --rollout-adapter alone, runs on the "
                             "native engine)")
    return config


def _check_rollout_adapter(config: ServeConfig) -> None:
    """`--rollout-adapter` names a PEFT adapter directory, of the rollout model (its shapes are
    checked against the model once both load), or in adapter mode of the serving model: its
    base must be that model."""
    from rose.model.lora import CONFIG_FILE, WEIGHTS_FILE, check_base

    path = Path(config.rollout_adapter or "")
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (path / name).is_file()]
    if missing:
        raise ValueError(f"config: rollout_adapter: {path} has no {missing[0]}; expected a PEFT adapter "
                         "directory")
    if config.adapter_mode:
        check_base(path, config.model or "", "config: rollout_adapter (adapter mode: no rollout model)")


def _chat_template(value: str) -> str:
    """`--chat-template`, as vLLM takes it: a file's path, else the template itself; its text,
    checked as Jinja before any model loads."""
    import jinja2

    path = Path(value)
    is_file = len(value) < 4096 and "\n" not in value and path.is_file()
    text = path.read_text() if is_file else value
    if not is_file and "{{" not in text and "{%" not in text:
        raise ValueError(f"config: chat_template: {value[:200]!r} is neither a file nor a Jinja template")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"config: chat_template: not a valid Jinja template (line {e.lineno}: {e.message})"
                         ) from None
    return text


# generation_config.json's keys that set a request's default sampling, as vLLM reads them, by the
# request field each sets.
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(config: ServeConfig) -> dict[str, float | int]:
    """What a request samples with where it sets nothing, by `generation_config`: the model
    creator's recommendation (a Qwen3 checkpoint's temperature 0.6, top_p 0.95, top_k 20), as
    `vllm serve` applies it by default; {} for `vllm`."""
    if config.generation_config == "vllm":
        return {}
    directory = Path(config.model if config.generation_config == "auto" else config.generation_config)
    file = directory / "generation_config.json"
    if not file.is_file():
        if config.generation_config != "auto":
            raise ValueError(f"config: generation_config: no generation_config.json in {directory}")
        return {}
    raw = json.loads(file.read_text())
    return {field: raw[key] for key, field in _SAMPLING_KEYS.items() if raw.get(key) is not None}
